"""``from pp1wire import …`` is the public API: cheap to import, documented, and the only
thing the examples and documents import.

The scan covers ``examples/*.py``, ``docs/*.md`` and the code blocks of
``README.md``. ``benchmarks/`` and ``tests/`` are exempt: they measure and check
the internals themselves. Commands such as ``python -m pp1wire.wire.schema`` are
entry points, not imports, and are not scanned.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pp1wire

ROOT = Path(__file__).resolve().parent.parent
TP_NAMES = {"GroupCoordinator", "GroupFailedError", "GroupItem", "SparkGroup"}
PUBLIC = set(pp1wire.__all__) | TP_NAMES


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_importing_the_package_loads_nothing_else():
    out = run_python(
        "import sys; import pp1wire\n"
        "print(sorted(m for m in sys.modules if m.startswith('pp1wire') or m in "
        "('numpy', 'torch', 'msgspec', 'asyncio')))"
    )
    assert out.strip() == "['pp1wire']"


def test_star_import_gives_every_name_and_never_needs_torch():
    out = run_python(
        "import sys; sys.modules['torch'] = None  # any 'import torch' now fails\n"
        "from pp1wire import *\n"
        "import pp1wire\n"
        "missing = [n for n in pp1wire.__all__ if n not in globals()]\n"
        "print(missing, 'torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    assert out.strip() == "[] False"


def test_every_public_name_is_documented_and_listed_in_the_package_docstring():
    doc = pp1wire.__doc__ or ""
    for name in sorted(PUBLIC):
        if name in TP_NAMES:
            pytest.importorskip("torch")
        value = getattr(pp1wire, name)
        assert f"{name}" in doc, name
        if callable(value):
            assert (value.__doc__ or "").strip(), name
    with pytest.raises(AttributeError):
        _ = pp1wire.verify_batch  # internal: not re-exported


def test_the_public_errors_are_one_type_per_kind():
    kinds = [
        pp1wire.UsageError,
        pp1wire.RefusedError,
        pp1wire.ConnectionLostError,
        pp1wire.ProposalUnavailableError,
        pp1wire.VerifyError,
    ]
    for kind in kinds:
        assert issubclass(kind, pp1wire.Pp1Error)
        for other in kinds:
            assert kind is other or not issubclass(kind, other)
    assert pp1wire.UsageError().code is pp1wire.ErrorCode.BAD_ARGUMENT


# -- what the examples and documents import ------------------------------------------

_FROM = re.compile(r"^\s*from\s+(pp1wire(?:\.[\w.]+)?)\s+import\s+(\([^)]*\)|[^\n]+)", re.M)
_IMPORT = re.compile(r"^\s*import\s+(pp1wire\.[\w.]+)", re.M)
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def _names(clause: str) -> list[str]:
    clause = re.sub(r"#[^\n]*", "", clause).strip("() \n")  # comments, then the parentheses
    return [part.split(" as ")[0].strip() for part in clause.split(",") if part.strip()]


def _problems(where: str, code: str) -> list[str]:
    out = [f"{where}: import {m}" for m in _IMPORT.findall(code)]
    for module, clause in _FROM.findall(code):
        if module != "pp1wire":
            out.append(f"{where}: from {module} import …")
            continue
        out += [f"{where}: pp1wire.{n} is not public" for n in _names(clause) if n not in PUBLIC]
    return out


def _scanned() -> list[tuple[str, str]]:
    texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(ROOT.glob("examples/*.py"))]
    for path in [*sorted(ROOT.glob("docs/*.md")), ROOT / "README.md"]:
        for n, block in enumerate(_FENCE.findall(path.read_text())):
            texts.append((f"{path.relative_to(ROOT)} block {n}", block))
    return texts


def test_no_example_or_document_imports_a_non_public_module():
    scanned = _scanned()
    assert len(scanned) > 15  # the examples and every fenced block were found
    for doc in ("README.md", "docs/embedding.md"):  # each with its sampler loop
        assert any(w.startswith(f"{doc} block") and "from pp1wire import" in c for w, c in scanned)
    problems = [p for where, code in scanned for p in _problems(where, code)]
    assert not problems, problems


def test_the_scan_finds_what_it_must_refuse():
    bad = "from pp1wire.aio.client import AsyncClient\nimport pp1wire.q.verify\n"
    bad += "from pp1wire import (\n    SyncClient,  # fine\n    verify_batch,\n)\n"
    assert _problems("x", bad) == [
        "x: import pp1wire.q.verify",
        "x: from pp1wire.aio.client import …",
        "x: pp1wire.verify_batch is not public",
    ]


def test_the_examples_parse_and_import_only_the_package_root():
    for path in sorted(ROOT.glob("examples/*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pp1wire"):
                assert node.module == "pp1wire", path
                assert {a.name for a in node.names} <= PUBLIC, path
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("pp1wire.") for a in node.names), path
