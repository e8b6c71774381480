"""Batching rounds into steps off the event loop: a TP group's attempts, or one process's.

Each slot's coroutine submits its round and awaits the decision. While the
group runs one attempt on its thread, later submissions queue; when it
finishes, everything queued (up to ``max_batch``) goes out as the next
attempt. Under load an attempt therefore carries every ready slot, so the
collectives' latency is paid once per batch and the ranks evaluate their
requests at the same time; with one slot ready it costs what a single round does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from pp1wire.errors import VerifyError
from pp1wire.q.verify import RoundResult, TargetFn, batched, verify_batch
from pp1wire.tp.fanout import Item

_T = TypeVar("_T")
_D = TypeVar("_D")


class Leader(Protocol[_D]):
    """What the batcher drives (:class:`pp1wire.tp.group.SparkGroup` on rank 0)."""

    max_batch: int

    def lead(self, items: Sequence[Item]) -> list[_D]:
        """Decide the items as one attempt."""


class Batcher:
    """Submit rounds from many coroutines; they go to the group in batches, in order."""

    def __init__(self, leader: Leader[_D]) -> None:
        """Batch for ``leader`` on a thread of its own (collectives block)."""
        self.leader = leader
        self._thread = ThreadPoolExecutor(1, "pp1-tp")
        self._queue: list[tuple[Item, asyncio.Future[object]]] = []
        self._busy = False
        self._kick = False
        self._idle: list[asyncio.Future[None]] = []  # callers waiting for no step in flight

    async def submit(self, item: Item) -> object:
        """The decision for ``item`` (the leader's result type).

        Raises:
            whatever the leader's attempt raised, on every item of that attempt.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        self._queue.append((item, fut))
        self._soon(loop)
        return await fut

    async def call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the group's thread after every attempt submitted so far."""
        loop = asyncio.get_running_loop()
        while self._busy or self._queue:
            idle: asyncio.Future[None] = loop.create_future()
            self._idle.append(idle)
            await idle
        return await loop.run_in_executor(self._thread, fn)

    def _soon(self, loop: asyncio.AbstractEventLoop) -> None:
        # Not at once: the coroutines woken in this loop turn (by the last step's
        # results) submit first, so they go out together instead of one and then the rest.
        if not self._kick:
            self._kick = True
            loop.call_soon(self._next)

    def _next(self) -> None:
        self._kick = False
        if self._busy or not self._queue:
            if not self._busy:
                idle, self._idle = self._idle, []
                for fut in idle:
                    if not fut.done():
                        fut.set_result(None)
            return
        batch: list[tuple[Item, asyncio.Future[object]]] = []
        rest: list[tuple[Item, asyncio.Future[object]]] = []
        seen: set[int] = set()
        for entry in self._queue:  # distinct requests, at most max_batch, in order
            if len(batch) < self.leader.max_batch and entry[0].request not in seen:
                seen.add(entry[0].request)
                batch.append(entry)
            else:
                rest.append(entry)
        self._queue = rest
        self._busy = True
        loop = asyncio.get_running_loop()
        items = [item for item, _ in batch]
        done = loop.run_in_executor(self._thread, self.leader.lead, items)
        done.add_done_callback(lambda f: self._settle(batch, f))

    def _settle(
        self, batch: list[tuple[Item, asyncio.Future[object]]], done: asyncio.Future[list[_D]]
    ) -> None:
        self._busy = False
        exc = done.exception()
        for k, (_, fut) in enumerate(batch):
            if fut.done():
                continue
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(done.result()[k])
        self._soon(asyncio.get_running_loop())

    def close(self) -> None:
        """Stop the thread (after the last call)."""
        self._thread.shutdown(wait=False)


class LocalStep:
    """One engine step in this process: the queued rounds of distinct requests,
    every draft position and bonus scored by one call of the target's batched
    form (:func:`pp1wire.q.verify.batched`), then verified as one rank does."""

    def __init__(self, target: TargetFn, max_batch: int) -> None:
        """A step over at most ``max_batch`` rounds."""
        self.target = batched(target)
        self.max_batch = max_batch

    def lead(self, items: Sequence[Item]) -> list[RoundResult | VerifyError]:
        """Decide ``items`` (see :func:`pp1wire.q.verify.verify_batch`); never raises."""
        return verify_batch([(i.verifier, i.proposal, i.round_id) for i in items], self.target)
