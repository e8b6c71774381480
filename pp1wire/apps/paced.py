"""Toy plugins with a fixed cost per call, of one prefix or a whole batch, as a forward pass costs:
tabulated toy models, paced by ``PP1_PACED_TARGET_MS`` (default 20) and ``PP1_PACED_DRAFTER_MS``
(default 0.5), so that what speculative decoding buys is visible (``pp1-demo`` runs them)."""

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

CONTEXTS = 64  # a prefix's row is the toy model's after its last token mod CONTEXTS
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
    """``$name`` in milliseconds (``default_ms`` when unset), as seconds.

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
    """``fn(arg)``, returned ``seconds`` after the call began (later only if ``fn`` takes
    longer); the wait is a sleep, which releases the GIL as a GPU runtime's call does.

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
    """A model function with its batched form as ``batch`` (a ``ModelFn``'s shape)."""

    def __call__(self, prefix: Sequence[int], /) -> Row:
        """One prefix's row."""
        ...

    def batch(self, prefixes: Sequence[Sequence[int]], /) -> _B_co:
        """Every prefix's row, one call."""
        ...


class PacedModelFn(Generic[_B]):
    """A model function that costs ``seconds`` per call, of one prefix or a batch."""

    def __init__(self, fn: Batched[_B], seconds: float) -> None:
        """Serve ``fn`` (per prefix, and its ``batch``) at ``seconds`` per call, its ``kind``.

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
    """A tabulated toy model that costs ``seconds`` per call; its rows are ``kind`` (as a
    drafter's), and a batch is the list of the table's rows (not copied: they are free)."""

    def __init__(self, table: Row, seconds: float, *, kind: DrafterKind = "logits") -> None:
        """Serve the rows of ``table`` (one per context, read-only) at ``seconds`` per call.

        Raises:
            ValueError: for a ``kind`` other than ``"logits"`` and ``"probs"``.
        """
        table.flags.writeable = False
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
    """The toy drafter's logits at ``PP1_PACED_DRAFTER_MS`` per call (``kind="probs"``: its
    FP32 probabilities).

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
    """The toy drafter's FP32 probabilities (``kind = "probs"``) at ``PP1_PACED_DRAFTER_MS``.

    Raises:
        ValueError: for a pace that is not a duration in 0..60,000 ms.
    """
    return drafter_factory(vocab_size, seed, kind="probs")
