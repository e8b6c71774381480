"""A refused call changes nothing: every public method of both cores, property-tested.

The Spark core's local API raises ProtocolError for a call it refuses; the
worker core refuses messages with an ERROR. Either way the state a later call
can observe (slots, prefixes, fencing, rounds, drafts, queued bytes other than
the ERROR itself) must be exactly what it was.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.errors import LocalStateError, ProtocolError
from pp1wire.testing.builders import open_message, token_bytes
from pp1wire.wire import framing
from pp1wire.wire.messages import Commit, Reset, Step
from pp1wire.wire.spark_core import SparkProtocol
from pp1wire.wire.worker_core import WorkerProtocol

from .pairs import VOCAB, make_pair, step


def spark_state(core: SparkProtocol) -> Any:
    slots = {
        i: (
            s.context,
            s.eos,
            tuple(s.prefix),
            s.digest,
            s.fence.generation,
            s.fence.last_round,
            s.desynced,
            None if s.flight is None else (s.flight.step, len(s.flight.rows)),
            sorted(s.drafts.items()),
        )
        for i, s in core.slots.items()
    }
    return (
        core.state,
        core.session,
        core.closed,
        slots,
        list(core._out),
        dict(core._closing),
        dict(core._slot_generations),
    )


def worker_state(core: WorkerProtocol) -> Any:
    slots = {
        i: (
            tuple(s.prefix),
            s.digest,
            s.fence.generation,
            s.fence.last_step_round,
            s.fence.last_step,
            s.fence.committed_round,
            s.fence.last_commit,
            s.drafts,
            s.reply,
        )
        for i, s in core.slots.items()
    }
    return (core.state, core.closed, slots, dict(core._slot_generations))


# Mostly the open slot and its live round, sometimes anything.
ints = st.one_of(st.integers(0, 1), st.integers(-3, 12))
spark_calls = st.one_of(
    st.tuples(st.just("open_slot"), ints, st.lists(st.integers(-2, VOCAB + 1), max_size=4)),
    st.tuples(st.just("step"), ints, st.integers(-1, 7), st.integers(-1, VOCAB + 2), ints),
    st.tuples(
        st.just("commit"),
        ints,
        ints,
        st.lists(st.integers(0, VOCAB - 1), max_size=4),
        st.integers(-1, 5),
    ),
    st.tuples(st.just("reset"), ints),
    st.tuples(st.just("close_slot"), ints),
    st.tuples(st.just("next_round"), ints),
)


def call_spark(core: SparkProtocol, call: tuple[Any, ...]) -> None:
    name, slot, *rest = call
    if name == "open_slot":
        core.open_slot(slot, seed=1, prefix=rest[0])
    elif name == "step":
        core.step(slot, round_id=rest[2], depth=rest[0], temperature=1.0, support=rest[1], now=0.0)
    elif name == "commit":
        core.commit(slot, round_id=rest[0], tokens=rest[1], accepted=rest[2])
    else:
        getattr(core, name)(slot)


def opened_pair():
    """A connected pair with slot 0 open at prefix (1, 2, 3)."""
    pair = make_pair()
    pair.spark.open_slot(0, seed=5, prefix=[1, 2, 3])
    pair.pump()
    return pair


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(spark_calls, min_size=1, max_size=12))
def test_a_refused_spark_call_changes_nothing(calls):
    pair = opened_pair()
    step(pair.spark, 0, depth=3, temperature=1.0, support=0, now=0.0)
    pair.pump()  # slot 0 has a completed round 0 with drafts waiting for COMMIT
    for call in calls:
        before = spark_state(pair.spark)
        try:
            call_spark(pair.spark, call)
        except (ProtocolError, LocalStateError):
            assert spark_state(pair.spark) == before, call
        pair.pump()


def test_a_refused_commit_keeps_the_rounds_drafts():
    # The bug this property found: COMMIT dropped the round's drafts before checking.
    pair = make_pair()
    pair.spark.open_slot(0, seed=5, prefix=[1, 2, 3])
    pair.pump()
    round_id = step(pair.spark, 0, depth=3, temperature=1.0, support=0, now=0.0)
    pair.pump()
    drafts = pair.spark.slots[0].drafts[round_id]
    wrong = [(drafts[0] + 1) % VOCAB, 0]
    with pytest.raises(ProtocolError):
        pair.spark.commit(0, round_id=round_id, tokens=wrong, accepted=1)
    assert pair.spark.slots[0].drafts[round_id] == drafts
    pair.spark.commit(0, round_id=round_id, tokens=[drafts[0], 0], accepted=1)  # still possible


def _frame(kind: str, slot: int, generation: int, round_id: int, value: int) -> bytes:
    if kind == "open":
        tokens = [value % (VOCAB + 2) - 1, 2]
        return framing.encode_frame(
            open_message(7, slot, tokens, generation=generation), token_bytes(tokens)
        )
    if kind == "step":
        return framing.encode_frame(
            Step(
                session=7 if value % 5 else 8,
                slot=slot,
                generation=generation,
                round=round_id,
                position=3 + value % 3,
                digest=0 if value % 7 == 0 else 1,
                depth=1 + value % 7,
                temperature=1.0,
                support=value % 80,
                context=0,
            )
        )
    if kind == "commit":
        return framing.encode_frame(
            Commit(
                session=7,
                slot=slot,
                generation=generation,
                round=round_id,
                accepted=value % 4,
                extra=None if value % 2 else value % VOCAB,
                position=3 + value % 4,
                digest=value,
            )
        )
    return framing.encode_frame(Reset(session=7, slot=slot, generation=generation))


worker_frames = st.tuples(
    st.sampled_from(["open", "step", "commit", "reset"]),
    st.integers(0, 5),
    st.integers(0, 3),
    st.integers(0, 4),
    st.integers(0, 1000),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(worker_frames, min_size=1, max_size=12))
def test_a_refused_message_changes_nothing_on_the_worker(frames):
    pair = opened_pair()
    worker = pair.worker
    for spec in frames:
        before = worker_state(worker)
        events = worker.receive_data(_frame(*spec), 0.0)
        worker.data_to_send()
        refused = [e for e in events if type(e).__name__ == "Refused"]
        if refused and not worker.closed:
            assert worker_state(worker) == before, (spec, refused)
