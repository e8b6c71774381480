"""``python -m pp1wire.wire.schema [--check] [--doc FILE] [DIR]``: write (or check) the JSON
Schema of every message header under ``schemas/`` (a positional array: tag, then the fields),
and the tables ``docs/protocol.md`` prints from the code."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from pp1wire.wire import handshake, transitions
from pp1wire.wire.messages import (
    MESSAGE_TYPES,
    TOKEN_MAX,
    TOKEN_WIDTH,
    WIRE_VERSION,
    FixedToken,
    MsgType,
)

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


#: Full-width unsigned ranges, printed by their width in the field lists.
_WIDTHS: dict[int, str] = {2**n - 1: f"uint{n}" for n in (8, 16, 32, 64)}


def _describe(t: msgspec.inspect.Type) -> str:
    """The wire type and bound of one field, as the protocol document prints it.

    The legend is §4 of the document: ``uintN`` is 0..2^N-1, ``uint a..b`` any other
    range, ``str ≤ n`` counts code points, ``bin a-b`` counts bytes.
    """
    i = msgspec.inspect
    if isinstance(t, i.Metadata):
        return _describe(t.type)
    if isinstance(t, i.CustomType) and t.cls is FixedToken:
        return f"bin {TOKEN_WIDTH}: uint32 LE ≤ {TOKEN_MAX}"
    if isinstance(t, i.IntType):
        lo = 0 if t.ge is None else t.ge
        hi = 2**64 - 1 if t.le is None else t.le
        return _WIDTHS[hi] if lo == 0 and hi in _WIDTHS else f"uint {lo}..{hi}"
    if isinstance(t, i.FloatType):
        return "float64, finite, ≥ 0"
    if isinstance(t, i.BoolType):
        return "bool"
    if isinstance(t, i.StrType):
        return f"str ≤ {t.max_length}"
    if isinstance(t, i.BytesType):
        least, most = t.min_length or 0, t.max_length
        return f"bin {most}" if least == most else f"bin {least}–{most}"  # noqa: RUF001 - a range in prose
    if isinstance(t, i.UnionType):
        parts = [_describe(x) for x in t.types if not isinstance(x, i.NoneType)]
        return f"{parts[0]} or nil"
    raise TypeError(t)


def _shown(default: Any) -> str:
    """A field's default as the document writes it (msgpack terms)."""
    if default is None:
        return "nil"
    if isinstance(default, bool):
        return "false" if default is False else "true"
    if default == b"":
        return "empty"
    if default == "":
        return '""'
    return repr(default)


def field_table(kind: MsgType) -> str:
    """A message's header array, element by element, as the document prints it.

    One line of ``n `name` type`` for each field n (element 0 is the tag, the type
    code), with ``= d`` after a trailing field that may be omitted (read as d).
    """
    info = msgspec.inspect.type_info(MESSAGE_TYPES[kind])
    assert isinstance(info, msgspec.inspect.StructType)
    items = []
    for n, f in enumerate(info.fields, start=1):
        omitted = "" if f.required else f" = {_shown(f.default)}"
        items.append(f"{n} `{f.name}` {_describe(f.type)}{omitted}")
    return " · ".join(items)


def _replace_block(text: str, start: str, end: str, body: str) -> str:
    """``text`` with what stands between ``start`` and ``end`` replaced by ``body``."""
    i = text.find(start)
    if i < 0:
        return text
    j = text.index(end, i)
    return text[: i + len(start)] + "\n" + body + "\n" + text[j:]


def generated_blocks() -> dict[str, tuple[str, str]]:
    """Start marker → (end marker, body) of every table the document prints from code."""
    blocks = {
        f"<!-- fields:{kind.name} -->": ("<!-- /fields -->", field_table(kind)) for kind in MsgType
    }
    blocks["<!-- hello-rules -->"] = ("<!-- /hello-rules -->", handshake.rules_markdown())
    for name, table in (("worker", transitions.WORKER), ("spark", transitions.SPARK)):
        blocks[f"<!-- transitions:{name} -->"] = ("<!-- /transitions -->", transition_table(table))
    return blocks


def transition_table(table: dict[tuple[transitions.State, MsgType], transitions.Rule]) -> str:
    """§5's table of one side: a cell that names a code means fatal with that code."""
    return transitions.markdown(table).replace("fatal `", "`")


def update_doc(text: str) -> str:
    """Replace every generated block (field lists, HELLO rules, transitions) with its text."""
    out = text
    for start, (end, body) in generated_blocks().items():
        out = _replace_block(out, start, end, body)
    return out


def render_all() -> dict[str, str]:
    """File name → file text for every message schema."""
    out = {}
    for kind in MsgType:
        text = json.dumps(schema_for(kind), indent=2, sort_keys=True) + "\n"
        out[f"{kind.name.lower()}.schema.json"] = text
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the schemas, or with ``--check`` report (exit 1) any that differ."""
    parser = argparse.ArgumentParser(prog="python -m pp1wire.wire.schema", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("dir", nargs="?", default="schemas")
    parser.add_argument("--doc", default="docs/protocol.md", help="document to refresh")
    args = parser.parse_args(argv)
    doc = Path(args.doc)
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
        doc_stale = doc.is_file() and update_doc(doc.read_text()) != doc.read_text()
        if doc_stale:
            print(f"out of date: generated tables in {doc}", file=sys.stderr)
        return 1 if stale or extra or doc_stale else 0
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    if doc.is_file():
        doc.write_text(update_doc(doc.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
