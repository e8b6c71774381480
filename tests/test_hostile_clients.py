"""Hostile clients against an in-process worker: backpressure and work bounds per connection."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
from pathlib import Path

import pytest
import pytest_asyncio

from pp1wire.aio.client import AsyncClient, ConnectionLostError, RefusedError
from pp1wire.aio.server import WRITE_BUFFER_CAP, WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.errors import ErrorCode
from pp1wire.testing.attacks import never_reads, probe, rss_mib
from pp1wire.testing.builders import open_message, token_bytes
from pp1wire.testing.conformance.spark_side import shut
from pp1wire.wire import framing
from pp1wire.wire.messages import Error, MsgType, Opened, Ping
from pp1wire.wire.spark_core import SparkConfig
from pp1wire.wire.worker_core import WorkerConfig

from .waiting import eventually

VOCAB = 32_768
#: One dense depth-5 reply: five 128 KiB rows plus small headers.
REPLY_BYTES = 5 * 4 * VOCAB
#: A legitimate client's handshake + OPEN + one round takes tens of milliseconds
#: here; 2 s leaves room for a loaded 2-core machine while the attacker's
#: 1,000 STEPs, drawn or replayed in one go, stalled the loop for seconds.
PROBE_BOUND_S = 2.0


def _sysctl_max(name: str) -> int:
    return int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])


def _count(counter, **labels) -> float:
    return (counter.labels(**labels) if labels else counter)._value.get()


@pytest_asyncio.fixture
async def server():
    srv = WorkerServer(WorkerConfig(vocab_size=VOCAB), drafter_factory(VOCAB))
    port = await srv.start("127.0.0.1", 0)
    yield srv, port
    await srv.stop(grace=1.0)


@pytest.mark.asyncio
async def test_replayed_steps_from_a_peer_that_never_reads_stop_at_the_write_cap(server):
    srv, port = server
    sock = await asyncio.to_thread(never_reads, port, VOCAB, 1000, same_round=True)
    try:
        (conn,) = srv.conns
        await eventually(lambda: conn.writing_paused, what="the worker stops at its write cap")
        # Replies beyond what the kernel's socket buffers (at most the send and
        # receive maxima) and the worker's write cap hold are never produced: the
        # worker stops reading the peer instead of queueing 1,000 replies.
        bound = (_sysctl_max("tcp_wmem") + _sysctl_max("tcp_rmem") + WRITE_BUFFER_CAP) // (
            REPLY_BYTES
        ) + 2
        answered = _count(srv.metrics.replays)
        assert 0 < answered <= bound, (answered, bound)
        assert conn.transport.get_write_buffer_size() <= WRITE_BUFFER_CAP + REPLY_BYTES
        took = await asyncio.wait_for(probe(port, VOCAB), 10)
        assert took < PROBE_BOUND_S, took
    finally:
        sock.close()


@pytest.mark.asyncio
async def test_distinct_rounds_from_a_peer_that_never_reads_are_refused_not_drawn(server):
    srv, port = server
    before = rss_mib(os.getpid())
    sock = await asyncio.to_thread(never_reads, port, VOCAB, 1000)

    def refused() -> float:
        return _count(srv.metrics.refusals, code="step_uncommitted")

    try:
        await eventually(refused, what="the flood is being answered")
        took = await asyncio.wait_for(probe(port, VOCAB), 10)
        assert took < PROBE_BOUND_S, took
        await eventually(lambda: refused() >= 999, what="every uncommitted STEP answered")
        # One fresh draw for the attacker and one for the probe; every other STEP
        # is refused with a small ERROR.
        assert _count(srv.metrics.steps) == 2
        assert _count(srv.metrics.refusals, code="step_uncommitted") == 999
        # docs/protocol.md §8 bounds a connection by its negotiated limits (here
        # about 3 MiB); 64 MiB of slack covers allocator noise and the probe,
        # while drawing all 1,000 rounds would hold 650 MB of replies.
        grown = rss_mib(os.getpid()) - before
        assert grown < 64, grown
    finally:
        sock.close()


async def _ping_forever(port: int) -> None:
    """A peer that never says HELLO and PINGs every 100 ms (PING is allowed before HELLO)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for n in itertools.count():
            writer.write(framing.encode_frame(Ping(nonce=n)))
            await asyncio.sleep(0.1)
            if reader.at_eof():
                return
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_idle_and_ping_only_peers_cannot_lock_out_an_authenticated_one():
    # The authenticated peers each drew once (protected for the slot idle timeout,
    # far beyond the test), so the newcomer can only take a place still in its handshake.
    srv = WorkerServer(
        WorkerConfig(vocab_size=64),
        drafter_factory(64),
        max_connections=16,
        slot_idle_timeout=3600.0,
    )
    port = await srv.start("127.0.0.1", 0)
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    pingers = [asyncio.ensure_future(_ping_forever(port)) for _ in range(6)]
    # Authenticated, one proposal drawn, then idle.
    idle = [
        await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=64)) for _ in range(4)
    ]
    try:
        for c in idle:
            await c.open(0, seed=1, prefix=[1, 2])
            (await c.propose(0, round_id=c.next_round(0), depth=1)).release()
        await eventually(lambda: len(srv.conns) == 16, what="16 connections held")
        took = await asyncio.wait_for(probe(port, 64), 10)
        assert took < PROBE_BOUND_S, took
        assert _count(srv.metrics.evictions) >= 1
        # The oldest peer still in its handshake went first.
        silent[0].settimeout(3.0)
        assert silent[0].recv(1 << 16)[3] == MsgType.ERROR
    finally:
        for s in silent:
            s.close()
        for t in pingers:
            t.cancel()
        for c in idle:
            await c.close()
        await srv.stop(grace=1.0)


class Relay:
    """A man in the middle on loopback: forwards a real handshake, then tampers or injects."""

    def __init__(self, worker_port: int, tamper=None) -> None:
        self.worker_port = worker_port
        self.tamper = tamper or (lambda data: data)
        self.from_worker = bytearray()
        self.to_worker: asyncio.StreamWriter | None = None
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await shut(self.server, self.tasks, [w.close for w in self.writers])

    async def _handle(self, client_r, client_w) -> None:
        self.tasks.append(asyncio.current_task())
        worker_r, worker_w = await asyncio.open_connection("127.0.0.1", self.worker_port)
        self.to_worker = worker_w
        self.writers += [client_w, worker_w]

        async def pipe(src, dst, change, log) -> None:
            while data := await src.read(1 << 16):
                if log is not None:
                    log += data
                dst.write(change(data))
            dst.close()

        await asyncio.gather(
            pipe(client_r, worker_w, self.tamper, None),
            pipe(worker_r, client_w, lambda d: d, self.from_worker),
            return_exceptions=True,
        )

    def worker_frames(self) -> list[framing.Frame]:
        return framing.FrameDecoder(1 << 24).feed(bytes(self.from_worker))


PSK = b"a relay never learns this key"


def _flip_open_payload(data: bytes) -> bytes:
    # The Spark side writes each OPEN in one piece: preamble, header, tokens, tag.
    if data[:2] == framing.MAGIC and data[3] == MsgType.OPEN:
        changed = bytearray(data)
        changed[-framing.TAG_SIZE - 1] ^= 0x01  # a token, not the tag
        return bytes(changed)
    return data


@pytest.mark.asyncio
async def test_a_frame_changed_by_a_relay_after_a_keyed_handshake_is_refused():
    srv = WorkerServer(WorkerConfig(vocab_size=64, psk=PSK), drafter_factory(64))
    port = await srv.start("127.0.0.1", 0)
    relay = Relay(port, tamper=_flip_open_payload)
    try:
        client = await AsyncClient.connect(
            "127.0.0.1", await relay.start(), SparkConfig(vocab_size=64, psk=PSK)
        )
        with pytest.raises(ConnectionLostError):
            await client.open(0, seed=1, prefix=[1, 2, 3])
        assert client.failed is ErrorCode.INTEGRITY_FAILED
        assert _count(srv.metrics.refusals, code="integrity_failed") == 1
        assert all(f.type is not MsgType.OPENED for f in relay.worker_frames())
    finally:
        await relay.stop()
        await srv.stop(grace=1.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("psk", [PSK, None], ids=["keyed", "no-key"])
async def test_a_relay_cannot_drive_a_connection_it_forwarded_the_handshake_of(psk):
    srv = WorkerServer(WorkerConfig(vocab_size=64, psk=psk), drafter_factory(64))
    port = await srv.start("127.0.0.1", 0)
    relay = Relay(port)
    try:
        client = await AsyncClient.connect(
            "127.0.0.1", await relay.start(), SparkConfig(vocab_size=64, psk=psk)
        )
        session = client.session
        assert relay.to_worker is not None
        relay.to_worker.write(
            framing.encode_frame(open_message(session, 1, [1, 2]), token_bytes([1, 2]))
        )

        def after_hello() -> list:
            frames = [f.message for f in relay.worker_frames()]
            return frames[[type(m).__name__ for m in frames].index("Hello") + 1 :]

        await eventually(after_hello, what="the worker answers the relay")
        got = after_hello()
        if psk is None:
            # Without a key nothing after the handshake is authenticated: the
            # relay's OPEN is served. This is what frame integrity closes.
            assert isinstance(got[0], Opened)
        else:
            assert isinstance(got[0], Error)
            assert got[0].code == ErrorCode.INTEGRITY_FAILED
            assert not any(isinstance(m, Opened) for m in got)
        await client.close()
    finally:
        await relay.stop()
        await srv.stop(grace=1.0)


#: The abandon budget of the read-hold tests: `BUDGET_BURST` draws free, then one
#: per 1 / `BUDGET_RATE` seconds; each test watches `BUDGET_WINDOW_S` seconds of attack.
BUDGET_RATE, BUDGET_BURST, BUDGET_WINDOW_S = 4.0, 1, 1.0


@contextlib.asynccontextmanager
async def _budgeted_server():
    config = WorkerConfig(vocab_size=256, abandon_rate=BUDGET_RATE, abandon_burst=BUDGET_BURST)
    srv = WorkerServer(config, drafter_factory(256))
    port = await srv.start("127.0.0.1", 0)
    try:
        yield srv, port
    finally:
        await srv.stop(grace=1.0)


def _assert_paced_by_budget(drawn: int, refused: int, elapsed: float) -> None:
    """The budget's own arithmetic: `BUDGET_BURST` draws free, then one per payback
    period, each period ending in at most one refusal (+2: the periods cut by the
    start and the end of the run); draws resume after each hold."""
    periods = BUDGET_BURST + BUDGET_RATE * elapsed
    assert 2 <= drawn <= periods + 1, (drawn, elapsed)
    assert 1 <= refused <= periods + 2, (refused, elapsed)


@pytest.mark.asyncio
async def test_a_refused_reset_step_loop_is_read_at_the_budgets_pace_not_the_peers():
    # Before: every STEP beyond the draw budget was read, refused and answered at
    # once, so the loop cost the worker ~12,000 refusals a second (a legitimate
    # round took 2-3x longer on 2 cores). Now a refusal holds the connection until
    # its budget allows a draw: at most one refusal per payback period.
    import threading
    import time

    from pp1wire.testing.attacks import reset_step_loop

    running, stop = threading.Event(), threading.Event()
    running.set()
    async with _budgeted_server() as (srv, port):
        try:
            attack = asyncio.create_task(
                asyncio.to_thread(
                    reset_step_loop, port, 256, connections=1, slots=1, running=running, stop=stop
                )
            )
            start = time.monotonic()
            await eventually(
                lambda: _count(srv.metrics.refusals, code="draw_rate_limited") >= 1,
                what="the budget refusing the loop",
            )
            await asyncio.sleep(BUDGET_WINDOW_S)  # the measured window
            stop.set()
            drawn, refused = await asyncio.wait_for(attack, 10)
            elapsed = time.monotonic() - start
        finally:
            stop.set()
    _assert_paced_by_budget(drawn, refused, elapsed)


def _reset_step_pairs(session: int, pairs: int, prefix: list[int], copies: int = 1) -> bytes:
    """``pairs`` RESET/STEP pairs for slot 0 (the first STEP without its RESET), each
    STEP sent ``copies`` times."""
    from pp1wire.q.proposal import prefix_digest
    from pp1wire.wire.messages import Reset, Step

    out = []
    for generation in range(pairs):
        if generation:
            out.append(framing.encode_frame(Reset(session=session, slot=0, generation=generation)))
        step = Step(
            session=session,
            slot=0,
            generation=generation,
            round=0,
            position=len(prefix),
            digest=prefix_digest(prefix),
            depth=1,
            temperature=1.0,
            support=0,
            context=0,
        )
        out += [framing.encode_frame(step)] * copies
    return b"".join(out)


def _pipelined_reset_step_pairs(port: int, vocab: int, pairs: int, seconds: float):
    """Open slot 0, write ``pairs`` RESET/STEP pairs in one go, then read for
    ``seconds``; returns the STEPs drawn, those refused and the seconds read."""
    import time

    from pp1wire.testing.attacks import open_link

    prefix = [1, 2, 3]
    sock, session, _ = open_link(port, vocab, 1, prefix)
    decoder = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
    drawn = refused = 0
    try:
        start = time.monotonic()
        sock.sendall(_reset_step_pairs(session, pairs, prefix))
        while (left := start + seconds - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                break
            if not data:
                break
            for frame in decoder.feed(data):
                if frame.type is MsgType.COMPLETION:
                    drawn += 1
                elif isinstance(frame.message, Error) and frame.message.answers == MsgType.STEP:
                    refused += 1
        return drawn, refused, time.monotonic() - start
    finally:
        sock.close()


@pytest.mark.asyncio
async def test_reset_step_pairs_pipelined_in_one_write_are_refused_once_per_payback_period():
    # Before: the frames already buffered after a refusal were still handled in the
    # same turn (up to 64), so one write of RESET/STEP pairs got ~30 refusals at once
    # and then ~30 per payback period, not one.
    async with _budgeted_server() as (_, port):
        drawn, refused, elapsed = await asyncio.wait_for(
            asyncio.to_thread(_pipelined_reset_step_pairs, port, 256, 500, BUDGET_WINDOW_S), 30
        )
    _assert_paced_by_budget(drawn, refused, elapsed)


@pytest.mark.asyncio
async def test_a_hold_timer_that_fires_early_holds_on_for_the_rest_of_the_period():
    # uvloop rounds call_later to whole milliseconds and may fire it up to ~0.5 ms
    # early. The early timer must not let the core refuse the next STEP (here the
    # refused one, sent twice) again in the same payback period.
    from pp1wire.testing.attacks import open_link

    config = WorkerConfig(vocab_size=256, abandon_rate=0.5, abandon_burst=1)
    srv = WorkerServer(config, drafter_factory(256))
    port = await srv.start("127.0.0.1", 0)
    sock, session, _ = await asyncio.to_thread(open_link, port, 256, 1, [1, 2, 3])
    try:
        (conn,) = srv.conns
        await asyncio.to_thread(sock.sendall, _reset_step_pairs(session, 20, [1, 2, 3], copies=2))
        await eventually(lambda: conn.held, what="the connection held after a refusal")
        refused = _count(srv.metrics.refusals, code="draw_rate_limited")
        assert refused == 1
        conn.turn.cancel()
        conn._end_hold()  # the timer, fired ~2 s early: it pumps at once, synchronously
        assert conn.held
        assert conn.turn is not None
        assert _count(srv.metrics.refusals, code="draw_rate_limited") == refused
    finally:
        sock.close()
        await srv.stop(grace=1.0)


class _OneLinkGroup:
    """A group rank that lets one link join and refuses every later one."""

    def __init__(self) -> None:
        self.joined: list[object] = []
        self.left: list[object] = []

    def join(self, link, group: bytes) -> bool:
        self.joined.append(link)
        return len(self.joined) == 1

    def submit(self, link, job, done) -> None:
        raise AssertionError("no STEP is sent")

    def leave(self, link) -> None:
        self.left.append(link)


@pytest.mark.asyncio
async def test_a_link_refused_group_in_use_evicts_nobody_to_make_room_for_itself():
    # Before: a newcomer admitted on credit evicted the idle peer it was admitted
    # for, and only then was refused GROUP_IN_USE: the peer was lost for nothing.
    group = _OneLinkGroup()
    srv = WorkerServer(
        WorkerConfig(vocab_size=64),
        drafter_factory(64),
        max_connections=1,
        handshake_grace=0.0,
        group=group,
    )
    port = await srv.start("127.0.0.1", 0)
    config = SparkConfig(vocab_size=64)
    held = await AsyncClient.connect("127.0.0.1", port, config)
    try:

        async def newcomer() -> None:
            client = await AsyncClient.connect("127.0.0.1", port, config, timeout=5.0)
            await asyncio.wait_for(client.ping(), 5)  # the refusal may come after the handshake

        with pytest.raises((RefusedError, ConnectionLostError), match="GROUP_IN_USE"):
            await newcomer()
        await asyncio.wait_for(held.ping(), 5)
        assert _count(srv.metrics.evictions) == 0
        await eventually(lambda: len(group.left) == 1, what="the refused link leaves its group")
    finally:
        await held.close()
        await srv.stop(grace=1.0)
