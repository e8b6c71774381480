"""Generate (or check) the JSON Schemas of every wire message under ``schemas/``.

Usage: ``python -m pp1wire.schema [--check] [DIR]`` (default ``schemas``).

Each file describes one message header as the positional array it is on the
wire: element 0 is the tag (the frame type code), then the fields in order.
The schema is written for JSON; on the wire the same array is msgpack, where
``bytes`` fields are msgpack ``bin`` (base64 strings in the JSON form).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from pp1wire.messages import MESSAGE_TYPES, WIRE_VERSION, MsgType

DRAFT: str = "https://json-schema.org/draft/2020-12/schema"


def schema_for(kind: MsgType) -> dict[str, Any]:
    """The JSON Schema document of one message type."""
    struct = MESSAGE_TYPES[kind]
    raw = msgspec.json.schema(struct)
    defs = raw.get("$defs", {})
    body = defs.pop(struct.__name__)
    doc: dict[str, Any] = {
        "$schema": DRAFT,
        "$id": f"urn:pp1wire:wire-v{WIRE_VERSION}:{kind.name.lower()}",
        "title": f"pp1 wire v{WIRE_VERSION} {kind.name} header (frame type {int(kind)})",
        "description": (struct.__doc__ or "").strip().splitlines()[0],
    }
    body.pop("title", None)
    doc.update(body)
    for name, item in zip(["tag", *struct.__struct_fields__], doc["prefixItems"], strict=True):
        item["title"] = name
    if defs:
        doc["$defs"] = defs
    return doc


def render_all() -> dict[str, str]:
    """File name → file text for every message schema."""
    out = {}
    for kind in MsgType:
        text = json.dumps(schema_for(kind), indent=2, sort_keys=True) + "\n"
        out[f"{kind.name.lower()}.schema.json"] = text
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the schemas, or with ``--check`` report (exit 1) any that differ."""
    parser = argparse.ArgumentParser(prog="python -m pp1wire.schema", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("dir", nargs="?", default="schemas")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    files = render_all()
    if args.check:
        stale = [
            name
            for name, text in files.items()
            if not (root / name).is_file() or (root / name).read_text() != text
        ]
        extra = sorted(p.name for p in root.glob("*.schema.json") if p.name not in files)
        for name in stale + extra:
            print(f"out of date: {root / name}", file=sys.stderr)
        return 1 if stale or extra else 0
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
