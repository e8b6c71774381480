"""Plugins with a fixed cost per call, for ``benchmarks/adaptive.py``.

``target_factory``: the toy target at a fixed cost per call, a batch of prefixes
being one call (an engine's forward pass): ``PP1_BENCH_TARGET_MS`` ms (default
20). ``drafter_factory``: the toy drafter at ``PP1_BENCH_DRAFT_MS`` ms per call
(default 2), per prefix or, through its ``batch`` method, per batch of prefixes.
Each call sleeps to a deadline (releasing the GIL, as a call into a GPU runtime
would), the toy model's arithmetic done inside that time from rows cached per
last token (a toy bigram depends on nothing else). ``ngram_target_factory`` and
``ngram_drafter_factory``: the n-gram pair (:mod:`pp1wire.apps.ngram`) at the
same costs, its rows computed inside each call's time. The costs are read from
the environment when a factory runs, so a benchmark sets them for both daemons.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from pp1wire.apps import ngram
from pp1wire.apps.models import ToyLM

Row = npt.NDArray[np.float64]


def _seconds(name: str, default_ms: float) -> float:
    return float(os.environ.get(name, default_ms)) / 1e3


class _Paced:
    """A toy model's rows by last token, each call (or batch) costing ``seconds``."""

    def __init__(self, fn: Callable[[Sequence[int]], Row], seconds: float) -> None:
        self.fn = fn
        self.seconds = seconds
        self.rows: dict[int, Row] = {}

    def _row(self, prefix: Sequence[int]) -> Row:
        last = int(prefix[-1]) if len(prefix) else -1
        row = self.rows.get(last)
        if row is None:
            row = self.fn(prefix)
            row.flags.writeable = False
            self.rows[last] = row
        return row

    def _wait(self, deadline: float) -> None:
        left = deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def __call__(self, prefix: Sequence[int]) -> Row:
        """One prefix: one call."""
        deadline = time.perf_counter() + self.seconds
        row = self._row(prefix)
        self._wait(deadline)
        return row

    def batch(self, prefixes: Sequence[Sequence[int]]) -> list[Row]:
        """Many prefixes: one call."""
        deadline = time.perf_counter() + self.seconds
        rows = [self._row(p) for p in prefixes]
        self._wait(deadline)
        return rows


def target_factory(vocab_size: int, seed: int = 0) -> _Paced:
    """The toy target's probabilities at ``PP1_BENCH_TARGET_MS`` (20) ms per call."""
    return _Paced(ToyLM(vocab_size, seed).probs, _seconds("PP1_BENCH_TARGET_MS", 20.0))


def drafter_factory(vocab_size: int, seed: int = 0) -> _Paced:
    """The toy drafter's logits at ``PP1_BENCH_DRAFT_MS`` (2) ms per call."""
    return _Paced(ToyLM(vocab_size, seed, draft=True).logits, _seconds("PP1_BENCH_DRAFT_MS", 2.0))


def ngram_target_factory(vocab_size: int, seed: int = 0) -> ngram.PacedModelFn:
    """The n-gram target's probabilities at ``PP1_BENCH_TARGET_MS`` (20) ms per call."""
    model = ngram.target_factory(vocab_size, seed)
    return ngram.PacedModelFn(model, _seconds("PP1_BENCH_TARGET_MS", 20.0))


def ngram_drafter_factory(vocab_size: int, seed: int = 0) -> ngram.PacedModelFn:
    """The n-gram drafter's logits at ``PP1_BENCH_DRAFT_MS`` (2) ms per call."""
    model = ngram.drafter_factory(vocab_size, seed)
    return ngram.PacedModelFn(model, _seconds("PP1_BENCH_DRAFT_MS", 2.0))
