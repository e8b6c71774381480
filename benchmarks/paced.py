"""Toy plugins with a fixed cost per call, standing in for a real target and drafter.

``target_factory``: the toy target, 5 ms per call (a forward pass, which scores one
prefix or a whole batch of them); ``drafter_factory``: the toy drafter, 0.5 ms per
call; ``slow_drafter_factory``: the toy drafter, 40 ms per call. Each call costs
exactly its fixed time (a sleep to a deadline, which releases the GIL as a call
into a GPU runtime would): the toy model's own arithmetic is done inside that
time, from rows cached per last token (a toy bigram depends on nothing else), so
it does not add to it. Used by ``benchmarks/speedup.py`` as ``--target
benchmarks.paced:target_factory`` and ``--drafter benchmarks.paced:drafter_factory``
(run from the repository root), and by ``benchmarks/run.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from pp1wire.apps.models import ToyLM

TARGET_SECONDS = 5e-3
DRAFTER_SECONDS = 0.5e-3
SLOW_DRAFTER_SECONDS = 40e-3

Row = npt.NDArray[np.float64]


class _Cached:
    """A toy model's rows by last token (read-only arrays: callers may not write them)."""

    def __init__(self, fn: Callable[[Sequence[int]], Row]) -> None:
        self.fn = fn
        self.rows: dict[int, Row] = {}

    def __call__(self, prefix: Sequence[int]) -> Row:
        last = int(prefix[-1]) if len(prefix) else -1
        row = self.rows.get(last)
        if row is None:
            row = self.fn(prefix)
            row.flags.writeable = False
            self.rows[last] = row
        return row


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _paced(fn: Callable[[Sequence[int]], Row], seconds: float) -> Callable[[Sequence[int]], Row]:
    cached = _Cached(fn)

    def call(prefix: Sequence[int]) -> Row:
        deadline = time.perf_counter() + seconds
        row = cached(prefix)
        _sleep_until(deadline)
        return row

    return call


class PacedTarget:
    """The toy target at 5 ms per call, per prefix or per batch of prefixes (one
    forward pass of an engine scores a whole batch)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        """The toy target of ``(vocab_size, seed)``."""
        self.model = _Cached(ToyLM(vocab_size, seed).probs)

    def __call__(self, prefix: Sequence[int]) -> Row:
        """One prefix: 5 ms."""
        deadline = time.perf_counter() + TARGET_SECONDS
        row = self.model(prefix)
        _sleep_until(deadline)
        return row

    def batch(self, prefixes: Sequence[Sequence[int]]) -> list[Row]:
        """Many prefixes: 5 ms for the batch."""
        deadline = time.perf_counter() + TARGET_SECONDS
        rows = [self.model(p) for p in prefixes]
        _sleep_until(deadline)
        return rows


def target_factory(vocab_size: int, seed: int = 0) -> PacedTarget:
    """The toy target's probabilities, at 5 ms per call (a batch is one call)."""
    return PacedTarget(vocab_size, seed)


def drafter_factory(vocab_size: int, seed: int = 0) -> Callable[[Sequence[int]], Row]:
    """The toy drafter's logits, at 0.5 ms per call."""
    return _paced(ToyLM(vocab_size, seed, draft=True).logits, DRAFTER_SECONDS)


def slow_drafter_factory(vocab_size: int, seed: int = 0) -> Callable[[Sequence[int]], Row]:
    """The toy drafter's logits at 40 ms per call: a depth-5 draw takes 200 ms
    (``benchmarks/run.py`` pings the worker while one runs)."""
    return _paced(ToyLM(vocab_size, seed, draft=True).logits, SLOW_DRAFTER_SECONDS)
