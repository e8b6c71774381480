"""Waiting on a condition with a deadline, instead of sleeping and hoping."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable


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


def scrape_page(address: str) -> str:
    """The Prometheus text page served at ``address``."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return str(response.read().decode())


def scrape(address: str, name: str) -> float:
    """One unlabelled sample of a Prometheus page at ``address`` (0 if absent)."""
    for line in scrape_page(address).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
