"""README.md is a front page, and it and the pages it sends readers to name a true tree.

The front page fits in 15,000 bytes and opens with the two set-up commands; the
documents together fit in 200 KB. Every path, module, link and section number
that README.md, docs/operators.md and docs/benchmarks.md name exists, README's
table names every subpackage in its layer order, and the operators' flag table
names every flag of both daemons and no other.
"""

from __future__ import annotations

import ast
import re
import shlex
import tomllib
from pathlib import Path

from .test_layers import LAYERS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
OPERATORS = ROOT / "docs" / "operators.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
MAPPED = [README, OPERATORS, BENCHMARKS]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
# A path into the tree: its first folder, then anything a file name may hold.
PATH = re.compile(
    r"(?<![\w./-])((?:pp1wire|docs|benchmarks|examples|tests|fuzz|golden|schemas|docker)/[\w./-]*)"
)
REDIRECT = re.compile(r">\s*(\S+)")  # a file the reader's own command writes
MODULE = re.compile(r"(?<![\w./-])(pp1wire(?:\.\w+)+)(?::(\w+))?")
LINK = re.compile(r"\]\(([^)\s]+)\)")
SECTION_REF = re.compile(r"([\w-]+\.md)\W{0,3}§(\d+(?:\.\d+)*)")
LINKED_SECTION = re.compile(r"\[§(\d+(?:\.\d+)*)\]\(([\w-]+\.md)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
NUMBERED = re.compile(r"^#{2,6} (\d+(?:\.\d+)*)\.? ", re.M)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))}


def _sections(path: Path) -> set[str]:
    return set(NUMBERED.findall(FENCE.sub("", path.read_text())))


def _top_level_names(source: Path) -> set[str]:
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update(a.asname or a.name for a in node.names)
    return names


def _module_has(dotted: str, attr: str | None) -> bool:
    """Whether ``dotted`` (a module, or a module and one name) exists, read without importing."""
    parts = dotted.split(".")
    rest = [attr] if attr else []
    while parts:
        base = ROOT.joinpath(*parts)
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if source.is_file():
                return not rest or (len(rest) == 1 and rest[0] in _top_level_names(source))
        rest.insert(0, parts.pop())
    return False


def problems(path: Path, text: str) -> list[str]:
    """Every name in ``text`` (read as the document at ``path``) that the tree does not hold."""
    out = []
    prose = text
    written = {m.group(1) for block in FENCE.findall(text) for m in REDIRECT.finditer(block)}
    for found in PATH.findall(prose):
        name = found.rstrip(".")
        if name not in written and not (ROOT / name).exists():
            out.append(f"{path.name}: no {name}")
    for dotted, attr in MODULE.findall(prose):
        if not _module_has(dotted, attr or None):
            out.append(f"{path.name}: no {dotted}{':' + attr if attr else ''}")
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):
            continue  # another site
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            out.append(f"{path.name}: link to missing {target}")
        elif anchor and anchor not in _anchors(linked):
            out.append(f"{path.name}: no heading {target}")
    for number, file in LINKED_SECTION.findall(prose):
        if number not in _sections(ROOT / "docs" / file):
            out.append(f"{path.name}: no §{number} in {file}")
    unlinked = LINKED_SECTION.sub("", prose)
    for file, number in SECTION_REF.findall(unlinked):
        doc = ROOT / "docs" / file
        if not doc.is_file() or number not in _sections(doc):
            out.append(f"{path.name}: no §{number} in {file}")
    if path.parent.name == "docs":  # a bare § in a document is one of its own sections
        for number in re.findall(r"§(\d+(?:\.\d+)*)", SECTION_REF.sub("", unlinked)):
            if number not in _sections(path):
                out.append(f"{path.name}: no §{number} of its own")
    return out


def test_the_front_page_is_small():
    assert README.stat().st_size <= 15_000


def test_the_front_page_and_the_docs_fit_in_200_kb():
    total = README.stat().st_size + sum(p.stat().st_size for p in (ROOT / "docs").glob("*.md"))
    assert total <= 200_000, total


def _ci_commands() -> list[str]:
    """The commands ``.ci/run`` runs, in order, pip's spelled as the README spells them."""
    out = []
    for raw in (ROOT / ".ci" / "run").read_text().splitlines():
        line = raw.strip().replace(".venv/bin/python -m pip", ".venv/bin/pip")
        if line and not line.startswith(("#", "set ", "cd ")):
            out.append(" ".join(w for w in shlex.split(line) if w != "--quiet"))
    return out


def test_the_two_set_up_commands_come_first():
    text = README.read_text()
    first = FENCE.search(text)
    assert first is not None
    intro = text[: first.start()]
    assert len(intro.encode()) <= 2_000, "a short intro, then the set-up commands"
    assert intro.count("\n## ") == 1
    assert "\n## Set up\n" in intro
    demo, tests = (block.strip() for block in FENCE.findall(text)[:2])
    assert text.index("\n## ", first.end()) > text.index(tests), "both under Set up"

    # The main job: a virtual environment, the package installed, the demo run.
    steps = demo.split(" && ")
    assert steps == ["python3 -m venv .venv", ".venv/bin/pip install -e .", ".venv/bin/pp1-demo"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pp1-demo"] == "pp1wire.apps.demo:main"

    # The tests: what CI installs, in CI's order, and the test command CI runs last.
    steps = [" ".join(shlex.split(step)) for step in tests.split(" && ")]
    ci = _ci_commands()
    assert steps[0] == "python3 -m venv .venv"
    installs = [s for s in steps if s.startswith(".venv/bin/pip install")]
    ci_installs = [c for c in ci if c.startswith(".venv/bin/pip install") and "--upgrade" not in c]
    assert installs == ci_installs, (installs, ci_installs)
    assert steps == ["python3 -m venv .venv", *installs, ci[-1]]
    assert ci[-1] == ".venv/bin/python -m pytest"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"dev", "bench", "tp"} <= set(project["optional-dependencies"])


def _table_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not re.match(r"\|[-:| ]+\|$", line)
    ]


def test_the_map_names_every_subpackage_and_only_paths_that_exist():
    found = [p for path in MAPPED for p in problems(path, path.read_text())]
    assert not found, found

    text = README.read_text()
    start = text.index("## Where everything is")
    table = _table_rows(text[start : text.index("\n## ", start + 1)])
    firsts = [row[0] for row in table]
    packages = sorted(
        p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "pp1wire").rglob("__init__.py")
    )
    for package in packages[1:]:  # pp1wire itself is the table's `pp1wire/__init__.py` row
        if package.count("/") == 1:
            assert f"`{package}`" in firsts, f"README's map has no row for {package}"
        else:
            assert any(f"`{package}`" in " ".join(row) for row in table), package
    # In the layer order tests/test_layers.py enforces: each imports only from rows above.
    named = [n for cell in firsts for n in re.findall(r"`pp1wire/(\w+)", cell)]
    assert [n for n in named if n != "__init__"] == LAYERS, named


def test_the_map_check_finds_what_does_not_exist():
    bogus = (
        "`pp1wire/tp/batch.py` and [the rules](protocol.md#99-nothing), "
        "`pp1wire.apps.models:no_factory`, runner.md §42, [§4.4](protocol.md#44-step)\n"
        "```sh\nprintf x > docker/made_by_the_reader.txt\n```\n"
    )
    assert problems(OPERATORS, bogus) == [
        "operators.md: no pp1wire/tp/batch.py",
        "operators.md: no pp1wire.apps.models:no_factory",
        "operators.md: no heading protocol.md#99-nothing",
        "operators.md: no §42 in runner.md",
    ]


def test_the_demo_flags_the_front_page_names_exist():
    from pp1wire.apps import demo

    text = README.read_text()
    start = text.index("## Set up")
    named = set(re.findall(r"`(--[a-z0-9-]+)", text[start : text.index("\n## ", start + 1)]))
    have = {o for a in demo.build_parser()._actions for o in a.option_strings}
    assert named
    assert named <= have, sorted(named - have)


def _flag_table() -> list[tuple[list[str], str]]:
    text = OPERATORS.read_text()
    start = text.index("## 2. Configuration")
    rows = _table_rows(text[start : text.index("\n## ", start + 1)])
    assert rows[0][:2] == ["flag", "side"]
    return [(re.findall(r"`(--[a-z0-9-]+)", row[0]), row[1]) for row in rows[1:]]


def test_the_flag_table_names_every_flag_of_both_daemons_and_no_other():
    from pp1wire.apps import spark, worker

    def flags(parser) -> set[str]:
        names = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        return names - {"--help", "--config"}

    have = {"worker": flags(worker.build_parser()), "spark": flags(spark.build_parser())}
    listed: dict[str, set[str]] = {"worker": set(), "spark": set()}
    for names, side in _flag_table():
        assert names, side
        for daemon in ("worker", "spark") if side == "both" else (side,):
            missing = [n for n in names if n not in have[daemon]]
            assert not missing, (daemon, missing)
            listed[daemon].update(names)
    for daemon, names in have.items():
        assert not names - listed[daemon], (daemon, sorted(names - listed[daemon]))
