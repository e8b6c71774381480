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
the environment when a factory runs, so a benchmark sets them for both daemons;
one that is not a duration in 0..60,000 ms is refused with ValueError
(:func:`pp1wire.apps.paced.pace_seconds`), and the pacing is
:class:`pp1wire.apps.paced.PacedModelFn`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from pp1wire.apps import ngram
from pp1wire.apps.models import ToyLM
from pp1wire.apps.paced import PacedModelFn, pace_seconds

Row = npt.NDArray[np.float64]
TARGET_MS_ENV = "PP1_BENCH_TARGET_MS"
DRAFT_MS_ENV = "PP1_BENCH_DRAFT_MS"


class _ByLastToken:
    """A toy model's rows cached by last token (a toy bigram depends on nothing else)."""

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

    def batch(self, prefixes: Sequence[Sequence[int]]) -> list[Row]:
        return [self(p) for p in prefixes]


def target_factory(vocab_size: int, seed: int = 0) -> PacedModelFn[list[Row]]:
    """The toy target's probabilities at ``PP1_BENCH_TARGET_MS`` (20) ms per call."""
    rows = _ByLastToken(ToyLM(vocab_size, seed).probs)
    return PacedModelFn(rows, pace_seconds(TARGET_MS_ENV, 20.0))


def drafter_factory(vocab_size: int, seed: int = 0) -> PacedModelFn[list[Row]]:
    """The toy drafter's logits at ``PP1_BENCH_DRAFT_MS`` (2) ms per call."""
    rows = _ByLastToken(ToyLM(vocab_size, seed, draft=True).logits)
    return PacedModelFn(rows, pace_seconds(DRAFT_MS_ENV, 2.0))


def ngram_target_factory(
    vocab_size: int, seed: int = 0
) -> PacedModelFn[npt.NDArray[np.floating]]:
    """The n-gram target's probabilities at ``PP1_BENCH_TARGET_MS`` (20) ms per call."""
    model = ngram.target_factory(vocab_size, seed)
    return PacedModelFn(model, pace_seconds(TARGET_MS_ENV, 20.0))


def ngram_drafter_factory(
    vocab_size: int, seed: int = 0
) -> PacedModelFn[npt.NDArray[np.floating]]:
    """The n-gram drafter's logits at ``PP1_BENCH_DRAFT_MS`` (2) ms per call."""
    model = ngram.drafter_factory(vocab_size, seed)
    return PacedModelFn(model, pace_seconds(DRAFT_MS_ENV, 2.0))
