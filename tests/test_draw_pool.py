"""Draws off the event loop: a slow drafter on one slot stalls nothing else.

The drafter's draw for slot 0 of connection A (whose prompt ends with the
marker token) does not return until the test opens a gate. With draws on a
pool, a PING on A and a STEP on connection B are answered while that draw is
still held: the test opens the gate only after both answers came, so a worker
that made them wait for the draw could never pass (it would time out). With
draws on the event loop (``draw_threads=0``) the same PING can only be
answered after the held draw's reply: the contrast, shown by the order in
which the two answers arrive. Nothing here is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading

import pytest

from pp1wire.aio.client import AsyncClient
from pp1wire.aio.server import WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.wire.spark_core import SparkConfig
from pp1wire.wire.worker_core import WorkerConfig

VOCAB = 64
MARKER = 7
#: Only a hung test waits this long: the gate is normally opened within milliseconds.
GIVE_UP_S = 30.0


class Gate:
    """The marker draw signals :attr:`started`, then waits for :attr:`open`."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.open = threading.Event()

    def drafter(self):
        fast = drafter_factory(VOCAB, 0)

        def draft(prefix):
            if prefix[-1] == MARKER:
                self.started.set()
                assert self.open.wait(GIVE_UP_S), "the gate was never opened"
            return fast(prefix)

        return draft


@contextlib.contextmanager
def worker_thread(draw_threads: int, gate: Gate):
    """A WorkerServer on an event loop of its own thread (so a stalled worker loop
    cannot stall the measuring clients); yields its port."""
    ready: queue.Queue[int] = queue.Queue()
    done = threading.Event()

    async def serve() -> None:
        config = WorkerConfig(vocab_size=VOCAB)
        srv = WorkerServer(config, gate.drafter(), draw_threads=draw_threads)
        ready.put(await srv.start("127.0.0.1", 0))
        await asyncio.to_thread(done.wait)
        await srv.stop(grace=1.0)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield ready.get(timeout=10)
    finally:
        gate.open.set()
        done.set()
        thread.join(10)


@contextlib.asynccontextmanager
async def two_clients(port: int):
    config = SparkConfig(vocab_size=VOCAB, max_slots=2, max_depth=1)
    a = await AsyncClient.connect("127.0.0.1", port, config)
    b = await AsyncClient.connect("127.0.0.1", port, config)
    try:
        await a.open(0, seed=1, prefix=[1, MARKER])  # every draw on A's slot 0 is held
        await b.open(0, seed=2, prefix=[1, 2])
        yield a, b
    finally:
        await a.close()
        await b.close()


@pytest.mark.asyncio
async def test_a_held_draw_stalls_neither_a_ping_on_its_connection_nor_another_connection():
    gate = Gate()
    with worker_thread(2, gate) as port:
        async with two_clients(port) as (a, b):
            slow = asyncio.ensure_future(a.propose(0, round_id=a.next_round(0), depth=1))
            assert await asyncio.to_thread(gate.started.wait, GIVE_UP_S)
            await asyncio.wait_for(a.ping(), GIVE_UP_S)
            await asyncio.wait_for(b.propose(0, round_id=b.next_round(0), depth=1), GIVE_UP_S)
            assert not slow.done()  # both answered while A's draw was still held
            gate.open.set()
            assert len((await slow).rows) == 1


@pytest.mark.asyncio
async def test_on_the_event_loop_the_held_draw_comes_before_the_ping():
    # The contrast that shows the test above can fail: the loop is inside the
    # drafter, so the PING (sent once the draw is held) is read only after it.
    gate = Gate()
    with worker_thread(0, gate) as port:
        async with two_clients(port) as (a, _):
            order: list[str] = []
            slow = asyncio.ensure_future(a.propose(0, round_id=a.next_round(0), depth=1))
            slow.add_done_callback(lambda _: order.append("proposal"))
            assert await asyncio.to_thread(gate.started.wait, GIVE_UP_S)
            ping = asyncio.ensure_future(a.ping())
            ping.add_done_callback(lambda _: order.append("pong"))
            await asyncio.sleep(0)  # the PING is written before the gate opens
            gate.open.set()
            await asyncio.wait_for(asyncio.gather(slow, ping), GIVE_UP_S)
            assert order == ["proposal", "pong"]
