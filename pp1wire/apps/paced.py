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
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

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

_A = TypeVar("_A")
_R = TypeVar("_R")
_B = TypeVar("_B")
_B_co = TypeVar("_B_co", covariant=True)


def pace_seconds(name: str, default_ms: float) -> float:
    """``$name``, read as milliseconds as ``pp1-demo --target-ms`` reads them
    (``default_ms`` when unset), in seconds.

    Raises:
        ValueError: unless it is a finite number of milliseconds in 0..60,000.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default_ms / 1e3
    try:
        return settings.pace_ms(raw) / 1e3
    except argparse.ArgumentTypeError as exc:  # a plugin factory's caller expects ValueError
        raise ValueError(f"{name}={raw!r}: {exc}") from None


def paced_call(seconds: float, fn: Callable[[_A], _R], arg: _A) -> _R:
    """``fn(arg)``, returned ``seconds`` after the call began (later only if ``fn``
    takes longer): a paced model's cost, whatever the call computes. The wait is a
    sleep, which releases the GIL as a call into a GPU runtime does.

    Raises:
        Exception: whatever ``fn`` raises, at once (a failed call is not paced).
    """
    deadline = time.perf_counter() + seconds
    out = fn(arg)
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)
    return out


class Batched(Protocol[_B_co]):
    """A model function with its batched form as ``batch``
    (:class:`pp1wire.apps.models.ModelFn`'s shape)."""

    def __call__(self, prefix: Sequence[int], /) -> Row:
        """One prefix's row."""
        ...

    def batch(self, prefixes: Sequence[Sequence[int]], /) -> _B_co:
        """Every prefix's row, one call."""
        ...


class PacedModelFn(Generic[_B]):
    """A model function that costs ``seconds`` per call, of one prefix or a batch: the
    rows are computed inside that time, then the call sleeps to its deadline (more,
    only if computing them takes longer)."""

    def __init__(self, fn: Batched[_B], seconds: float) -> None:
        """Serve ``fn`` (per prefix, and its ``batch``) at ``seconds`` per call; its rows
        are what ``fn``'s are (its ``kind``, :func:`pp1wire.q.proposal.drafter_kind`).

        Raises:
            ValueError: for a ``kind`` of ``fn`` other than ``"logits"`` and ``"probs"``.
        """
        self.fn = fn
        self.seconds = seconds
        self.kind: DrafterKind = drafter_kind(fn)

    def __call__(self, prefix: Sequence[int]) -> Row:
        """One prefix's row, at the cost of one call."""
        return paced_call(self.seconds, self.fn, prefix)

    def batch(self, prefixes: Sequence[Sequence[int]]) -> _B:
        """Every prefix's row, at the cost of one call."""
        return paced_call(self.seconds, self.fn.batch, prefixes)


class _Table:
    """The rows of a table by a prefix's last token, modulo the table's length."""

    def __init__(self, table: Row, kind: DrafterKind) -> None:
        self.table = table
        self.kind = kind

    def __call__(self, prefix: Sequence[int]) -> Row:
        last = int(prefix[-1]) if len(prefix) else 0
        row: Row = self.table[last % self.table.shape[0]]
        return row

    def batch(self, prefixes: Sequence[Sequence[int]]) -> list[Row]:
        return [self(p) for p in prefixes]


class PacedModel(PacedModelFn[list[Row]]):
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
        super().__init__(_Table(table, kind), seconds)


def _contexts(vocab_size: int) -> list[list[int]]:
    return [[t] for t in range(min(CONTEXTS, vocab_size))]


def target_factory(vocab_size: int, seed: int = 0) -> PacedModel:
    """The toy target's probabilities at ``PP1_PACED_TARGET_MS`` per call.

    Raises:
        ValueError: for a pace that is not a duration in 0..60,000 ms.
    """
    seconds = pace_seconds(TARGET_MS_ENV, DEFAULT_TARGET_MS)
    return PacedModel(ToyLM(vocab_size, seed).probs_batch(_contexts(vocab_size)), seconds)


def drafter_factory(vocab_size: int, seed: int = 0, *, kind: DrafterKind = "logits") -> PacedModel:
    """The toy drafter's logits at ``PP1_PACED_DRAFTER_MS`` per call; with
    ``kind="probs"``, its probabilities as FP32 (:func:`probs_drafter_factory`).

    Raises:
        ValueError: for a pace that is not a duration in 0..60,000 ms, or a
            ``kind`` other than ``"logits"`` and ``"probs"``.
    """
    seconds = pace_seconds(DRAFTER_MS_ENV, DEFAULT_DRAFTER_MS)
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
