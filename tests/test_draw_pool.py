"""Draws off the event loop: a slow drafter on one slot stalls nothing else.

The drafter is deterministic: 200 ms (a sleep, which like a real model's
numpy or torch work lets other threads run) when the prefix ends with the
marker token, immediate otherwise. While slot 0 of connection A is being
drawn, a PING on A and a STEP on connection B must be answered within
PROMPT_S = 100 ms: half the slow draw, so an answer that waited for it cannot
pass, and some twenty times a loopback round trip plus a fast draw on a
loaded 2-core machine. With draws on the event loop (``draw_threads=0``) the
same measurement is at least the 200 ms draw: the test fails there, and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time

import pytest

from pp1wire.aio.client import AsyncClient
from pp1wire.aio.server import WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.wire.spark_core import SparkConfig
from pp1wire.wire.worker_core import WorkerConfig

VOCAB = 64
MARKER = 7
SLOW_S = 0.2
PROMPT_S = 0.1


def slow_drafter(started: threading.Event):
    fast = drafter_factory(VOCAB, 0)

    def drafter(prefix):
        if prefix[-1] == MARKER:
            started.set()
            time.sleep(SLOW_S)
        return fast(prefix)

    return drafter


@contextlib.contextmanager
def worker_thread(draw_threads: int, started: threading.Event):
    """A WorkerServer on an event loop of its own thread (so a stalled worker loop
    cannot stall the measuring clients); yields its port."""
    ready: queue.Queue[int] = queue.Queue()
    done = threading.Event()

    async def serve() -> None:
        srv = WorkerServer(
            WorkerConfig(vocab_size=VOCAB), slow_drafter(started), draw_threads=draw_threads
        )
        ready.put(await srv.start("127.0.0.1", 0))
        await asyncio.to_thread(done.wait)
        await srv.stop(grace=1.0)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield ready.get(timeout=10)
    finally:
        done.set()
        thread.join(10)


async def measure(draw_threads: int) -> tuple[float, float, float]:
    started_drawing = threading.Event()
    with worker_thread(draw_threads, started_drawing) as port:
        config = SparkConfig(vocab_size=VOCAB, max_slots=2, max_depth=1)
        a = await AsyncClient.connect("127.0.0.1", port, config)
        b = await AsyncClient.connect("127.0.0.1", port, config)
        try:
            await a.open(0, seed=1, prefix=[1, MARKER])  # every draw on A's slot 0 is slow
            await b.open(0, seed=2, prefix=[1, 2])
            started = time.perf_counter()
            slow = asyncio.ensure_future(a.propose(0, round_id=a.next_round(0), depth=1))
            assert await asyncio.to_thread(started_drawing.wait, 5)  # A's slow draw runs
            ping = await a.ping()
            t = time.perf_counter()
            await b.propose(0, round_id=b.next_round(0), depth=1)
            other = time.perf_counter() - t
            await slow
            return ping, other, time.perf_counter() - started
        finally:
            await a.close()
            await b.close()


@pytest.mark.asyncio
async def test_a_slow_draw_stalls_neither_a_ping_on_its_connection_nor_another_connection():
    ping, other, slow = await measure(draw_threads=2)
    assert slow >= SLOW_S  # the slow draw really ran while we measured
    assert ping < PROMPT_S, ping
    assert other < PROMPT_S, other


@pytest.mark.asyncio
async def test_on_the_event_loop_the_same_draw_stalls_both():
    # The contrast that shows the measurement above can fail.
    ping, other, _ = await measure(draw_threads=0)
    # The PING waits for what is left of the draw (it started 20 ms in).
    assert ping >= SLOW_S - 0.03, (ping, other)
