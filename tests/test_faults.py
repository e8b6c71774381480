"""Faults between real sockets: each ends in a target-only round with no partial commit."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pp1wire.aio.client import (
    AsyncClient,
    ConnectionLostError,
    ProposalUnavailableError,
    RefusedError,
)
from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode
from pp1wire.q.verify import RequestVerifier
from pp1wire.testing.builders import split_frames
from pp1wire.wire.messages import MsgType
from pp1wire.wire.spark_core import SparkConfig

from .hostile import FaultyWorker
from .waiting import eventually

VOCAB = 32
PREFIX = [1, 2, 3]


@contextlib.asynccontextmanager
async def connected(worker: FaultyWorker, **cfg):
    """``worker`` started, a client with slot 0 open at PREFIX and the request's verifier:
    (port, client, verifier); the client is closed and the worker stopped afterwards."""
    port = await worker.start()
    client = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB, **cfg))
    try:
        verifier = RequestVerifier(
            session=client.session,
            seed=11,
            vocab_size=VOCAB,
            prefix=PREFIX,
            target=ToyLM(VOCAB, 3).probs,
        )
        await client.open(0, seed=11, prefix=PREFIX)
        yield port, client, verifier
    finally:
        await client.close()
        await worker.stop()


async def unavailable(client) -> ErrorCode:
    """The code the next proposal on slot 0 fails with (it must fail)."""
    with pytest.raises(ProposalUnavailableError) as info:
        await client.propose(0, round_id=client.next_round(0), depth=3)
    return info.value.code


async def fallback_and_commit(client, verifier):
    round_id = client.next_round(0)
    res = verifier.decode_target_only(round_id)
    await client.commit(0, round_id=round_id, tokens=res.tokens, accepted=0)
    return res


async def normal_round(client, verifier, worker):
    proposal = await client.propose(0, round_id=client.next_round(0), depth=3)
    res = verifier.verify(proposal)
    client.release(proposal)
    await client.commit(0, round_id=res.round_id, tokens=res.tokens, accepted=res.accepted)
    assert worker.slot_prefix() == verifier.committed


@pytest.mark.asyncio
async def test_worker_closes_mid_reply():
    def cut(conn, data):
        conn.write(data[: len(data) // 2])  # row 0 whole, row 1 in part
        conn.transport.close()

    worker = FaultyWorker(VOCAB, mutate=cut)
    async with connected(worker) as (port, client, verifier):
        # The lost connection ends the block after the rows that arrived: they are
        # verified (docs/adaptive.md section 7), not thrown away.
        proposal = await client.propose(0, round_id=client.next_round(0), depth=3)
        assert proposal.cut is ErrorCode.CONNECTION_LOST
        assert len(proposal.rows) == 1
        assert client.cuts["connection_lost"] == 1
        assert not client.fallbacks
        before = list(verifier.committed)
        res = verifier.verify(proposal)  # committed locally: no connection to commit on
        assert verifier.committed == [*before, *res.tokens]
        with pytest.raises(ConnectionLostError):
            await client.open(1, seed=1, prefix=[])
        # Reconnect: the slot is reopened with the committed prefix under a new generation.
        again = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
        verifier.rebuild(verifier.committed, generation=1)
        verifier.session = again.session
        await again.open(0, seed=11, prefix=verifier.committed, generation=1)
        assert worker.slot_prefix() == verifier.committed
        await normal_round(again, verifier, worker)
        await again.close()


@pytest.mark.asyncio
async def test_worker_closes_before_a_whole_row():
    def cut(conn, data):
        conn.write(data[:40])  # not even row 0's header
        conn.transport.close()

    worker = FaultyWorker(VOCAB, mutate=cut)
    async with connected(worker) as (_, client, verifier):
        assert await unavailable(client) is ErrorCode.CONNECTION_LOST
        assert client.fallbacks["connection_lost"] == 1
        before = list(verifier.committed)
        res = verifier.decode_target_only(verifier.last_round + 1)  # target-only, locally
        assert verifier.committed == [*before, *res.tokens]


@pytest.mark.asyncio
async def test_late_reply_times_out_and_is_dropped():
    def late(conn, data):
        asyncio.get_running_loop().call_later(0.4, conn.write, data)

    worker = FaultyWorker(VOCAB, mutate=late)
    async with connected(worker, reply_timeout=0.2) as (_, client, verifier):
        assert await unavailable(client) is ErrorCode.REPLY_TIMEOUT
        assert client.fallbacks["reply_timeout"] == 1
        await fallback_and_commit(client, verifier)
        assert worker.slot_prefix() == verifier.committed
        await eventually(lambda: client.dropped["late_frame"] == 4)  # 3 rows and the completion
        await normal_round(client, verifier, worker)


@pytest.mark.asyncio
async def test_corrupted_row_checksum():
    def corrupt(conn, data):
        frames = split_frames(data)
        first = bytearray(frames[0])
        first[-3] ^= 0x40
        conn.write(bytes(first) + b"".join(frames[1:]))

    worker = FaultyWorker(VOCAB, mutate=corrupt)
    async with connected(worker) as (_, client, verifier):
        assert await unavailable(client) is ErrorCode.ROW_CHECKSUM_MISMATCH
        assert client.rejected["row_checksum_mismatch"] == 1
        assert client.fallbacks["row_checksum_mismatch"] == 1
        await fallback_and_commit(client, verifier)
        assert worker.slot_prefix() == verifier.committed
        await normal_round(client, verifier, worker)


@pytest.mark.asyncio
async def test_stale_generation_reply_after_reset():
    held = []

    def hold(conn, data):
        held.append((conn, data))

    worker = FaultyWorker(VOCAB, mutate=hold)
    async with connected(worker) as (_, client, verifier):
        pending = asyncio.ensure_future(client.propose(0, round_id=client.next_round(0), depth=3))
        await eventually(lambda: held, what="the STEP reached the worker")
        generation = await client.reset(0)
        with pytest.raises(ProposalUnavailableError) as info:
            await pending
        # Our own reset ended the wait at once, under a local code (not a worker's refusal),
        # and is not counted as a fallback.
        assert info.value.code is ErrorCode.CANCELLED
        assert not client.fallbacks
        conn, data = held[0]
        conn.write(data)  # the old generation's reply arrives after RESET
        await eventually(lambda: client.dropped["stale_generation"] == len(split_frames(data)))
        verifier.rebuild(verifier.committed, generation)
        await normal_round(client, verifier, worker)


@pytest.mark.asyncio
async def test_retried_step_over_tcp_is_byte_identical():
    worker = FaultyWorker(VOCAB)
    async with connected(worker) as (_port, client, _):
        await client.propose(0, round_id=client.next_round(0), depth=3)
        conn = worker.conns[-1]
        step = conn.core.slots[0].fence.last_step
        from pp1wire.wire import framing

        writes = []
        conn.write = writes.append  # capture the replayed reply
        conn.data_received(framing.encode_frame(step))
        replay = b"".join(writes)
        assert replay == b"".join(p for parts in conn.core.slots[0].reply for p in parts)
        assert [f[3] for f in split_frames(replay)][-1] == MsgType.COMPLETION


@pytest.mark.asyncio
async def test_a_commit_awaited_across_a_reset_fails_at_once_with_a_local_code():
    # Before: the COMMITTED of the old generation was dropped after the RESET and
    # the future never resolved (an entry keyed without the generation leaked).
    worker = FaultyWorker(VOCAB)
    async with connected(worker) as (_, client, verifier):
        round_id = client.next_round(0)
        res = verifier.decode_target_only(round_id)
        committed = client.commit(0, round_id=round_id, tokens=res.tokens, accepted=0)
        await client.reset(0)
        assert committed.done()
        with pytest.raises(RefusedError) as info:
            committed.result()
        assert info.value.code is ErrorCode.CANCELLED


@pytest.mark.asyncio
async def test_closing_a_slot_ends_its_pending_proposal_at_once():
    # Before: the pending proposal failed only when the next frame or its reply
    # timeout came (1.4 s later in the report), and was counted as a fallback.
    held = []
    worker = FaultyWorker(VOCAB, mutate=lambda conn, data: held.append(data))
    async with connected(worker) as (_, client, _):
        pending = asyncio.ensure_future(client.propose(0, round_id=client.next_round(0), depth=3))
        await eventually(lambda: held, what="the STEP reached the worker")
        await client.close_slot(0)
        with pytest.raises(ProposalUnavailableError) as info:
            await asyncio.wait_for(pending, 0.5)  # the reply timeout is 5 s: not waited for
        assert info.value.code is ErrorCode.CANCELLED
        assert not client.fallbacks  # before: counted as an unknown_slot fallback
