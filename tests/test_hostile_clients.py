"""Hostile clients against an in-process worker: backpressure and work bounds per connection."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from pathlib import Path

import pytest
import pytest_asyncio

from pp1wire.aio.client import AsyncClient
from pp1wire.aio.server import WRITE_BUFFER_CAP, WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.errors import ErrorCode
from pp1wire.testing.attacks import never_reads, probe, rss_mib
from pp1wire.wire import framing
from pp1wire.wire.messages import MsgType, Ping
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
        await asyncio.sleep(1.0)
        # Replies beyond what the kernel's socket buffers (at most the send and
        # receive maxima) and the worker's write cap hold are never produced: the
        # worker stops reading the peer instead of queueing 1,000 replies.
        bound = (_sysctl_max("tcp_wmem") + _sysctl_max("tcp_rmem") + WRITE_BUFFER_CAP) // (
            REPLY_BYTES
        ) + 2
        answered = _count(srv.metrics.replays)
        assert 0 < answered <= bound, (answered, bound)
        (conn,) = srv.conns
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
    try:
        await asyncio.sleep(1.0)
        took = await asyncio.wait_for(probe(port, VOCAB), 10)
        assert took < PROBE_BOUND_S, took
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
    srv = WorkerServer(WorkerConfig(vocab_size=64), drafter_factory(64), max_connections=16)
    port = await srv.start("127.0.0.1", 0)
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    pingers = [asyncio.ensure_future(_ping_forever(port)) for _ in range(6)]
    # Authenticated, then idle with no slot.
    idle = [
        await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=64)) for _ in range(4)
    ]
    try:
        await eventually(lambda: len(srv.conns) == 16, what="16 connections held")
        await asyncio.sleep(1.2)  # past the idle threshold for eviction
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


@pytest.mark.asyncio
async def test_the_per_address_limit_refuses_the_next_connection():
    srv = WorkerServer(WorkerConfig(vocab_size=64), drafter_factory(64), max_per_address=2)
    port = await srv.start("127.0.0.1", 0)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(3.0)
        (frame,) = framing.FrameDecoder().feed(await asyncio.to_thread(extra.recv, 1 << 16))
        assert frame.message.code == ErrorCode.CONNECTION_LIMIT
        extra.close()
        assert len(srv.conns) == 2  # the newcomer evicted nobody
    finally:
        for s in held:
            s.close()
        await srv.stop(grace=1.0)
