"""The committed JSON Schemas match the Structs they are generated from."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from pp1wire.wire import schema
from pp1wire.wire.messages import MESSAGE_TYPES, WIRE_VERSION, MsgType

ROOT = Path(__file__).resolve().parent.parent / "schemas"


def test_committed_schemas_are_current():
    doc = str(ROOT.parent / "docs" / "protocol.md")
    regenerate = "run: python -m pp1wire.wire.schema"
    assert schema.main(["--check", str(ROOT), "--doc", doc]) == 0, regenerate


def test_check_detects_a_stale_file(tmp_path):
    schema.main([str(tmp_path)])
    assert schema.main(["--check", str(tmp_path)]) == 0
    victim = tmp_path / "step.schema.json"
    victim.write_text(victim.read_text().replace("65535", "65536"))
    assert schema.main(["--check", str(tmp_path)]) == 1


def test_every_message_has_a_schema_with_ids_and_positions():
    for kind in MsgType:
        doc = json.loads((ROOT / f"{kind.name.lower()}.schema.json").read_text())
        assert doc["$schema"].endswith("2020-12/schema")
        assert doc["$id"] == f"urn:pp1wire:wire-v{WIRE_VERSION}:{kind.name.lower()}"
        items = doc["prefixItems"]
        assert items[0] == {"enum": [int(kind)], "title": "tag"}
        assert [i["title"] for i in items[1:]] == list(MESSAGE_TYPES[kind].__struct_fields__)


def test_json_form_of_a_message_matches_its_schema_shape():
    # The JSON encoding of a Struct is the same positional array the schema describes.
    msg = MESSAGE_TYPES[MsgType.PING](nonce=5)
    assert msgspec.json.decode(msgspec.json.encode(msg)) == [int(MsgType.PING), 5]


def test_protocol_document_names_every_error_code_and_message():
    from pp1wire.errors import ErrorCode

    text = (ROOT.parent / "docs" / "protocol.md").read_text()
    for code in ErrorCode:
        assert f"| {int(code)} | `{code.name}` |" in text, code.name
    for kind in MsgType:
        assert f"<!-- fields:{kind.name} -->" in text, kind.name


def test_stale_field_table_is_detected(tmp_path):
    doc = tmp_path / "protocol.md"
    doc.write_text("<!-- fields:PING -->\n| stale |\n<!-- /fields -->\n")
    schema.main([str(tmp_path / "s"), "--doc", str(doc)])
    assert "nonce" in doc.read_text()
    assert schema.main(["--check", str(tmp_path / "s"), "--doc", str(doc)]) == 0
    doc.write_text(doc.read_text().replace("nonce", "nonse"))
    assert schema.main(["--check", str(tmp_path / "s"), "--doc", str(doc)]) == 1
