"""Budgets, draw shares and admission follow the principal, not the connection.

A principal is the peer's key ID, or without a key its lineage (docs/protocol.md
§2, §4.4): what one connection of it spent, another of it cannot spend again, and
k connections of one source address share the draw threads as one. Only a fresh
draw keeps a connection from being replaced when the worker is full, and a
connection counts against the limits only while its peer is there. Over
loopback: the attackers connect from 127.0.0.2, the legitimate client from
127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from pp1wire.aio.client import AsyncClient
from pp1wire.aio.server import WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.q.proposal import PrefixDigest
from pp1wire.testing.attacks import (
    commit_loop,
    open_link,
    probe,
    reset_step_loop,
    squat,
    step_at,
)
from pp1wire.wire import framing
from pp1wire.wire.draws import run_each
from pp1wire.wire.principals import LINEAGE_RATE, PrincipalPolicy
from pp1wire.wire.spark_core import SparkConfig
from pp1wire.wire.worker_core import WorkerConfig

from .test_hostile_clients import _count
from .waiting import GatedDrafter, eventually

VOCAB = 64
ATTACKER = "127.0.0.2"


@contextlib.asynccontextmanager
async def _worker(config: WorkerConfig, drafter=None, **kw):
    srv = WorkerServer(config, drafter or drafter_factory(config.vocab_size), **kw)
    port = await srv.start("127.0.0.1", 0)
    try:
        yield srv, port
    finally:
        await srv.stop(grace=1.0)


# -- squatting ----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("reopen", [False, True], ids=["target-only-commits", "close-open"])
async def test_keep_alive_squatters_cannot_keep_a_full_worker_from_a_drawing_client(reopen):
    # Before: a target-only COMMIT (or an OPEN) counted as the work that protects a
    # slot, so peers committing one token (or reopening their slot) every 50 ms kept
    # a full worker full forever: every newcomer was refused CONNECTION_LIMIT. Now
    # only a fresh draw protects: the squatters are replaceable, a client that draws
    # gets in and stays, and the squatters only replace each other.
    stop = threading.Event()
    async with _worker(
        WorkerConfig(vocab_size=VOCAB), max_connections=2, slot_idle_timeout=0.3
    ) as (srv, port):
        squatters = [
            asyncio.ensure_future(
                asyncio.to_thread(
                    squat, port, VOCAB, period=0.05, stop=stop, source=ATTACKER, reopen=reopen
                )
            )
            for _ in range(2)
        ]
        try:
            await eventually(lambda: len(srv.conns) == 2, what="the squatters hold the worker")
            await asyncio.sleep(1.2)  # past the first connection's grace and the slot timeout
            assert await asyncio.wait_for(probe(port, VOCAB), 10) > 0
            client = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
            try:
                await client.open(0, seed=3, prefix=[1, 2])
                for n in range(20):  # drawing every 50 ms: never replaced
                    proposal = await client.propose(0, round_id=client.next_round(0), depth=1)
                    proposal.release()
                    # The round it stepped, accepting nothing: what a Spark side commits.
                    round_id = proposal.round_id
                    await client.commit(0, round_id=round_id, tokens=[5 + n], accepted=0)
                    await asyncio.sleep(0.05)
                assert not client.closed
            finally:
                await client.close()
        finally:
            stop.set()
            closed = await asyncio.gather(*squatters)
    assert sum(closed) >= 1  # the squatters made room, the client did not


# -- budgets across reconnection -----------------------------------------------------------

# The abandon budget the attack loops below run into: a burst of one, then four draws
# a second; each loop runs for WINDOW seconds.
RATE, BURST, WINDOW = 4.0, 1, 1.0
BUDGETED = WorkerConfig(vocab_size=256, abandon_rate=RATE, abandon_burst=BURST)


async def _attack(port: int, loop, **kw) -> tuple[int, int, float]:
    """Run an attack loop of :mod:`pp1wire.testing.attacks` from :data:`ATTACKER` for
    :data:`WINDOW` seconds; the draws it got, those refused, and the seconds it ran."""
    running, stop = threading.Event(), threading.Event()
    running.set()
    attack = asyncio.ensure_future(
        asyncio.to_thread(
            loop, port, BUDGETED.vocab_size, running=running, stop=stop, source=ATTACKER, **kw
        )
    )
    start = time.monotonic()
    await asyncio.sleep(WINDOW)
    stop.set()
    drawn, refused = await asyncio.wait_for(attack, 10)
    return drawn, refused, time.monotonic() - start


@pytest.mark.asyncio
async def test_a_reset_step_loop_that_reconnects_when_refused_is_held_to_its_births():
    # Before: the abandon budget lived on the connection, so reconnecting at the
    # first DRAW_RATE_LIMITED brought a fresh budget: ~100x the draws the budget
    # allows. Then it lived on the source address, which made the loop's debt every
    # client's of that address. Now a reconnection without a lineage token starts a
    # new lineage, and once one of them abandoned a draw its address starts new ones
    # at most --lineage-burst at once and LINEAGE_RATE a second, each with one free
    # abandon.
    async with _worker(BUDGETED, policy=PrincipalPolicy(lineage_burst=2)) as (_, port):
        drawn, refused, elapsed = await _attack(
            port, reset_step_loop, connections=1, slots=1, reconnect=True
        )
    # Per lineage its first draw and its abandon burst (BURST: the RESET after each
    # abandons it, then the next STEP is refused), one lineage per birth (the first, then
    # a burst of 2 and the rate once a lineage has abandoned); one more by the end.
    births = 1 + 2 + LINEAGE_RATE * elapsed
    assert drawn <= births * (1 + BURST) + 1, (drawn, refused, elapsed)
    assert refused >= 1


# -- the draw threads, shared by principal --------------------------------------------------


def _drawing(srv: WorkerServer) -> int:
    return sum(len(c.core._drawing) for c in srv.conns if c.core is not None)


@pytest.mark.asyncio
@pytest.mark.parametrize("batch", [1, 4], ids=["alone", "together"])
async def test_k_connections_of_one_principal_share_the_draw_threads_as_one(batch):
    # Four connections of one principal keep all four slots drawing (what a
    # RESET/STEP loop does); one thread draws, and its first batch is held until
    # every STEP has arrived. Served in arrival order the legitimate draw came
    # 17th; shared per connection, the attacker's four connections had four turns
    # for the legitimate client's one. Shared per principal the legitimate draw
    # goes in the batch right after the one already running: each STEP drawn
    # alone, second; drafted together in batches of 4, within the first 4 + 1 calls.
    attacker_token, legit_token = 9, 8
    drafter = GatedDrafter(VOCAB)
    run = run_each if batch == 1 else None  # None: the default, drafting together
    config = WorkerConfig(vocab_size=VOCAB, max_slots=4)
    async with _worker(config, drafter, draw_threads=1, run_batch=run, max_draw_batch=batch) as (
        srv,
        port,
    ):
        prefix = [1, attacker_token]
        links = [
            await asyncio.to_thread(open_link, port, VOCAB, 4, prefix, source=ATTACKER)
            for _ in range(4)
        ]
        legit = await AsyncClient.connect(
            "127.0.0.1", port, SparkConfig(vocab_size=VOCAB, max_depth=1)
        )
        try:
            await legit.open(0, seed=1, prefix=[1, legit_token])
            for sock, session, _ in links:
                steps = [step_at(session, s, 0, PrefixDigest(prefix), depth=1) for s in range(4)]
                sock.sendall(b"".join(framing.encode_frame(m) for m in steps))
            assert await asyncio.to_thread(drafter.started.wait, 10)
            await eventually(lambda: _drawing(srv) == 16, what="the attacker's sixteen draws")
            mine = asyncio.ensure_future(legit.propose(0, round_id=0, depth=1))
            await eventually(lambda: _drawing(srv) == 17, what="the legitimate draw requested")
            drafter.gate.set()
            await asyncio.wait_for(mine, 10)
            position = drafter.order.index(legit_token) + 1
            assert position <= batch + 1, drafter.order
            # Every attacker draw is still made: a share delays, it never drops.
            await eventually(
                lambda: drafter.order.count(attacker_token) == 16, what="all sixteen drawn"
            )
        finally:
            drafter.gate.set()
            await legit.close()
            for sock, _, _ in links:
                sock.close()


# -- a connection counts only while it is open ----------------------------------------------


@pytest.mark.asyncio
async def test_a_held_connection_whose_peer_left_stops_counting_at_once():
    # Before: a connection held after a DRAW_RATE_LIMITED refusal was not read, so
    # its peer's leaving went unnoticed until the hold ended, and it still counted
    # against --max-connections: the next client was refused CONNECTION_LIMIT.
    config = WorkerConfig(vocab_size=VOCAB, abandon_rate=0.2, abandon_burst=1)
    async with _worker(config, max_connections=1) as (srv, port):
        sock, session, _ = await asyncio.to_thread(
            open_link, port, VOCAB, 1, [1, 2, 3], source=ATTACKER
        )
        (conn,) = srv.conns
        from .test_hostile_clients import _reset_step_pairs

        await asyncio.to_thread(sock.sendall, _reset_step_pairs(session, 10, [1, 2, 3]))
        await eventually(
            lambda: _count(srv.metrics.refusals, code="draw_rate_limited") >= 1,
            what="the loop refused",
        )
        await eventually(lambda: not conn.reading, what="the connection held")
        sock.close()
        # At once: the client is admitted although the hold has seconds to run.
        assert await asyncio.wait_for(probe(port, VOCAB), 5) > 0


@pytest.mark.asyncio
async def test_a_connection_waiting_for_a_draw_whose_peer_left_stops_counting_at_once():
    # A message for a slot being drawn stops reading until the draw is done; the
    # peer's leaving meanwhile went unnoticed, and the connection still counted.
    drafter = GatedDrafter(VOCAB)
    async with _worker(
        WorkerConfig(vocab_size=VOCAB), drafter, max_connections=1, draw_threads=1
    ) as (srv, port):
        try:
            sock, session, _ = await asyncio.to_thread(
                open_link, port, VOCAB, 1, [1, 2], source=ATTACKER
            )
            (conn,) = srv.conns
            ask = framing.encode_frame(step_at(session, 0, 0, PrefixDigest([1, 2]), depth=1))
            await asyncio.to_thread(sock.sendall, ask + ask)  # the retry waits for the draw
            assert await asyncio.to_thread(drafter.started.wait, 10)
            await eventually(lambda: conn.core.waiting, what="the retry held for the draw")
            sock.close()
            # Admitted at once (its own draws would wait for the gate: it only pings).
            client = await AsyncClient.connect(
                "127.0.0.1", port, SparkConfig(vocab_size=VOCAB), timeout=5.0
            )
            await asyncio.wait_for(client.ping(), 5)
            await client.close()
        finally:
            drafter.gate.set()


@pytest.mark.asyncio
async def test_a_client_reconnecting_at_once_is_never_refused_by_its_own_closing_connection():
    async with _worker(WorkerConfig(vocab_size=VOCAB), max_connections=1) as (srv, port):
        config = SparkConfig(vocab_size=VOCAB)
        for _ in range(20):
            client = await AsyncClient.connect("127.0.0.1", port, config)
            await client.open(0, seed=1, prefix=[1, 2])
            (await client.propose(0, round_id=0, depth=1)).release()  # protected: it drew
            await client.commit(0, round_id=0, tokens=[3], accepted=0)
            await client.close()
        assert _count(srv.metrics.refusals, code="connection_limit") == 0


async def _drawing_beside(port: int, vocab: int, stop: asyncio.Event) -> int:
    """A client from 127.0.0.1 drawing a proposal every 50 ms (committing each round it
    steps) until ``stop``; the proposals it got."""
    client = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=vocab))
    got = 0
    try:
        await client.open(0, seed=9, prefix=[1, 2])
        while not stop.is_set():
            round_id = client.next_round(0)
            (await client.propose(0, round_id=round_id, depth=1)).release()
            await client.commit(0, round_id=round_id, tokens=[3], accepted=0)
            got += 1
            await asyncio.sleep(0.05)
    finally:
        await client.close()
    return got


@pytest.mark.asyncio
async def test_a_step_then_target_only_commit_loop_is_bounded_by_the_abandon_budget():
    # Before: STEP round r, then COMMIT round r + 1 (never stepped) drew without
    # bound and was never refused: ~600 draws a second at this vocabulary, beside
    # a client waiting for the draw threads.
    async with _worker(BUDGETED) as (_, port):
        done = asyncio.Event()
        beside = asyncio.ensure_future(_drawing_beside(port, BUDGETED.vocab_size, done))
        drawn, refused, elapsed = await _attack(port, commit_loop, connections=2, slots=2)
        done.set()
        assert await asyncio.wait_for(beside, 10) >= 1  # never refused: it commits its rounds
    # Each connection is a lineage of its own (no token: a new one), whose budget starts
    # empty: its two first draws (passed over only by the COMMIT after them), then one
    # per payback period, and one more at the end of the window.
    assert drawn <= 2 * (2 + RATE * elapsed + 1), (drawn, refused, elapsed)
    assert refused >= 1


def test_the_documented_budget_defaults():
    # docs/protocol.md §4.4 and §2: a slot may run 4 draws ahead of --max-draw-rate;
    # 4,096 principals are remembered without a connection; the grace is 1 s.
    from pp1wire.aio import admission
    from pp1wire.apps import worker
    from pp1wire.wire import budgets

    args = worker.build_parser().parse_args(["--max-draw-rate", "50"])
    config = worker.config_from(args)
    assert (config.max_draw_rate, config.draw_burst) == (50.0, 4)
    assert (config.abandon_rate, config.abandon_burst) == (1.0, 2 * config.max_slots)
    assert budgets.Accounts(config).idle == budgets.IDLE_ACCOUNTS == 4096
    assert admission.HANDSHAKE_GRACE_S == 1.0
    assert budgets.SHARE_WINDOW_S == 1.0
    # docs/operators.md §3: a lineage is kept 10 minutes owing nothing; for
    # 10 s after one of its lineages abandoned a draw, an address starts 16 new ones at
    # once then 1 a second; an IPv6 address counts as its /64.
    from pp1wire.wire import principals

    assert principals.LINEAGE_KEEP_S == 600.0
    assert principals.Births().window == principals.LINEAGE_WINDOW_S == 10.0
    assert principals.PACED_LINEAGE_FREE == 1.0  # a paced address's new lineage: one free
    policy = worker.policy_from(args)
    assert (policy.lineage_burst, policy.lineage_rate, policy.ipv6_prefix) == (16, 1.0, 64)
    assert policy.lineage_keep == principals.LINEAGE_KEEP_S
