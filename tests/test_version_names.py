"""One protocol version in every text: PP1 v2, from ``WIRE_VERSION``.

The protocol went through pre-release drafts numbered 2, 3 and 4 before the
release took the design's number, 2. Only ``docs/protocol.md`` §11 may name
the drafts; any other text in the repository that names the protocol with a
version (a title, a help text, a conformance quote, a label, a schema ID)
must name ``WIRE_VERSION``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pp1wire.wire.messages import WIRE_VERSION

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "docs" / "protocol.md"
DRAFTS = {2, 3, 4}

# Ways a text names the protocol's version (case-insensitive); group 1 is the number.
NAMINGS = [
    r"pp1w-v(\d+)",  # HMAC labels
    r"\bwire[- ]v(\d+)",  # "wire v2", schema IDs "wire-v2"
    # "PP1 v2", "pp1 wire v2", "pp1 wire protocol, version 2"
    r"\bpp1(?: wire)?(?: protocol)?,? v(?:ersion )?(\d+)",
    r"\bprotocol,? (?:v|version )(\d+)\b",
    r"\bwire version:? (\d+)\b",
    r"(?<!\w)version: (\d+)\b",  # a rule quoted as "version: 2 ...", not wire_version: 3
    r"\bthis document: (\d+)\b",
    r"\bdraft (\d)\b(?!-)",  # the drafts are named in §11 only ("draft 2020-12" is JSON Schema)
]
PATTERN = re.compile("|".join(f"(?:{n})" for n in NAMINGS), re.IGNORECASE)
SUFFIXES = {".py", ".md", ".json", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".c", ".sh", ""}


def texts() -> list[Path]:
    """Every text file of the repository (tracked ones in a git checkout)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
        paths = [ROOT / p for p in listed.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
        paths = [
            p
            for p in ROOT.rglob("*")
            if p.is_file()
            and not skip & set(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)
        ]
    return [p for p in paths if p.suffix in SUFFIXES and p.is_file()]


def section_11(text: str) -> tuple[int, int]:
    start = text.index("## 11. Versioning")
    end = text.find("\n## ", start + 1)  # §11 (with §11.1) may end the document
    return start, len(text) if end < 0 else end


def namings(text: str) -> list[tuple[int, int, str]]:
    """(offset, number, the matched text) of every version naming in ``text``."""
    out = []
    for m in PATTERN.finditer(text):
        number = next(g for g in m.groups() if g is not None)
        out.append((m.start(), int(number), m.group(0)))
    return out


def test_the_patterns_catch_what_the_drafts_wrote():
    for old in (
        "# pp1 wire protocol, version 4 (normative)",
        "the pp1 wire protocol v4: how a Spark",
        '"pp1w-v4 worker proof"',
        "urn:pp1wire:wire-v4:hello",
        "pp1 wire v3 golden vectors",
        'R_VERSION = "version: 3 ... else UNSUPPORTED_VERSION (fatal)"',
        "| `wire_version` | this document: 3 |",
        "Wire v3: every frame after a keyed handshake",
        "PP1 v4",
    ):
        assert [n for _, n, _ in namings(old)] in ([3], [4]), old
    for fine in (
        "JSON Schemas (draft 2020-12)",
        '"wire_version": 3',  # a deliberately wrong HELLO field in a vector
        "dyadic24-standard-v1",
        "pp1-philox4x32-10-v1",
        "Item(other, v2, None, round_id)",
        "wire_version: 3",
    ):
        assert namings(fine) == [], fine


def test_no_text_names_another_protocol_version():
    wrong = []
    for path in texts():
        if path == Path(__file__).resolve():
            continue  # this file quotes the drafts' texts to test the patterns
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        allowed = section_11(text) if path == PROTOCOL else (0, 0)
        for offset, number, found in namings(text):
            if number == WIRE_VERSION:
                continue
            if allowed[0] <= offset < allowed[1] and number in DRAFTS:
                continue
            line = text.count("\n", 0, offset) + 1
            wrong.append(f"{path.relative_to(ROOT)}:{line}: {found!r}")
    assert wrong == [], "names another version than PP1 v2 (only §11 may name drafts)"


def test_section_11_lists_the_drafts_and_the_rule_for_later_versions():
    text = PROTOCOL.read_text()
    start, end = section_11(text)
    body = text[start:end]
    for draft in sorted(DRAFTS):
        assert f"| draft {draft} | `{draft}`, labels `pp1w-v{draft} …` |" in body
    assert f"**PP1 v{WIRE_VERSION}**, the first release" in body
    assert "any change to a byte layout" in body
    assert "makes a **new version**" in body


@pytest.mark.parametrize(
    "path", ["README.md", "docs/tp.md", "docs/runner.md", "docs/operators.md", "docs/benchmarks.md"]
)
def test_documents_exist_to_be_checked(path):
    assert (ROOT / path).is_file()
