"""Every (state, message type) pair of both roles does what its transition table says.

The tables (pp1wire/wire/transitions.py) name one action per pair; here each
core is put in each of its states and given one valid message of every type.
A FATAL rule must end the connection with exactly its code; IGNORE must leave
no trace; HANDLE must reach the role's handler (never a dispatch-level refusal).
"""

from __future__ import annotations

import msgspec
import pytest

from pp1wire.errors import ErrorCode
from pp1wire.testing.builders import SESSION, VOCAB
from pp1wire.testing.golden.common import hello, spark_config
from pp1wire.testing.golden.frames import valid_messages
from pp1wire.wire import framing, transitions
from pp1wire.wire.messages import Error, MsgType
from pp1wire.wire.spark_core import SparkProtocol
from pp1wire.wire.transitions import Act, State
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol

PSK = b"a-test-key-of-enough-bytes"
MESSAGES = {type(msg).__name__.upper(): (msg, payload) for _, msg, payload in valid_messages()}
DISPATCH_CODES = {
    ErrorCode.HANDSHAKE_REQUIRED,
    ErrorCode.UNEXPECTED_MESSAGE,
    ErrorCode.DUPLICATE_HELLO,
}


def message_of(kind: MsgType, role: str):
    if kind is MsgType.HELLO:  # the HELLO the receiving role expects from its peer
        return (hello(2) if role == "worker" else hello(1, SESSION)), b""
    name = {"RESET_DONE": "RESETDONE"}.get(kind.name, kind.name)
    return MESSAGES[name]


def worker_in(state: State) -> WorkerProtocol:
    core = WorkerProtocol(
        WorkerConfig(vocab_size=VOCAB, psk=PSK if state is State.AWAIT_AUTH else None),
        lambda prefix: [0.0] * VOCAB,
        session=SESSION,
        now=0.0,
    )
    if state is not State.AWAIT_HELLO:
        core.receive_data(framing.encode_frame(hello(2)), 0.0)
    core.data_to_send()
    assert core.state is state
    return core


def spark_in(state: State) -> SparkProtocol:
    core = SparkProtocol(spark_config(), 0.0)
    if state is not State.IDLE:
        core.start(0.0)
    if state is State.READY:
        ours = core._hello
        theirs = msgspec.structs.replace(hello(1, SESSION), nonce=b"\x00" * 16)
        assert ours is not None
        core.receive_data(framing.encode_frame(theirs), 0.0)
    core.data_to_send()
    assert core.state is state
    return core


def errors_in(chunks: list[bytes]) -> list[Error]:
    frames = framing.FrameDecoder(1 << 24).feed(b"".join(chunks))
    return [f.message for f in frames if isinstance(f.message, Error)]


CASES = [
    ("worker", s, k) for s in (State.AWAIT_HELLO, State.AWAIT_AUTH, State.READY) for k in MsgType
]
CASES += [("spark", s, k) for s in (State.IDLE, State.AWAIT_HELLO, State.READY) for k in MsgType]


@pytest.mark.parametrize(("role", "state", "kind"), CASES)
def test_every_pair_does_what_its_table_says(role, state, kind):
    table = transitions.WORKER if role == "worker" else transitions.SPARK
    rule = table[(state, kind)]
    core = worker_in(state) if role == "worker" else spark_in(state)
    msg, payload = message_of(kind, role)
    if state is not State.READY:
        payload = b""  # before the handshake a payload is a framing error (section 8)
    core.receive_data(framing.encode_frame(msg, payload), 0.0)
    errors = errors_in(core.data_to_send())
    dispatch_refusals = [e for e in errors if e.code in {int(c) for c in DISPATCH_CODES}]
    if rule.act is Act.FATAL:
        assert [(e.code, e.scope, e.answers) for e in errors] == [(int(rule.code), 2, int(kind))]
        assert core.closed
    elif rule.act is Act.IGNORE:
        assert errors == []
        assert not core.closed
        assert core.state is state
    else:
        assert dispatch_refusals == [], errors


def test_tables_cover_every_pair_and_only_those():
    for table, states in (
        (transitions.WORKER, {State.AWAIT_HELLO, State.AWAIT_AUTH, State.READY}),
        (transitions.SPARK, {State.IDLE, State.AWAIT_HELLO, State.READY}),
    ):
        assert set(table) == {(s, k) for s in states for k in MsgType}


def test_the_protocol_document_prints_these_tables():
    from pathlib import Path

    from pp1wire.wire import schema

    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    for name, table in (("worker", transitions.WORKER), ("spark", transitions.SPARK)):
        block = doc.split(f"<!-- transitions:{name} -->\n", 1)[1].split("\n<!-- /transitions -->")[
            0
        ]
        assert block == schema.transition_table(table), f"regenerate the {name} table in section 5"
        # The document drops only the word "fatal" before a code (§5 says so).
        assert block.replace("| `", "| fatal `") == transitions.markdown(table)
