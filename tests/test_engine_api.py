"""The API an engine's sampler calls: a batch of requests per call, one error type per kind.

Everything here is imported from ``pp1wire`` alone except the workers the tests
run against (an in-process worker server, and a worker whose replies a test can
cut).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import pytest_asyncio

from pp1wire import (
    AsyncClient,
    ConnectionLostError,
    ErrorCode,
    Outcome,
    Proposal,
    ProposalUnavailableError,
    RefusedError,
    RequestVerifier,
    RoundResult,
    SparkConfig,
    SyncClient,
    UsageError,
    derive_seed,
    step_prefixes,
    toy_target,
    verify_step,
)
from pp1wire.aio.server import WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.errors import ProposalReleasedError
from pp1wire.wire import framing
from pp1wire.wire.messages import MsgType
from pp1wire.wire.worker_core import WorkerConfig

from .hostile import FaultyWorker
from .waiting import eventually

VOCAB = 64
PROMPT = [1, 2, 3]


@pytest_asyncio.fixture
async def port():
    srv = WorkerServer(WorkerConfig(vocab_size=VOCAB), drafter_factory(VOCAB, 3))
    yield await srv.start("127.0.0.1", 0)
    await srv.stop(grace=1.0)


async def connect(port: int, **config) -> AsyncClient:
    return await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB, **config))


async def open_requests(client: AsyncClient, count: int):
    return [
        await client.open_request(i, seed=derive_seed(7, i), prompt=PROMPT) for i in range(count)
    ]


def decide(requests, batch):
    """Score and verify one step the way an engine does; commits nothing on the wire."""
    rounds = [r.round_for(outcome) for r, outcome in zip(requests, batch, strict=True)]
    return verify_step(rounds, toy_target(VOCAB, 3).batch(step_prefixes(rounds)))


async def commit_all(client: AsyncClient, requests, results, worker=None) -> None:
    """Commit each request's result of a step, which must be a round's result; with
    ``worker`` (a :class:`FaultyWorker`), its slot then holds what the request committed."""
    for request, result in zip(requests, results, strict=True):
        assert isinstance(result, RoundResult)
        await client.commit_round(request, result)  # the worker applied it
        if worker is not None:
            assert worker.slot_prefix(request.slot) == request.verifier.committed


@pytest.mark.asyncio
async def test_propose_many_gives_each_request_its_proposal_and_a_with_block_releases_them(port):
    client = await connect(port)
    requests = await open_requests(client, 3)
    for step in range(3):
        with await client.propose_many(requests, depth=3) as batch:
            assert all(isinstance(p, Proposal) for p in batch)
            assert [p.slot for p in batch] == [0, 1, 2]
            assert [p.round_id for p in batch] == [step] * 3  # each request's own counter
            results = decide(requests, batch)
            assert batch[0].rows[0].q32 is not None  # readable inside the block
        with pytest.raises(ProposalReleasedError):
            _ = batch[0].rows[0].q32  # released when the block ended
        batch[0].release()  # idempotent
        client.release(batch[1])
        await commit_all(client, requests, results)
    assert all(len(r.tokens) >= 3 for r in requests)
    await client.close()


@pytest.mark.asyncio
async def test_a_slot_whose_completion_is_lost_gets_its_rows_cut_at_the_deadline():
    def lose_completion_1(conn, data):  # slot 1's COMPLETION never arrives
        frames = framing.FrameDecoder(1 << 26).feed(data)
        conn.write(
            b"".join(
                bytes(f.raw)
                for f in frames
                if not (f.type is MsgType.COMPLETION and f.message.slot == 1)
            )
        )

    worker = FaultyWorker(VOCAB, mutate=lose_completion_1, once=False)
    client = await connect(await worker.start(), reply_timeout=0.3)
    requests = await open_requests(client, 3)
    with await client.propose_many(requests, depth=3) as batch:
        assert all(isinstance(p, Proposal) for p in batch)
        # Its rows arrived, its COMPLETION did not: at the reply deadline the rows that
        # validated are the block, cut there (docs/adaptive.md section 7).
        assert batch[1].cut is ErrorCode.REPLY_TIMEOUT
        assert len(batch[1].rows) == 3
        assert batch[0].cut is None
        assert batch[2].cut is None
        results = decide(requests, batch)
    assert client.cuts == {"reply_timeout": 1}
    await commit_all(client, requests, results, worker)
    await client.close()
    await worker.stop()


@pytest.mark.asyncio
async def test_the_engines_own_deadline_cuts_late_blocks_at_the_rows_that_arrived():
    def slow_slot_1(conn, data):  # slot 1's row 0 at once, the rest of its reply late
        frames = framing.FrameDecoder(1 << 26).feed(data)
        now = b"".join(
            bytes(f.raw)
            for f in frames
            if f.message.slot != 1 or (f.type is MsgType.REPLY and f.message.index == 0)
        )
        later = b"".join(
            bytes(f.raw)
            for f in frames
            if f.message.slot == 1 and not (f.type is MsgType.REPLY and f.message.index == 0)
        )
        conn.write(now)
        asyncio.get_running_loop().call_later(0.5, conn.write, later)

    worker = FaultyWorker(VOCAB, mutate=slow_slot_1, once=False)
    client = await connect(await worker.start(), reply_timeout=5.0)
    requests = await open_requests(client, 3)
    started = asyncio.get_running_loop().time()
    with await client.propose_many(requests, depth=3, timeout=0.1) as batch:
        assert asyncio.get_running_loop().time() - started < 0.4  # the engine's deadline
        assert [p.cut for p in batch] == [None, ErrorCode.REPLY_TIMEOUT, None]
        assert len(batch[1].rows) == 1
        results = decide(requests, batch)
    await commit_all(client, requests, results)
    await eventually(lambda: client.dropped["late_frame"] + client.dropped["round_reused"] >= 1)
    for request in requests:
        assert worker.slot_prefix(request.slot) == request.verifier.committed
    await client.close()
    await worker.stop()


@pytest.mark.asyncio
async def test_one_slots_failure_is_its_own_entry_and_its_round_goes_target_only():
    def lose_slot_1(conn, data):  # nothing of slot 1's reply arrives
        frames = framing.FrameDecoder(1 << 26).feed(data)
        conn.write(b"".join(bytes(f.raw) for f in frames if f.message.slot != 1))

    worker = FaultyWorker(VOCAB, mutate=lose_slot_1, once=False)
    client = await connect(await worker.start(), reply_timeout=0.3)
    requests = await open_requests(client, 3)
    with await client.propose_many(requests, depth=3) as batch:
        assert isinstance(batch[0], Proposal)
        assert isinstance(batch[2], Proposal)
        assert isinstance(batch[1], ProposalUnavailableError)
        assert batch[1].code is ErrorCode.REPLY_TIMEOUT
        rounds = [r.round_for(outcome) for r, outcome in zip(requests, batch, strict=True)]
        assert [round_id for _, _, round_id in rounds] == [0, 1, 0]  # round 0 was the STEP's
        results = verify_step(rounds, toy_target(VOCAB, 3).batch(step_prefixes(rounds)))
    assert isinstance(results[1], RoundResult)
    assert results[1].outcome is Outcome.TARGET
    await commit_all(client, requests, results, worker)
    await client.close()
    await worker.stop()


@pytest.mark.asyncio
async def test_misuse_is_a_usage_error_and_sends_nothing_nor_takes_a_round(port):
    client = await connect(port)
    other = await connect(port)
    a, b = await open_requests(client, 2)
    (elsewhere,) = await open_requests(other, 1)
    cases = [
        ({"requests": [a], "depth": 0}, ErrorCode.DEPTH_OUT_OF_RANGE),
        ({"requests": [a], "depth": 6}, ErrorCode.DEPTH_OUT_OF_RANGE),
        ({"requests": [a], "depth": 3, "support": VOCAB + 1}, ErrorCode.SUPPORT_OUT_OF_RANGE),
        ({"requests": [a, a], "depth": 3}, ErrorCode.BAD_ARGUMENT),
        ({"requests": [a, elsewhere], "depth": 3}, ErrorCode.BAD_ARGUMENT),
    ]
    for kwargs, code in cases:
        with pytest.raises(UsageError) as info:
            await client.propose_many(**kwargs)
        assert info.value.code is code, kwargs
    await client.close_request(b)
    with pytest.raises(UsageError) as info:
        await client.propose_many([a, b], depth=3)
    assert info.value.code is ErrorCode.UNKNOWN_SLOT
    with pytest.raises(UsageError) as info:
        await client.open_request(3, seed=1, prompt=[VOCAB])
    assert info.value.code is ErrorCode.TOKEN_OUT_OF_RANGE
    assert a.verifier.take_round() == 0  # no call above took one
    theirs = await one(other, elsewhere)
    with pytest.raises(UsageError):
        client.release(theirs)  # another client's buffers
    theirs.release()
    await client.close()
    await other.close()


@pytest.mark.asyncio
async def test_a_stop_rule_not_negotiated_is_a_usage_error_and_takes_no_round(port):
    # Before: propose_many checked depth and support itself but not the stop rule,
    # so each request took a round before the core refused its STEP.
    from pp1wire.q.stoprules import StopRule

    client = await connect(port)  # no stop-rule set negotiated
    a, b = await open_requests(client, 2)
    with pytest.raises(UsageError) as info:
        await client.propose_many([a, b], depth=3, stop=StopRule.confidence(0.5))
    assert info.value.code is ErrorCode.BAD_STOP_RULE
    assert a.verifier.take_round() == 0
    assert b.verifier.take_round() == 0
    await client.close()


@pytest.mark.asyncio
async def test_a_slot_with_a_proposal_in_flight_is_busy():
    held = []
    worker = FaultyWorker(VOCAB, mutate=lambda conn, data: held.append(data))  # holds a reply
    client = await connect(await worker.start())
    a, b = await open_requests(client, 2)
    pending = asyncio.ensure_future(client.propose_many([b], depth=3))
    await eventually(lambda: held, what="the STEP reached the worker")
    with pytest.raises(UsageError) as info:
        await client.propose_many([a, b], depth=3)
    assert info.value.code is ErrorCode.SLOT_BUSY
    await client.reset_request(b)  # abandon b's step: a new generation on the same slot
    (outcome,) = await pending
    assert isinstance(outcome, ProposalUnavailableError)
    assert outcome.code is ErrorCode.CANCELLED  # this side reset the slot
    assert not client.fallbacks  # which is not a fallback
    assert b.verifier.generation == 1
    with await client.propose_many([a, b], depth=3) as batch:
        assert [p.round_id for p in batch] == [0, 0]  # nothing was sent for a before
        results = decide([a, b], batch)
    await commit_all(client, [a, b], results, worker)
    await client.close_request(b)
    with pytest.raises(UsageError) as info:
        await client.propose_many([a, b], depth=3)
    assert info.value.code is ErrorCode.UNKNOWN_SLOT
    await client.close()
    await worker.stop()


async def one(client: AsyncClient, request) -> Proposal:
    (proposal,) = await client.propose_many([request], depth=2)
    assert isinstance(proposal, Proposal)
    return proposal


@pytest.mark.asyncio
async def test_a_refused_open_is_a_refused_error_and_leaves_the_slot_free(port):
    client = await connect(port)
    with pytest.raises(RefusedError) as info:
        await client.open_request(0, seed=1, prompt=PROMPT, eos=VOCAB + 5)  # the worker refuses
    assert info.value.code is ErrorCode.TOKEN_OUT_OF_RANGE
    request = await client.open_request(0, seed=1, prompt=PROMPT)  # the same slot, at once
    assert request.verifier.generation == 1
    (await one(client, request)).release()
    await client.close()


@pytest.mark.asyncio
async def test_a_slot_the_worker_refused_is_skipped_until_reopened(port):
    client = await connect(port)
    (request,) = await open_requests(client, 1)
    (result,) = decide([request], [None])  # round 0, target-only
    await client.commit_round(request, result)
    refused = client.commit_round(request, result)  # round 0 again: the worker refuses it
    with pytest.raises(RefusedError):
        await refused
    (outcome,) = await client.propose_many([request], depth=3)
    assert isinstance(outcome, ProposalUnavailableError)
    assert outcome.code is ErrorCode.SLOT_DESYNCED
    assert request.verifier.take_round() == 1  # no STEP was sent, so no round was taken
    with pytest.raises(RefusedError):
        client.commit_round(request, result)
    await client.reopen(request)
    assert request.verifier.generation == 1
    with await client.propose_many([request], depth=3) as batch:
        assert batch[0].round_id == 0  # a new generation's rounds start at 0
        (result,) = decide([request], batch)
    await client.commit_round(request, result)
    await client.close()


@pytest.mark.asyncio
async def test_a_lost_connection_is_one_type_and_the_requests_move_to_a_new_one(port):
    client = await connect(port)
    requests = await open_requests(client, 2)
    client.abort()
    await client.close()
    assert client.closed
    batch = await client.propose_many(requests, depth=3)
    assert [p.code for p in batch] == [ErrorCode.CONNECTION_LOST] * 2
    results = decide(requests, batch)  # target-only, locally
    for request, result in zip(requests, results, strict=True):
        with pytest.raises(ConnectionLostError):
            client.commit_round(request, result)
    with pytest.raises(ConnectionLostError):
        await client.open(3, seed=1, prefix=PROMPT)
    fresh = await connect(port)
    for request in requests:
        await fresh.reopen(request)
        assert request.client is fresh
        assert request.verifier.generation == 1
    batch = await fresh.propose_many(requests, depth=3)
    await commit_all(fresh, requests, decide(requests, batch))
    batch.release()
    await fresh.close()


@pytest.mark.asyncio
async def test_a_refused_handshake_is_a_refused_error(port):
    with pytest.raises(RefusedError) as info:
        await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB + 1))
    assert info.value.code is ErrorCode.VOCAB_SIZE_MISMATCH


def twins(verifiers):
    return [
        RequestVerifier(
            session=v.session,
            seed=v.seed,
            vocab_size=v.vocab_size,
            prefix=v.committed,
            target=toy_target(VOCAB, 3),
            generation=v.generation,
        )
        for v in verifiers
    ]


@pytest.mark.asyncio
async def test_verify_step_commits_what_each_requests_verifier_commits(port):
    client = await connect(port)
    requests = await open_requests(client, 4)
    target = toy_target(VOCAB, 3)
    for _ in range(4):
        asking = requests[:3]  # the fourth decodes target-only every step
        with await client.propose_many(asking, depth=4, temperature=0.8) as batch:
            alone = twins([r.verifier for r in requests])
            expected = [v.verify(p) for v, p in zip(alone, batch, strict=False)]
            rounds = [r.round_for(p) for r, p in zip(asking, batch, strict=True)]
            rounds.append(requests[3].round_for(None))
            expected.append(alone[3].decode_target_only(rounds[3][2]))
            probs = target.batch(step_prefixes(rounds))
            with pytest.raises(UsageError) as info:
                verify_step(rounds, probs[:-1])  # one row short: nothing decided
            assert info.value.code is ErrorCode.BAD_ARGUMENT
            results = verify_step(rounds, probs)
        assert results == expected
        for request, result in zip(requests, results, strict=True):
            client.commit_round(request, result)
    await client.close()


def test_verify_step_takes_an_engine_tensor():
    torch = pytest.importorskip("torch")
    a = RequestVerifier(
        session=0, seed=5, vocab_size=VOCAB, prefix=PROMPT, target=toy_target(VOCAB)
    )
    b = twins([a])[0]
    rounds = [(a, None, a.take_round())]
    probs = toy_target(VOCAB).batch(step_prefixes(rounds))
    (on_tensor,) = verify_step(rounds, torch.from_numpy(probs))
    (on_array,) = verify_step([(b, None, b.take_round())], np.asarray(probs))
    assert on_tensor == on_array


def test_the_blocking_client_releases_from_the_callers_thread(port_sync):
    with SyncClient("127.0.0.1", port_sync, SparkConfig(vocab_size=VOCAB)) as client:
        requests = [client.open_request(i, seed=derive_seed(7, i), prompt=PROMPT) for i in range(2)]
        for _ in range(3):
            with client.propose_many(requests, depth=3) as batch:
                results = decide(requests, batch)
            with pytest.raises(ProposalReleasedError):
                _ = batch[0].rows[0].q32
            client.commit_rounds(zip(requests, results, strict=True))
        assert all(len(r.tokens) >= 3 for r in requests)
        for request in requests:
            client.close_request(request)


@pytest.fixture
def port_sync():
    """A worker on its own loop thread, for the blocking client."""
    loop = asyncio.new_event_loop()
    srv = WorkerServer(WorkerConfig(vocab_size=VOCAB), drafter_factory(VOCAB, 3))

    async def start():
        return await srv.start("127.0.0.1", 0)

    port = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield port
    asyncio.run_coroutine_threadsafe(srv.stop(grace=1.0), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
