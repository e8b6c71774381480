"""Golden vectors: the committed file is current, and both directions hold."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from pp1wire.testing import golden
from pp1wire.wire import framing

from . import golden_runners as runners

ROOT = Path(__file__).resolve().parent.parent
FILE = ROOT / "golden" / "vectors.json"
VECTORS = json.loads(FILE.read_text())["vectors"]


def test_committed_vectors_are_current():
    assert FILE.read_text() == golden.render(), "run: python -m pp1wire.testing.golden"


def test_vectors_cover_every_message_type_and_rejection_class():
    names = {v["name"] for v in VECTORS}
    types = {
        m["type"] for v in VECTORS if v["kind"] == "frame" for m in v["expect"].get("messages", [])
    }
    from pp1wire.wire.messages import MsgType

    assert types == {t.name for t in MsgType}
    discarded = {v["expect"].get("discarded") for v in VECTORS if v["kind"] == "reply"}
    for code in [
        "NON_FINITE",
        "NEGATIVE",
        "NON_DYADIC",
        "MASS_MISMATCH",
        "ZERO_Q_AT_PROPOSED",
        "SPARSE_DUPLICATE_ID",
        "SPARSE_UNSORTED",
        "SPARSE_ID_OUT_OF_RANGE",
        "SPARSE_ZERO_ENTRY",
        "SUPPORT_TOO_LARGE",
        "MISSING_Q",
        "DENSE_PADDING_NONZERO",
        "ROW_LENGTH",
        "ROW_CHECKSUM_MISMATCH",
        "REPLY_CHECKSUM_MISMATCH",
        "REPLY_SIZE_MISMATCH",
        "ROW_OUT_OF_ORDER",
        "COMPLETION_EARLY",
        "FUTURE_GENERATION",
        "WRONG_POSITION",
    ]:
        assert code in discarded, code
    assert {"valid_dense", "valid_sparse", "stale_generation_dropped", "completion_twice"} <= names


@pytest.mark.parametrize(
    "vector", [v for v in VECTORS if v["kind"] == "frame"], ids=lambda v: v["name"]
)
def test_frame_vector_decodes(vector):
    assert runners.decode_frame_vector(vector) == vector["expect"]


@pytest.mark.parametrize(
    "vector",
    [v for v in VECTORS if v["kind"] == "frame" and "error" not in v["expect"]],
    ids=lambda v: v["name"],
)
def test_frame_vector_encodes(vector):
    data = b""
    for obj in vector["expect"]["messages"]:
        msg, payload = runners.message_from_json(obj)
        data += framing.encode_frame(msg, payload)
    if vector["expect"].get("incomplete"):
        assert bytes.fromhex(vector["hex"]).startswith(data)
    else:
        assert data.hex() == vector["hex"]


@pytest.mark.parametrize(
    "vector", [v for v in VECTORS if v["kind"] == "reply"], ids=lambda v: v["name"]
)
def test_reply_vector(vector):
    assert runners.run_reply_vector(vector) == vector["expect"]


@pytest.mark.parametrize(
    "vector", [v for v in VECTORS if v["kind"] == "integrity"], ids=lambda v: v["name"]
)
def test_integrity_vector_holds(vector):
    assert golden.run_integrity_vector(vector) == vector["expect"]


@pytest.mark.parametrize(
    "vector", [v for v in VECTORS if v["kind"] == "hello"], ids=lambda v: v["name"]
)
def test_hello_vector_holds(vector):
    assert runners.run_hello_vector(vector) == vector["expect"]


def test_hello_vectors_pair_every_adjacent_checked_rule():
    from pp1wire.wire.handshake import HELLO_RULES

    checked = [r for r in HELLO_RULES if r.checked]
    got = {v["name"]: v["expect"] for v in VECTORS if v["kind"] == "hello"}
    for first, second in itertools.pairwise(checked):
        name = f"hello_order_{first.fields[0]}_{second.fields[0]}"
        assert got[name]["error"] == first.code.name, name
    # The two orders the drafts' implementation got wrong.
    assert got["hello_order_draft_identity_integrity"]["error"] == "IDENTITY_MISMATCH"
    assert got["hello_order_max_prefix_shards"]["error"] == "LIMIT_EXCEEDED"
    assert got["hello_keyed_role_after_auth"] == {"answer": "CHALLENGE"}


def test_each_broken_field_alone_fails_its_own_rule():
    # A pair vector proves the order only if each of its two fields fails alone.
    import msgspec

    from pp1wire.testing.golden.common import hello
    from pp1wire.testing.golden.hellos import BREAK, WORKER
    from pp1wire.wire.handshake import HELLO_RULES

    for rule in (r for r in HELLO_RULES if r.checked):
        frame = framing.encode_frame(msgspec.structs.replace(hello(2), **BREAK[rule.fields[0]]))
        vector = {"hex": frame.hex(), "context": WORKER}
        assert runners.run_hello_vector(vector)["error"] == rule.code.name, rule.fields


def test_new_rules_have_vectors():
    names = {v["name"] for v in VECTORS}
    assert {
        "completion_range_on_unsharded_link",
        "shard_completion_range_missing",
        "shard_completion_range_mismatch",
        "error_completion_start_without_end",
        "error_completion_start_above_end",
        "completion_duplicate_after_commit",
        "future_generation_twice",
        "future_generation_nothing_pending",
        "future_generation_slot_not_open",
        "hello_max_frame_above_limit",
    } <= names


def test_check_flag_detects_a_stale_file(tmp_path):
    current = tmp_path / "vectors.json"
    assert golden.main([str(current)]) == 0
    assert golden.main(["--check", str(current)]) == 0
    current.write_text(current.read_text().replace('"hello_accepted"', '"hello_acepted"'))
    assert golden.main(["--check", str(current)]) == 1
    assert golden.main(["--check", str(FILE)]) == 0


def test_integrity_vectors_cover_both_directions_and_a_changed_frame():
    got = {v["name"]: v["expect"] for v in VECTORS if v["kind"] == "integrity"}
    assert got["integrity_worker_to_spark"]["frames"][0]["type"] == "HELLO"
    assert len(got["integrity_spark_to_worker"]["frames"]) == 2
    assert got["integrity_payload_changed"]["error"] == "INTEGRITY_FAILED"
    assert got["integrity_payload_changed"]["at"] == 0


def test_section_10_names_every_key_the_vectors_use():
    # A stranger reads the vectors from protocol §10 alone: each context and
    # expect key of each kind is named there (`key`, "key" or `context.key`).
    doc = (FILE.parent.parent / "docs" / "protocol.md").read_text()
    section = doc.split("## 10. Golden vectors and schemas", 1)[1].split("\n## 11.", 1)[0]
    named = {m.lower() for m in re.findall(r'[`"](?:context\.|expect\.)?([A-Za-z_]+)[`"]', section)}
    used = {
        (v["kind"], part, key)
        for v in VECTORS
        for part in ("context", "expect")
        for key in (v.get(part) or {})
    }
    missing = sorted(f"{kind} {part}.{key}" for kind, part, key in used if key.lower() not in named)
    assert missing == []
