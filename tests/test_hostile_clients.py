"""Hostile clients against an in-process worker: backpressure and work bounds per connection."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import pytest_asyncio

from pp1wire.aio.server import WRITE_BUFFER_CAP, WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.testing.attacks import never_reads, probe, rss_mib
from pp1wire.wire.worker_core import WorkerConfig

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
