"""Golden vectors: the committed file is current, and both directions hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pp1wire.testing import golden
from pp1wire.wire import framing

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
    assert golden.decode_frame_vector(vector) == vector["expect"]


@pytest.mark.parametrize(
    "vector",
    [v for v in VECTORS if v["kind"] == "frame" and "error" not in v["expect"]],
    ids=lambda v: v["name"],
)
def test_frame_vector_encodes(vector):
    data = b""
    for obj in vector["expect"]["messages"]:
        msg, payload = golden.message_from_json(obj)
        data += framing.encode_frame(msg, payload)
    if vector["expect"].get("incomplete"):
        assert bytes.fromhex(vector["hex"]).startswith(data)
    else:
        assert data.hex() == vector["hex"]


@pytest.mark.parametrize(
    "vector", [v for v in VECTORS if v["kind"] == "reply"], ids=lambda v: v["name"]
)
def test_reply_vector(vector):
    assert golden.run_reply_vector(vector) == vector["expect"]


@pytest.mark.parametrize(
    "vector", [v for v in VECTORS if v["kind"] == "integrity"], ids=lambda v: v["name"]
)
def test_integrity_vector_holds(vector):
    assert golden.run_integrity_vector(vector) == vector["expect"]


def test_integrity_vectors_cover_both_directions_and_a_changed_frame():
    got = {v["name"]: v["expect"] for v in VECTORS if v["kind"] == "integrity"}
    assert got["integrity_worker_to_spark"]["frames"][0]["type"] == "HELLO"
    assert len(got["integrity_spark_to_worker"]["frames"]) == 2
    assert got["integrity_payload_changed"]["error"] == "INTEGRITY_FAILED"
    assert got["integrity_payload_changed"]["at"] == 0
