"""A refusal falls on the spender: key IDs, lineages and the caps per principal.

docs/protocol.md §2 and §4.4. With keys, a connection's principal is the key ID
it authenticated with; without, its lineage: a token the worker issues in its
HELLO and a Spark side presents again when it reconnects. Over loopback, the
attackers here connect from the legitimate client's own address (127.0.0.1):
what decides who pays is the key or the lineage, never the address.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from pp1wire.aio.client import AsyncClient, ProposalUnavailableError, RefusedError
from pp1wire.aio.server import WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.errors import ErrorCode
from pp1wire.testing.attacks import Key, commit_loop, open_link, reset_step_loop
from pp1wire.wire.budgets import Account
from pp1wire.wire.principals import LINEAGE_RATE, Births, Principal, PrincipalPolicy
from pp1wire.wire.spark_core import SparkConfig
from pp1wire.wire.worker_core import WorkerConfig

from .test_hostile_clients import _count
from .waiting import eventually

VOCAB = 64
CLIENT_KEY, ATTACKER_KEY = b"c" * 32, b"a" * 32
KEYS = (("client", CLIENT_KEY), ("attacker", ATTACKER_KEY))
# A budget the loops run into at once: one abandon free, then four a second.
BUDGETED = WorkerConfig(vocab_size=VOCAB, abandon_rate=4.0, abandon_burst=1)


@contextlib.asynccontextmanager
async def _worker(config: WorkerConfig, **kw):
    srv = WorkerServer(config, drafter_factory(config.vocab_size), **kw)
    port = await srv.start("127.0.0.1", 0)
    try:
        yield srv, port
    finally:
        await srv.stop(grace=1.0)


async def _client_beside(port: int, config: SparkConfig, stop: asyncio.Event) -> tuple[int, int]:
    """A Spark side on 127.0.0.1 drawing a depth-1 proposal every 20 ms and committing
    each round it stepped, until ``stop``: (proposals got, proposals refused)."""
    client = await AsyncClient.connect("127.0.0.1", port, config)
    got = refused = 0
    codes: list[ErrorCode] = []
    try:
        await client.open(0, seed=9, prefix=[1, 2])
        while not stop.is_set():
            round_id = client.next_round(0)
            try:
                (await client.propose(0, round_id=round_id, depth=1)).release()
                got += 1
            except ProposalUnavailableError as exc:
                codes.append(exc.code)
                refused += 1
            await client.commit(0, round_id=round_id, tokens=[3], accepted=0)
            await asyncio.sleep(0.02)
    finally:
        await client.close()
    assert set(codes) <= {ErrorCode.DRAW_RATE_LIMITED}, codes  # no other loss
    return got, refused


async def _beside_loop(port: int, loop, client: SparkConfig, seconds: float, **kw):
    """Run an attack ``loop`` from 127.0.0.1 for ``seconds`` beside :func:`_client_beside`:
    (the client's proposals got and refused, the loop's draws and refusals)."""
    running, stop = threading.Event(), threading.Event()
    running.set()
    done = asyncio.Event()
    attack = asyncio.ensure_future(
        asyncio.to_thread(loop, port, VOCAB, running=running, stop=stop, source="127.0.0.1", **kw)
    )
    beside = asyncio.ensure_future(_client_beside(port, client, done))
    await asyncio.sleep(seconds)
    done.set()
    stop.set()
    got, refused = await asyncio.wait_for(beside, 10)
    drawn, limited = await asyncio.wait_for(attack, 10)
    return got, refused, drawn, limited


# -- without a key: lineages ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_reconnect_loop_from_the_clients_own_address_never_refuses_the_client():
    # Before: the principal was the source address, so a RESET/STEP loop on 127.0.0.1
    # that reconnected at each refusal spent 127.0.0.1's abandon budget, and the
    # legitimate client on 127.0.0.1 was refused DRAW_RATE_LIMITED with it (0.04x its
    # speed through the daemons). Now each is a lineage: the loop's refusals are its own.
    async with _worker(BUDGETED, policy=PrincipalPolicy(lineage_burst=2)) as (srv, port):
        got, refused, drawn, limited = await _beside_loop(
            port, reset_step_loop, SparkConfig(vocab_size=VOCAB), 1.0,
            connections=1, slots=2, reconnect=True,
        )  # fmt: skip
        assert _count(srv.metrics.refusals, code="draw_rate_limited") >= limited >= 1
    assert refused == 0, (got, refused)
    assert got >= 10, (got, refused)
    # And the loop is bounded: per lineage one draw per slot and its abandon burst (one),
    # lineages born at once until one abandons, then 2 at once and LINEAGE_RATE a second,
    # and the two slots' draws cut by the end.
    births = 1 + 2 + LINEAGE_RATE * 1.0
    assert drawn <= births * (2 + 1) + 2, drawn


@pytest.mark.asyncio
async def test_a_spark_side_keeps_its_lineage_across_reconnects_and_nobody_else_gets_it():
    slow = WorkerConfig(vocab_size=VOCAB, abandon_rate=0.01, abandon_burst=1)  # 100 s each
    async with _worker(slow) as (srv, port):
        first = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
        token = first.core.lineage
        assert len(token) == 16
        (conn,) = srv.conns
        assert conn.principal == Principal.of_lineage(token)
        owing = conn.core.gate.account
        await first.open(0, seed=1, prefix=[1, 2])
        for _ in range(2):  # abandons two draws: the one free, and one owed
            (await first.propose(0, round_id=first.next_round(0), depth=1)).release()
            await first.reset(0)
        await first.close()
        await eventually(lambda: not srv.conns, what="the first connection closed")
        # Presented again, the token is the same principal, debt and all: reconnecting
        # launders nothing.
        again = await AsyncClient.connect(
            "127.0.0.1", port, SparkConfig(vocab_size=VOCAB, lineage=token)
        )
        assert again.core.lineage == token
        (conn,) = srv.conns
        assert conn.core.gate.account is owing
        assert owing.owes(time.monotonic()) > 50  # the 100 s the abandon costs, less a little
        await again.close()
        # A token the worker did not issue starts a new lineage of its own, owing nothing.
        stranger = await AsyncClient.connect(
            "127.0.0.1", port, SparkConfig(vocab_size=VOCAB, lineage=b"x" * 16)
        )
        assert stranger.core.lineage not in (token, b"x" * 16)
        await eventually(lambda: len(srv.conns) == 1, what="only the stranger connected")
        (conn,) = srv.conns
        assert conn.core.gate.account is not owing
        assert conn.core.gate.account.owes(time.monotonic()) == 0.0
        await stranger.close()


@pytest.mark.asyncio
async def test_a_new_lineage_waits_its_turn_and_a_known_one_does_not():
    # An address starts new lineages at most --lineage-burst at once, then
    # --lineage-rate a second, in the order they asked; a connection presenting a
    # lineage the worker knows is answered at once.
    policy = PrincipalPolicy(lineage_rate=2.0, lineage_burst=1)
    async with _worker(WorkerConfig(vocab_size=VOCAB), policy=policy) as (srv, port):
        known = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
        token = known.core.lineage
        await known.open(0, seed=1, prefix=[1, 2])
        (await known.propose(0, round_id=0, depth=1)).release()
        await known.close_slot(0)  # abandons its draw: the address's births are paced
        await known.close()
        await eventually(lambda: not srv.conns, what="closed")
        await (await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))).close()
        loop = asyncio.get_running_loop()
        start = loop.time()
        newcomer = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
        waited = loop.time() - start
        assert 0.3 <= waited <= 2.0, waited  # the burst spent: one birth per 0.5 s
        await newcomer.close()
        start = loop.time()
        returning = await AsyncClient.connect(
            "127.0.0.1", port, SparkConfig(vocab_size=VOCAB, lineage=token)
        )
        assert loop.time() - start < 0.3
        await returning.close()


def test_births_go_in_arrival_order_at_the_rate():
    births = Births(rate=2.0, burst=2)
    births.spoil("a", 0.0)  # a lineage of "a" abandoned a draw: its births are paced
    assert births.ready_at("a", 1, 0.0) == 0.0  # the burst
    assert births.ready_at("a", 2, 0.0) == 0.0
    assert births.ready_at("a", 3, 0.0) == pytest.approx(0.5)  # first in line
    assert births.ready_at("a", 4, 0.0) == pytest.approx(1.0)  # behind it
    births.spoil("b", 0.0)
    assert births.ready_at("b", 5, 0.0) == 0.0  # another address has its own
    assert births.ready_at("a", 4, 0.6) == pytest.approx(1.0)  # 3 was born at 0.5 first
    assert births.ready_at("a", 3, 0.7) == 0.7  # ... and learns it when it asks
    births.cancel("a", 4)  # gave up: its place goes to the next
    assert births.ready_at("a", 6, 0.7) == pytest.approx(1.0)
    assert births.ready_at("a", 6, 1.0) == 1.0
    births.trim(100.0)
    assert len(births) == 0  # nothing waits, every birth earned back: forgotten
    with pytest.raises(ValueError, match="finite rate"):
        Births(rate=0.0)


def test_an_address_is_paced_only_while_its_lineages_abandon():
    # A sharded group or a test suite opening many connections at once is not slowed:
    # births are paced only for a window after a lineage of the address abandoned.
    births = Births(rate=2.0, burst=1, window=10.0)
    assert [births.ready_at("a", n, 0.0) for n in range(8)] == [0.0] * 8
    births.spoil("a", 1.0)
    assert births.ready_at("a", 8, 1.0) == 1.0  # the burst
    assert births.ready_at("a", 9, 1.0) == pytest.approx(1.5)
    assert births.ready_at("b", 10, 1.0) == 1.0  # another address is not paced
    assert births.ready_at("a", 9, 1.5) == 1.5
    assert births.ready_at("a", 11, 11.0) == 11.0  # the window has passed
    births.trim(11.0)
    assert len(births) == 0
    with pytest.raises(ValueError, match="window"):
        Births(window=-1.0)


# -- with keys: each key ID its own principal --------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("loop", ["reconnect", "reject"])
async def test_two_keys_are_two_principals_and_only_the_spender_is_refused(loop):
    # Before: one key for every holder, so under a key the principal was the source
    # address again and an attacker holding the key spent the client's budgets. Now the
    # key ID is the principal: the attacker's debt and cap are its own.
    config = WorkerConfig(vocab_size=VOCAB, keys=KEYS, abandon_rate=4.0, abandon_burst=1)
    policy = PrincipalPolicy(rate=20.0, rates={"client": None})
    client = SparkConfig(vocab_size=VOCAB, psk=CLIENT_KEY, key_id="client")
    attacker = Key(ATTACKER_KEY, "attacker")
    async with _worker(config, policy=policy) as (srv, port):
        if loop == "reconnect":
            got, refused, drawn, limited = await _beside_loop(
                port, reset_step_loop, client, 1.0, connections=1, slots=2, reconnect=True,
                key=attacker,
            )  # fmt: skip
            # The burst, then four a second, and the first draw of each slot.
            assert drawn <= 1 + 4.0 * 1.0 + 2 + 2, drawn
        else:
            got, refused, drawn, limited = await _beside_loop(
                port, commit_loop, client, 1.0, connections=2, slots=2, same_round=True,
                key=attacker,
            )  # fmt: skip
            # A loop whose COMMITs accept nothing abandons nothing: its cap holds it, a
            # second of it at once and then 20 a second.
            assert drawn <= 20 + 20 * 1.0 + 4, drawn
        assert limited >= 1
        principals = {c.principal for c in srv.conns}
        assert Principal.of_key("attacker") not in principals  # the loop is gone
    assert refused == 0, (got, refused)
    assert got >= 10, (got, refused)


@pytest.mark.asyncio
async def test_an_unknown_key_id_is_refused_as_a_wrong_key_is():
    # The worker answers an ID it does not hold with a CHALLENGE proved by a random
    # key: the Spark side finds the proof wrong, as it would for a wrong key, and
    # learns nothing of which IDs exist.
    async with _worker(WorkerConfig(vocab_size=VOCAB, keys=KEYS)) as (srv, port):
        for cfg in (
            SparkConfig(vocab_size=VOCAB, psk=CLIENT_KEY, key_id="nobody"),
            SparkConfig(vocab_size=VOCAB, psk=b"w" * 32, key_id="client"),
        ):
            with pytest.raises(RefusedError) as refused:
                await AsyncClient.connect("127.0.0.1", port, cfg)
            assert refused.value.code is ErrorCode.AUTH_FAILED
        ok = await AsyncClient.connect(
            "127.0.0.1", port, SparkConfig(vocab_size=VOCAB, psk=CLIENT_KEY, key_id="client")
        )
        await eventually(lambda: len(srv.conns) == 1, what="the refused connections closed")
        (conn,) = srv.conns
        assert conn.principal == Principal.of_key("client")
        assert ok.core.lineage == b""  # a keyed connection has no lineage
        await ok.close()


def test_the_cap_per_principal_counts_every_slot_and_holds_a_second_at_once():
    account = Account(WorkerConfig(vocab_size=VOCAB), 0.0, cap=4.0)
    lanes = [account.bind(0.0) for _ in range(8)]  # no per-slot rate: no lanes
    assert [account.allows(lane, 0.0) for lane in lanes] == [True] * 4 + [False] * 4
    assert account.owes(0.0) == pytest.approx(0.25)  # any slot: the next one in 1/4 s
    assert account.allows(None, 0.25)
    assert not account.settled(0.25)  # its bucket is still paying back
    policy = PrincipalPolicy(rate=4.0, rates={"client": None, "": 8.0})
    assert policy.cap(Principal.of_key("client")) is None
    assert policy.cap(Principal.of_key("")) == 8.0
    assert policy.cap(Principal.of_key("other")) == 4.0
    assert policy.cap(Principal.of_lineage(b"t" * 16)) == 4.0  # no key: the default
    with pytest.raises(ValueError, match="finite and above 0"):
        PrincipalPolicy(rate=0.0)


@pytest.mark.asyncio
async def test_a_keyless_attacker_with_many_lineages_gets_no_more_draw_threads():
    # Each keyless connection is a lineage of its own, but the lineages of one address
    # share the draw threads as one: this run's share rule is per address then.
    async with _worker(WorkerConfig(vocab_size=VOCAB), draw_threads=2) as (srv, port):
        links = [
            await asyncio.to_thread(open_link, port, VOCAB, 1, [1, 2], source="127.0.0.2")
            for _ in range(3)
        ]
        try:
            groups = {c.principal.group for c in srv.conns}
            assert groups == {"127.0.0.2"}
            assert len({c.principal for c in srv.conns}) == 3
            assert len({srv.draws._group(c.principal) for c in srv.conns}) == 1
        finally:
            for link in links:
                link.sock.close()


@pytest.mark.asyncio
async def test_pp1_spark_presents_its_lineage_when_it_reconnects():
    from pp1wire.apps.link import Link
    from pp1wire.apps.metrics import SparkMetrics

    async with _worker(WorkerConfig(vocab_size=VOCAB)) as (srv, port):
        link = Link("127.0.0.1", port, SparkConfig(vocab_size=VOCAB), SparkMetrics(1))
        await link.connect(5.0)
        (conn,) = srv.conns
        first = conn.principal
        conn.transport.abort()  # the connection is lost, the run goes on
        await eventually(lambda: link.current() is None, what="the link saw it go")
        assert await link.live() is not None
        await eventually(lambda: len(srv.conns) == 1, what="one connection")
        (conn,) = srv.conns
        assert conn.principal == first  # the same lineage: what it spent stays its own
        await link.close()


@pytest.mark.asyncio
async def test_a_lineage_born_while_its_address_is_paced_starts_with_one_free_abandon():
    # A loop's next lineage gets little: one free abandon, then what it earns; one born
    # while its address's lineages abandon nothing gets the whole burst, as before.
    async def abandon_two(client: AsyncClient, srv: WorkerServer):
        (conn,) = [c for c in srv.conns if c.principal.name == client.core.lineage.hex()]
        for slot in (0, 1):
            await client.open(slot, seed=slot + 1, prefix=[1, 2])
            (await client.propose(slot, round_id=0, depth=1)).release()
        for slot in (0, 1):
            await client.close_slot(slot)  # each closes a draw uncommitted
        await client.ping()  # answered after both CLOSEs: they are counted
        return conn.core.gate.account

    config = WorkerConfig(vocab_size=VOCAB, abandon_rate=0.01)  # burst 8, 100 s each
    async with _worker(config) as (srv, port):
        first = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
        assert not srv.births.paced("127.0.0.1", time.monotonic())
        account = await abandon_two(first, srv)
        assert account.owes(time.monotonic()) == 0.0  # two of its eight
        assert srv.births.paced("127.0.0.1", time.monotonic())
        paced = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=VOCAB))
        account = await abandon_two(paced, srv)
        assert account.owes(time.monotonic()) > 50  # one free, the second owes 100 s
        await first.close()
        await paced.close()
