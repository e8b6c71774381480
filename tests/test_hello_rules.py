"""The HELLO rules of §4.1: one ordered list that the document prints and both cores follow."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pp1wire.errors import ErrorCode
from pp1wire.testing.builders import SESSION, VOCAB
from pp1wire.testing.golden.common import hello, spark_config
from pp1wire.testing.golden.hellos import BREAK
from pp1wire.wire import framing, handshake, integrity, messages
from pp1wire.wire.handshake import HELLO_RULES, first_failure
from pp1wire.wire.messages import Error, Hello
from pp1wire.wire.spark_core import SparkProtocol
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
CHECKED = [r for r in HELLO_RULES if r.checked]

# What breaks each checked row of a worker's HELLO as the Spark side receives it: the
# golden vectors' breaks of a Spark HELLO where the same change breaks that row from
# this side too; the role and the limits a worker echoes break the other way.
SPARK_BREAK: dict[str, dict[str, Any]] = BREAK | {
    "role": {"role": 2},
    "max_slots": {"max_slots": 3},
    "max_frame": {"max_frame": (1 << 20) - 1},
    "max_prefix": {"max_prefix": 1023},
    "shards": {"shards": 2, "shard": 1, "shard_start": 4, "shard_end": VOCAB, "layout": 5},
    # The Spark side sent "": a worker echoing a stop-rule set upgraded it.
    "stop_rules": {"stop_rules": "pp1-stop-rules-v1"},
    "group": {"group": bytes(16)},  # a group nonce on an unsharded link
}


def spark_refuses(fields: dict[str, Any]) -> ErrorCode | None:
    """The code a Spark side (pinning the drafter) answers this worker HELLO with, if any."""
    spark = SparkProtocol(spark_config("pp1-toy-drafter"), now=0.0)
    spark.start(0.0)
    ours = spark._hello
    assert ours is not None
    spark.data_to_send()
    honest = {"role": 1, "session": SESSION, "draft_identity": "pp1-toy-drafter"}
    worker_hello = msgspec.structs.replace(ours, **(honest | fields))
    spark.receive_data(framing.encode_frame(worker_hello), 0.0)
    sent = framing.FrameDecoder(1 << 20).feed(b"".join(spark.data_to_send()))
    errors = [f.message for f in sent if isinstance(f.message, Error)]
    return ErrorCode(errors[0].code) if errors else None


def test_the_document_prints_the_rules_in_check_order():
    block = DOC.read_text().split("<!-- hello-rules -->\n", 1)[1]
    block = block.split("\n<!-- /hello-rules -->", 1)[0]
    assert block == handshake.rules_markdown(), "run: python -m pp1wire.wire.schema"
    numbers = [line.split("|")[1].strip() for line in block.splitlines()[2:]]
    assert [n for n in numbers if n != "—"] == [str(i) for i in range(1, len(CHECKED) + 1)]


def test_every_checked_row_names_its_code_and_every_field_exists():
    fields = set(Hello.__struct_fields__)
    named = [f for r in HELLO_RULES for f in r.fields]
    assert sorted(named) == sorted(fields), "every HELLO field has exactly one row"
    for rule in CHECKED:
        assert rule.code is not None
        assert rule.code.name in handshake.rules_markdown()


@pytest.mark.parametrize("rule", CHECKED, ids=lambda r: r.fields[0])
def test_spark_side_refuses_each_row_alone_with_its_code(rule):
    assert spark_refuses({}) is None
    assert spark_refuses(SPARK_BREAK[rule.fields[0]]) is rule.code


@pytest.mark.parametrize(
    ("first", "second"),
    list(itertools.pairwise(CHECKED)),
    ids=lambda r: r.fields[0],
)
def test_spark_side_checks_in_the_table_order(first, second):
    both = {**SPARK_BREAK[first.fields[0]], **SPARK_BREAK[second.fields[0]]}
    assert spark_refuses(both) is first.code


def test_spark_side_checks_the_draft_identity_before_integrity():
    # One of the two orders the drafts' implementation had wrong (the other: limits
    # before the shard layout, an adjacent pair above).
    both = {**SPARK_BREAK["draft_identity"], **SPARK_BREAK["integrity"]}
    assert spark_refuses(both) is ErrorCode.IDENTITY_MISMATCH


def test_an_own_rule_with_a_shared_code_is_refused():
    peer = hello(2)
    cfg = WorkerConfig(vocab_size=VOCAB)
    with pytest.raises(ValueError, match="VOCAB_HASH_MISMATCH"):
        first_failure(peer, messages.Role.SPARK, cfg, [(False, ErrorCode.VOCAB_HASH_MISMATCH)])


def test_a_worker_hello_carries_wire_version_2():
    # The design's number, literally: PP1 v2 (docs/protocol.md section 11).
    worker = WorkerProtocol(
        WorkerConfig(vocab_size=VOCAB, max_support=4, max_frame=1 << 20, max_prefix=1024),
        lambda _p: [0.0] * VOCAB,
        session=SESSION,
        now=0.0,
    )
    worker.receive_data(framing.encode_frame(hello(2)), 0.0)
    out = b"".join(worker.data_to_send())
    assert out[:3] == b"PW\x02"
    (frame,) = framing.FrameDecoder(1 << 20).feed(out)
    assert isinstance(frame.message, Hello)
    assert frame.message.wire_version == 2 == messages.WIRE_VERSION
    assert handshake.AUTH_WORKER_LABEL == b"pp1w-v2 worker proof"
    assert integrity.SPARK_TO_WORKER_LABEL == b"pp1w-v2 spark-to-worker key"


def test_the_schema_command_regenerates_and_checks_the_rules_table(tmp_path):
    from pp1wire.wire import schema

    doc = tmp_path / "protocol.md"
    doc.write_text("<!-- hello-rules -->\n| stale |\n<!-- /hello-rules -->\n")
    schemas = tmp_path / "s"
    schema.main([str(schemas)])
    assert schema.main(["--check", str(schemas), "--doc", str(doc)]) == 1
    schema.main([str(schemas), "--doc", str(doc)])
    assert handshake.rules_markdown() in doc.read_text()
    assert schema.main(["--check", str(schemas), "--doc", str(doc)]) == 0
