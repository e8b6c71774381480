"""Waiting on a condition with a deadline, instead of sleeping and hoping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pp1wire.apps.metrics import scrape, scrape_page

__all__ = ["eventually", "scrape", "scrape_page", "wait_until"]


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
