"""Golden byte vectors of the PP1 wire protocol: ``python -m pp1wire.testing.golden [--check]
[FILE]`` writes ``golden/vectors.json`` (with ``--check``, nothing: exit 1 if the file differs).
``docs/protocol.md`` §10 is the normative description of the four kinds of vector."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pp1wire.testing.golden.common import Vector
from pp1wire.testing.golden.frames import frame_vectors
from pp1wire.testing.golden.hellos import hello_vectors
from pp1wire.testing.golden.integrity import integrity_vectors, run_integrity_vector
from pp1wire.testing.golden.replies import reply_vectors
from pp1wire.wire import messages

__all__ = [
    "Vector",
    "all_vectors",
    "frame_vectors",
    "hello_vectors",
    "integrity_vectors",
    "main",
    "render",
    "reply_vectors",
    "run_integrity_vector",
]


def all_vectors() -> list[Vector]:
    """Every golden vector, in file order."""
    return frame_vectors() + reply_vectors() + integrity_vectors() + hello_vectors()


def render() -> str:
    """The vectors file's exact text."""
    version = messages.WIRE_VERSION
    doc = {
        "description": f"PP1 wire v{version} golden vectors; see docs/protocol.md §10",
        "wire_version": messages.WIRE_VERSION,
        "vectors": all_vectors(),
    }
    return json.dumps(doc, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the vectors file, or with ``--check`` exit 1 if it differs."""
    parser = argparse.ArgumentParser(prog="python -m pp1wire.testing.golden", description=__doc__)
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if FILE differs from what the code generates",
    )
    parser.add_argument("file", nargs="?", default="golden/vectors.json")
    args = parser.parse_args(argv)
    path = Path(args.file)
    text = render()
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"out of date: {path}", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return 0
