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


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        assert len(rel.parts) == 1 or rel.parts[0] in LAYERS, rel


def test_every_module_opens_with_its_one_job_in_three_lines_at_most():
    # Length is no measure of a module; one job is. The package's own docstring
    # lists the public names instead (tests/test_public_api.py reads it).
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines = [line for line in doc.splitlines() if line.strip()]
        if not 1 <= len(lines) <= 3:
            long.append(f"{path.relative_to(PACKAGE)}: {len(lines)} lines")
    assert not long, long


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_no_module_imports_one_that_imports_it_back():
    # Module-level and function-level imports alike: a cycle of two modules is a
    # sign that one of them does the other's job.
    names = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def targets(path: Path) -> set[str]:
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import sub`` depends on pkg.sub, not on pkg's __init__.
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(names)
                out |= subs or {node.module}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
        return out & set(names)

    graph = {name: targets(path) - {name} for name, path in names.items()}
    cycles = sorted(
        f"{a} <-> {b}" for a, targets in graph.items() for b in targets if a < b and a in graph[b]
    )
    assert not cycles, cycles


COLLECTIVES = (
    "broadcast",
    "all_gather",
    "all_reduce",
    "allgather",
    "allreduce",
    "reduce_scatter",
    "barrier",
    "send(",
    "recv(",
    "init_process_group",
    "new_group",
    "destroy_process_group",
)


def test_only_the_group_coordinator_runs_collectives():
    # Every collective of every group goes through tp/coordinator.py, the one place
    # a collective's failure becomes the group's (docs/tp.md §6).
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "coordinator.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if ("dist." in code or "distributed" in code) and any(c in code for c in COLLECTIVES):
                offenders.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not offenders, offenders
