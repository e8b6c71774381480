"""The package's folders are layers: each imports only from the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pp1wire"
# Lowest first. A module may import its own layer and the ones before it.
LAYERS = ["errors", "q", "wire", "aio", "tp", "apps", "testing"]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "pp1wire" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out.extend(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_imports_point_down_the_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            own = LAYERS.index("errors") if rel.stem == "errors" else None
        else:
            own = LAYERS.index(rel.parts[0])
        if own is None:
            continue
        for module in _imports(path):
            layer = _layer(module)
            if layer is not None and layer > own:
                wrong.append(f"{rel} imports {module}")
    assert not wrong, wrong


def test_every_module_has_a_layer_and_none_is_too_long():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        assert len(rel.parts) == 1 or rel.parts[0] in LAYERS, rel
        assert len(path.read_text().splitlines()) <= 800, rel
