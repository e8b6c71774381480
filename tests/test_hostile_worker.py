"""The Spark side against a hostile worker: every malformed reply class over real sockets.

For each class the client must refuse the proposal before anything is consumed,
count it under the right code, let the round be decoded target-only (the worker
accepts that commit, so nothing was half-applied), and work normally next round.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pp1wire.aio.client import AsyncClient, ProposalUnavailableError
from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode
from pp1wire.q.verify import RequestVerifier
from pp1wire.testing.builders import (
    completion,
    dense_payload,
    reply_row,
    whole_reply,
)
from pp1wire.testing.hostile import FaultyWorker
from pp1wire.wire.spark_core import SparkConfig

from .waiting import eventually

VOCAB = 8
H, Q = 0.5, 0.25
M = 1 << 24
GOOD = [M // 2, 0, M // 4, 0, 0, 0, 0, M // 4]


def dense(values):
    return np.asarray(values, dtype="<f4").tobytes()


def sparse(ids, values):
    return np.asarray(ids, dtype="<i4").tobytes() + np.asarray(values, dtype="<f4").tobytes()


def ok_dense(step, i, token=0):
    return reply_row(step, i, token, dense_payload(GOOD))


def ok_sparse(step, i):
    return reply_row(step, i, 7, sparse([7], [1.0]))


def rows_then_done(step, *frames, **over):
    return whole_reply(step, *frames, **over)


# name, support, builder(step) -> bytes, expected code of the discarded proposal
CLASSES = [
    (
        "non_finite",
        0,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, dense([H, 0, Q, float("nan"), 0, 0, 0, Q])),
            ok_dense(st, 1),
            ok_dense(st, 2),
        ),
        ErrorCode.NON_FINITE,
    ),
    (
        "negative",
        0,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, dense([H, 0, Q, -0.0, 0, 0, 0, Q])),
            ok_dense(st, 1),
            ok_dense(st, 2),
        ),
        ErrorCode.NEGATIVE,
    ),
    (
        "non_dyadic",
        0,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, dense([H, 0, Q, 2.0**-30, 0, 0, 0, Q])),
            ok_dense(st, 1),
            ok_dense(st, 2),
        ),
        ErrorCode.NON_DYADIC,
    ),
    (
        "wrong_total_mass",
        0,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, dense([H, 0, Q, 0, 0, 0, 0, 0])),
            ok_dense(st, 1),
            ok_dense(st, 2),
        ),
        ErrorCode.MASS_MISMATCH,
    ),
    (
        "zero_q_at_proposed",
        0,
        lambda st: rows_then_done(
            st, reply_row(st, 0, 1, dense_payload(GOOD)), ok_dense(st, 1), ok_dense(st, 2)
        ),
        ErrorCode.ZERO_Q_AT_PROPOSED,
    ),
    (
        "unexpected_size",
        0,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, dense_payload(GOOD, VOCAB - 1)),
            ok_dense(st, 1),
            ok_dense(st, 2),
        ),
        ErrorCode.ROW_LENGTH,
    ),
    (
        "missing_q",
        0,
        lambda st: rows_then_done(
            st, reply_row(st, 0, 0, b"", entries=0), ok_dense(st, 1), ok_dense(st, 2)
        ),
        ErrorCode.MISSING_Q,
    ),
    (
        "row_checksum",
        0,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, dense_payload(GOOD), checksum=5),
            ok_dense(st, 1),
            ok_dense(st, 2),
        ),
        ErrorCode.ROW_CHECKSUM_MISMATCH,
    ),
    (
        "rows_out_of_order",
        0,
        lambda st: rows_then_done(st, ok_dense(st, 1), ok_dense(st, 0), ok_dense(st, 2)),
        ErrorCode.ROW_OUT_OF_ORDER,
    ),
    (
        "completion_early",
        0,
        lambda st: ok_dense(st, 0) + completion(st, ok_dense(st, 0), 1),
        ErrorCode.COMPLETION_EARLY,
    ),
    (
        "reply_checksum",
        0,
        lambda st: rows_then_done(
            st, ok_dense(st, 0), ok_dense(st, 1), ok_dense(st, 2), reply_checksum=1
        ),
        ErrorCode.REPLY_CHECKSUM_MISMATCH,
    ),
    (
        "reply_size",
        0,
        lambda st: rows_then_done(
            st, ok_dense(st, 0), ok_dense(st, 1), ok_dense(st, 2), reply_bytes=7
        ),
        ErrorCode.REPLY_SIZE_MISMATCH,
    ),
    (
        "wrong_position",
        0,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, dense_payload(GOOD), position=99),
            ok_dense(st, 1),
            ok_dense(st, 2),
        ),
        ErrorCode.WRONG_POSITION,
    ),
    (
        "future_generation",
        0,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, dense_payload(GOOD), generation=st.generation + 1),
            ok_dense(st, 1),
            ok_dense(st, 2),
        ),
        ErrorCode.FUTURE_GENERATION,
    ),
    (
        "sparse_duplicate_ids",
        3,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, sparse([0, 0, 7], [Q, Q, H])),
            ok_sparse(st, 1),
            ok_sparse(st, 2),
        ),
        ErrorCode.SPARSE_DUPLICATE_ID,
    ),
    (
        "sparse_duplicate_zeros",
        3,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, sparse([0, 5, 5], [1.0, 0.0, 0.0])),
            ok_sparse(st, 1),
            ok_sparse(st, 2),
        ),
        ErrorCode.SPARSE_DUPLICATE_ID,
    ),
    (
        "sparse_unsorted",
        3,
        lambda st: rows_then_done(
            st, reply_row(st, 0, 0, sparse([7, 0], [H, H])), ok_sparse(st, 1), ok_sparse(st, 2)
        ),
        ErrorCode.SPARSE_UNSORTED,
    ),
    (
        "sparse_padded_support",
        3,
        lambda st: rows_then_done(
            st, reply_row(st, 0, 0, sparse([0, -1], [H, H])), ok_sparse(st, 1), ok_sparse(st, 2)
        ),
        ErrorCode.SPARSE_ID_OUT_OF_RANGE,
    ),
    (
        "sparse_out_of_range",
        3,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, sparse([0, VOCAB], [H, H])),
            ok_sparse(st, 1),
            ok_sparse(st, 2),
        ),
        ErrorCode.SPARSE_ID_OUT_OF_RANGE,
    ),
    (
        "sparse_zero_entry",
        3,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, sparse([0, 7], [1.0, 0.0])),
            ok_sparse(st, 1),
            ok_sparse(st, 2),
        ),
        ErrorCode.SPARSE_ZERO_ENTRY,
    ),
    (
        "dense_row_for_sparse_step",
        3,
        lambda st: rows_then_done(
            st,
            reply_row(st, 0, 0, dense_payload(GOOD), representation=0, entries=VOCAB),
            ok_sparse(st, 1),
            ok_sparse(st, 2),
        ),
        ErrorCode.BAD_REPRESENTATION,
    ),
]


async def exercise(build, support, expected, *, reply_timeout=1.0, dropped=None, generation=0):
    sent = {}

    def hostile(conn, data):
        step = conn.core.slots[0].fence.last_step
        sent["bytes"] = build(msgspec.structs.replace(step))
        conn.write(sent["bytes"])

    worker = FaultyWorker(VOCAB, mutate=hostile)
    port = await worker.start()
    client = await AsyncClient.connect(
        "127.0.0.1",
        port,
        SparkConfig(vocab_size=VOCAB, max_support=4, reply_timeout=reply_timeout),
    )
    verifier = RequestVerifier(
        session=client.session,
        seed=11,
        vocab_size=VOCAB,
        prefix=[1, 2, 3],
        target=ToyLM(VOCAB, 3).probs,
        generation=generation,
    )
    await client.open(0, seed=11, prefix=[1, 2, 3], generation=generation)
    try:
        with pytest.raises(ProposalUnavailableError) as info:
            await client.propose(0, depth=3, support=support)
        assert info.value.code is expected
        assert client.fallbacks[expected.name.lower()] == 1
        for code in dropped or []:
            await eventually(lambda code=code: client.dropped[code] >= 1, what=code)
        # Target-only from the committed prefix; the worker accepts it: nothing half-applied.
        round_id = client.new_round(0)
        res = verifier.decode_target_only(round_id)
        await client.commit(0, round_id=round_id, tokens=res.tokens, accepted=0)
        assert worker.slot_prefix() == verifier.committed
        proposal = await client.propose(0, depth=3, support=support)
        res = verifier.verify(proposal)
        client.release(proposal, 0)
        await client.commit(0, round_id=res.round_id, tokens=res.tokens, accepted=res.accepted)
        assert worker.slot_prefix() == verifier.committed
        return client
    finally:
        await client.close()
        await worker.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize(("name", "support", "build", "code"), CLASSES, ids=[c[0] for c in CLASSES])
async def test_malformed_reply_class(name, support, build, code):
    client = await exercise(build, support, code)
    if code not in (
        ErrorCode.REPLY_CHECKSUM_MISMATCH,
        ErrorCode.REPLY_SIZE_MISMATCH,
        ErrorCode.COMPLETION_EARLY,
    ):
        assert client.rejected[code.name.lower()] == 1


@pytest.mark.asyncio
async def test_completion_twice_is_dropped():
    def twice(st):
        whole = rows_then_done(st, ok_dense(st, 0), ok_dense(st, 1), ok_dense(st, 2))
        return whole + completion(st, whole[: len(whole) - len(completion(st, b"", 0))], 3)

    sent = []

    def hostile(conn, data):
        st = conn.core.slots[0].fence.last_step
        sent.append(twice(st))
        conn.write(sent[-1])

    worker = FaultyWorker(VOCAB, mutate=hostile)
    port = await worker.start()
    client = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
    await client.open(0, seed=11, prefix=[1, 2, 3])
    proposal = await client.propose(0, depth=3)
    assert proposal.tokens == (0, 0, 0)
    await eventually(lambda: client.dropped["completion_duplicate"] == 1)
    await client.close()
    await worker.stop()


@pytest.mark.asyncio
async def test_stale_generation_and_missing_completion():
    # Rows of an older generation are dropped; without its own COMPLETION the
    # proposal times out and the round is decoded target-only.
    def stale(st):
        old = msgspec.structs.replace(st, generation=st.generation - 1)
        return ok_dense(old, 0) + ok_dense(old, 1)  # an old generation's rows; no COMPLETION

    await exercise(
        stale,
        0,
        ErrorCode.REPLY_TIMEOUT,
        reply_timeout=0.2,
        generation=1,
        dropped=["stale_generation"],
    )


@pytest.mark.asyncio
async def test_duplicate_round_reply_is_dropped():
    # A replay of an already completed round arrives again: dropped, not consumed.
    state = {"n": 0}

    def replay_old(conn, data):
        state["n"] += 1
        conn.write(data)
        if state["n"] == 1:
            state["first"] = data
        else:
            conn.write(state["first"])  # round 0's reply again, after round 1's

    worker = FaultyWorker(VOCAB, mutate=replay_old, once=False)
    port = await worker.start()
    client = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
    await client.open(0, seed=11, prefix=[1, 2, 3])
    first = await client.propose(0, depth=3)
    client.release(first, 0)
    second = await client.propose(0, depth=3)
    assert second.round_id == first.round_id + 1
    await eventually(lambda: client.dropped["round_reused"] == 4)
    await client.close()
    await worker.stop()
