"""The Spark side against a hostile worker: every malformed reply class over real sockets.

For each class the client must refuse the proposal before anything is consumed,
count it under the right code, let the round be decoded target-only (the worker
accepts that commit, so nothing was half-applied), and work normally next round.
A class whose bad row follows valid ones cuts the block to them instead: the
valid rows are verified and committed (``docs/adaptive.md`` section 7).
"""

from __future__ import annotations

import msgspec
import pytest

from pp1wire.aio.client import AsyncClient, ProposalUnavailableError
from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode
from pp1wire.q.verify import RequestVerifier
from pp1wire.testing.builders import (
    completion,
    whole_reply,
)
from pp1wire.testing.conformance.reply_classes import REPLY_CLASSES, ok_row, ok_token
from pp1wire.wire.spark_core import SparkConfig

from .hostile import FaultyWorker
from .waiting import eventually

VOCAB = 8
CLASSES = REPLY_CLASSES


async def exercise(
    build, support, expected, *, reply_timeout=1.0, dropped=None, generation=0, kept=0
):
    sent = {}

    def hostile(conn, data):
        step = conn.core.slots[0].fence.last_step
        sent["bytes"] = build(msgspec.structs.replace(step))
        conn.write(sent["bytes"])
        if kept:  # the worker drew the valid rows before the fault: they may be committed
            conn.core.slots[0].drafts = (ok_token(step),) * kept

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
        if kept:
            # The fault ends the block after its valid rows: they are verified (a cut).
            cut = await client.propose(0, round_id=client.next_round(0), depth=3, support=support)
            assert cut.cut is expected
            assert len(cut.rows) == kept
            assert client.cuts[expected.name.lower()] == 1
            assert not client.fallbacks
            res = verifier.verify(cut)
            client.release(cut)
            await client.commit(0, round_id=res.round_id, tokens=res.tokens, accepted=res.accepted)
        else:
            with pytest.raises(ProposalUnavailableError) as info:
                await client.propose(0, round_id=client.next_round(0), depth=3, support=support)
            assert info.value.code is expected
            assert client.fallbacks[expected.name.lower()] == 1
            for code in dropped or []:
                await eventually(lambda code=code: client.dropped[code] >= 1, what=code)
            # Target-only from the committed prefix; the worker accepts it: nothing half-applied.
            round_id = client.next_round(0)
            res = verifier.decode_target_only(round_id)
            await client.commit(0, round_id=round_id, tokens=res.tokens, accepted=0)
        assert worker.slot_prefix() == verifier.committed
        proposal = await client.propose(0, round_id=client.next_round(0), depth=3, support=support)
        res = verifier.verify(proposal)
        client.release(proposal)
        await client.commit(0, round_id=res.round_id, tokens=res.tokens, accepted=res.accepted)
        assert worker.slot_prefix() == verifier.committed
        return client
    finally:
        await client.close()
        await worker.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("name", "support", "build", "code", "kept"), CLASSES, ids=[c[0] for c in CLASSES]
)
async def test_malformed_reply_class(name, support, build, code, kept):
    client = await exercise(build, support, code, kept=kept)
    if code not in (
        ErrorCode.REPLY_CHECKSUM_MISMATCH,
        ErrorCode.REPLY_SIZE_MISMATCH,
        ErrorCode.COMPLETION_EARLY,
        ErrorCode.INTERNAL,  # a failure the worker reports is no refused frame
    ):
        assert client.rejected[code.name.lower()] == 1


@pytest.mark.asyncio
async def test_completion_twice_is_dropped():
    def twice(st):
        whole = whole_reply(st, ok_row(st, 0), ok_row(st, 1), ok_row(st, 2))
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
    proposal = await client.propose(0, round_id=client.next_round(0), depth=3)
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
        return ok_row(old, 0) + ok_row(old, 1)  # an old generation's rows; no COMPLETION

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
    first = await client.propose(0, round_id=client.next_round(0), depth=3)
    client.release(first)
    # Target-only commit of round 0: one fresh proposal per slot until committed.
    await client.commit(0, round_id=first.round_id, tokens=[1], accepted=0)
    second = await client.propose(0, round_id=client.next_round(0), depth=3)
    assert second.round_id == first.round_id + 1
    await eventually(lambda: client.dropped["round_reused"] == 4)
    await client.close()
    await worker.stop()
