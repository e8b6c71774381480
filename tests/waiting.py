"""Waiting on a condition with a deadline, instead of sleeping and hoping; a drafter
that waits for the test to let it go on, so that a test checks an order of events."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from pp1wire.apps.metrics import scrape, scrape_page
from pp1wire.apps.models import drafter_factory

__all__ = ["GatedDrafter", "eventually", "scrape", "scrape_page", "wait_until"]


async def eventually(cond: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    """Poll ``cond`` on the running loop until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or cond}")
        await asyncio.sleep(0.002)


def wait_until(cond: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``cond`` (blocking) until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or cond}")
        time.sleep(0.01)


class GatedDrafter:
    """The toy drafter over ``vocab`` tokens, whose first call waits for :attr:`gate`
    (at most 30 s); records whose prefix each call drew (the prompt's last token, as
    every draw the tests make with it is depth 1)."""

    def __init__(self, vocab: int) -> None:
        self.fast = drafter_factory(vocab, 0)
        self.started = threading.Event()
        self.gate = threading.Event()
        self.order: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, prefix):
        with self.lock:
            first = not self.order
            self.order.append(prefix[-1])
        if first:
            self.started.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self.fast(prefix)
