"""Toy plugins with a fixed cost per call: what speculative decoding buys, made visible.

A real target (or drafter) is a forward pass whose cost hardly depends on how
many prefixes it scores at once. These plugins cost exactly that: every call,
of one prefix or of a whole batch (``batch``), sleeps to a fixed deadline
(which releases the GIL, as a call into a GPU runtime does), whatever the
batch size. The rows themselves are nearly free: the toy models of
:mod:`pp1wire.apps.models` are tabulated for :data:`CONTEXTS` contexts (a
prefix's row is the toy model's row after its last token modulo
:data:`CONTEXTS`), so neither side spends CPU computing them.

``target_factory`` costs ``PP1_PACED_TARGET_MS`` (default 20 ms) per call and
``drafter_factory`` ``PP1_PACED_DRAFTER_MS`` (default 0.5 ms), read from the
environment when the factory runs; both sides with the same ``--vocab`` and
``--seed`` make a matching pair (the drafter is the perturbed toy drafter).
``drafter_factory`` hands over logits; ``probs_drafter_factory`` the same
drafter's probabilities as FP32 (``kind = "probs"``), as a draft head does.
``pp1-demo`` runs them; ``benchmarks/speedup.py`` measures with them.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pp1wire.apps import settings
from pp1wire.apps.models import ToyLM
from pp1wire.q.proposal import DrafterKind, drafter_kind

#: Contexts tabulated: a prefix's row is the toy model's row after ``last % CONTEXTS``.
CONTEXTS = 64
TARGET_MS_ENV = "PP1_PACED_TARGET_MS"
DRAFTER_MS_ENV = "PP1_PACED_DRAFTER_MS"
DEFAULT_TARGET_MS = 20.0
DEFAULT_DRAFTER_MS = 0.5

Row = npt.NDArray[np.floating]


def _milliseconds(name: str, default: float) -> float:
    """``$name`` in milliseconds (``default`` when unset), as ``pp1-demo --target-ms``.

    Raises:
        ValueError: unless it is a finite number in 0..60,000.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return settings.pace_ms(raw)
    except argparse.ArgumentTypeError as exc:  # a plugin factory's caller expects ValueError
        raise ValueError(f"{name}={raw!r}: {exc}") from None


class PacedModel:
    """A tabulated toy model that costs ``seconds`` per call (a prefix or a batch).

    As a drafter, ``kind`` says what its rows are: ``"logits"``, or ``"probs"``
    (:func:`pp1wire.q.proposal.drafter_kind`). A batch is the list of the
    table's rows (not copied into one array: the rows are meant to be free).
    """

    def __init__(self, table: Row, seconds: float, *, kind: DrafterKind = "logits") -> None:
        """Serve the rows of ``table`` (one per context, read-only) at ``seconds`` per call.

        Raises:
            ValueError: for a ``kind`` other than ``"logits"`` and ``"probs"``.
        """
        table.flags.writeable = False
        self.table = table
        self.seconds = seconds
        self.kind: DrafterKind = kind
        drafter_kind(self)

    def _row(self, prefix: Sequence[int]) -> Row:
        last = int(prefix[-1]) if len(prefix) else 0
        row: Row = self.table[last % self.table.shape[0]]
        return row

    def __call__(self, prefix: Sequence[int]) -> Row:
        """One prefix's row, at the cost of one call."""
        deadline = time.perf_counter() + self.seconds
        row = self._row(prefix)
        _sleep_until(deadline)
        return row

    def batch(self, prefixes: Sequence[Sequence[int]]) -> list[Row]:
        """Every prefix's row, at the cost of one call."""
        deadline = time.perf_counter() + self.seconds
        rows = [self._row(p) for p in prefixes]
        _sleep_until(deadline)
        return rows


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _contexts(vocab_size: int) -> list[list[int]]:
    return [[t] for t in range(min(CONTEXTS, vocab_size))]


def target_factory(vocab_size: int, seed: int = 0) -> PacedModel:
    """The toy target's probabilities at ``PP1_PACED_TARGET_MS`` per call.

    Raises:
        ValueError: for a pace that is not a duration in 0..60,000 ms.
    """
    seconds = _milliseconds(TARGET_MS_ENV, DEFAULT_TARGET_MS) / 1e3
    return PacedModel(ToyLM(vocab_size, seed).probs_batch(_contexts(vocab_size)), seconds)


def drafter_factory(vocab_size: int, seed: int = 0, *, kind: DrafterKind = "logits") -> PacedModel:
    """The toy drafter's logits at ``PP1_PACED_DRAFTER_MS`` per call; with
    ``kind="probs"``, its probabilities as FP32 (:func:`probs_drafter_factory`).

    Raises:
        ValueError: for a pace that is not a duration in 0..60,000 ms, or a
            ``kind`` other than ``"logits"`` and ``"probs"``.
    """
    seconds = _milliseconds(DRAFTER_MS_ENV, DEFAULT_DRAFTER_MS) / 1e3
    model = ToyLM(vocab_size, seed, draft=True)
    contexts = _contexts(vocab_size)
    if kind == "probs":
        return PacedModel(model.probs32_batch(contexts), seconds, kind="probs")
    return PacedModel(model.logits_batch(contexts), seconds, kind=kind)


def probs_drafter_factory(vocab_size: int, seed: int = 0) -> PacedModel:
    """The toy drafter's FP32 probabilities (``kind = "probs"``) at
    ``PP1_PACED_DRAFTER_MS`` per call: ``--drafter pp1wire.apps.paced:probs_drafter_factory``.

    Raises:
        ValueError: for a pace that is not a duration in 0..60,000 ms.
    """
    return drafter_factory(vocab_size, seed, kind="probs")
