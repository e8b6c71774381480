"""The walk's row operations: one target row's checks, p(x) and draws (``docs/protocol.md``
§6.5, §6.6), and the backends that do them for a batch of rounds, the same answers bit for
bit (:class:`PrefixRows`, :class:`HostRows`, :class:`CompiledRows`; :func:`decide` picks one).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ErrorCode, VerifyError
from pp1wire.q import tree
from pp1wire.q.arrays import host_array
from pp1wire.q.dyadic import M
from pp1wire.q.proposal import ExtendedPrefix
from pp1wire.q.walk import Decision, Draw, RoundRows, walk

try:  # the optional compiled row work (pp1wire/q/_fastq.c), qualified against numpy's
    from pp1wire.q import _fastq  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised by tests that disable it
    _fastq = None

Float64Array = npt.NDArray[np.float64]

_U53 = float(1 << 53)
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_Q_KINDS = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64))


def check_target(p: npt.ArrayLike, vocab_size: int) -> Float64Array:
    """Check a target vector (finite, non-negative, positive mass) and normalize it.

    Raises:
        VerifyError: ``TARGET_FAILED`` for a wrong shape, ``TARGET_NON_FINITE``,
            ``TARGET_NEGATIVE`` or ``TARGET_ZERO_MASS``.
    """
    arr, total = checked_target(p, vocab_size)
    return arr / total  # a new array: the caller's p is never modified


def checked_target(p: npt.ArrayLike, vocab_size: int) -> tuple[Float64Array, float]:
    """:func:`check_target` without the division: the values and their canonical total
    (``values[x] / total`` is ``check_target(p)[x]`` bit for bit).

    Raises:
        VerifyError: as :func:`check_target`.
    """
    arr = host_rows(p, np.float64)  # numpy, or an engine's tensor (viewed, not copied, on the CPU)
    if arr.shape != (vocab_size,):
        raise VerifyError(
            ErrorCode.TARGET_FAILED, f"target shape {arr.shape}, expected ({vocab_size},)"
        )
    # Two read passes decide the common case (NaN propagates through both, +inf
    # through the sum); the classifying passes run only when something is wrong.
    # The total is the canonical pairwise one (§6.6), so any split agrees.
    total = tree.total(arr)
    if not (float(arr.min()) >= 0.0 and np.isfinite(total)):
        if not np.isfinite(arr).all():
            raise VerifyError(ErrorCode.TARGET_NON_FINITE, "target has NaN or infinity")
        if (arr < 0).any():
            raise VerifyError(ErrorCode.TARGET_NEGATIVE, "target has a negative probability")
    if not (total > 0 and np.isfinite(total)):
        raise VerifyError(ErrorCode.TARGET_ZERO_MASS, "target has no usable mass")
    return arr, float(total)


def host_rows(x: Any, dtype: npt.DTypeLike | None = None) -> npt.NDArray[Any]:
    """Target rows on the host, the one conversion of every form they come in: as
    :func:`~pp1wire.q.arrays.host_array`, a tensor numpy cannot view (bf16) first widened
    exactly (a narrower float to float32, anything else to float64).

    Raises:
        BufferError, RuntimeError, TypeError: ``x`` is not readable as an array.
    """
    try:
        return host_array(x, dtype)
    except (BufferError, RuntimeError, TypeError):
        if not (callable(getattr(x, "is_floating_point", None)) and hasattr(x, "double")):
            raise
        narrow = x.is_floating_point() and x.element_size() < 4
        return host_array(x.float() if narrow else x.double(), dtype)


class CheckedRow:
    """A checked target row, divided by its total only when a draw needs all of p."""

    __slots__ = ("_p", "_total", "_values")

    def __init__(self, values: Float64Array, total: float | None) -> None:
        """``values`` over ``total`` (``None``: ``values`` is p already)."""
        self._values, self._total = values, total
        self._p = values if total is None else None

    def at(self, x: int) -> float:
        """p(x), one division."""
        if self._p is not None:
            return float(self._p[x])
        assert self._total is not None
        return float(self._values[x]) / self._total

    def full(self) -> Float64Array:
        """p over the whole vocabulary."""
        if self._p is None:
            assert self._total is not None
            self._p = self._values / self._total
        return self._p


def sample_weights(weights: Float64Array, u53: int) -> int:
    """The draw ``u53`` (in ``[0, 2**53)``) from non-negative binary64 weights: the canonical
    tree descended with ``(u53 / 2**53) * total`` (§6.6); never a zero weight.

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` if the weights have no mass.
    """
    levels = tree.levels(weights)
    total = float(levels[-1][0])
    if not total > 0:
        raise VerifyError(ErrorCode.EMPTY_RESIDUAL, "distribution has no mass")
    return tree.descend(levels, (u53 / _U53) * total)


def residual(p: Float64Array, counts: npt.ArrayLike) -> Float64Array:
    """``max(p - q, 0)`` over every ID, with ``q = counts / 2**24`` (exact in binary64)."""
    r = p - np.asarray(counts, dtype=np.float64) / M
    np.maximum(r, 0.0, out=r)
    return r


def residual_sample(p: Float64Array, counts: npt.ArrayLike, u53: int) -> int:
    """The correction for the draw ``u53``: :func:`sample_weights` of :func:`residual` (``p``
    normalized, ``counts`` dense).

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` if p <= q everywhere.
    """
    return sample_weights(residual(p, counts), u53)


TargetFn = Callable[[Sequence[int]], npt.ArrayLike]
"""The target: token prefix → probabilities (or non-negative weights) over the vocabulary."""
BatchTargetFn = Callable[[Sequence[Sequence[int]]], Sequence[npt.ArrayLike] | npt.ArrayLike]
"""A batched target: many prefixes → one probability row each (an engine's batched forward)."""


class FailedRow:
    """The row a per-prefix target could not give (:func:`batched`): its call raised ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        """The failure of one call."""
        self.error = error


def batched(target: TargetFn) -> BatchTargetFn:
    """``target``'s batched form: its own ``batch`` attribute if it has one (one call
    for the whole step: if it raises, every round it scored fails), else one call
    per prefix, each failure in its own place (:class:`FailedRow`)."""
    batch = getattr(target, "batch", None)
    if callable(batch):
        return cast(BatchTargetFn, batch)

    def each(prefixes: Sequence[Sequence[int]]) -> list[npt.ArrayLike]:
        rows: list[npt.ArrayLike] = []
        for prefix in prefixes:
            try:
                rows.append(target(prefix))
            except Exception as exc:  # this prefix's rounds fail, not the whole step
                rows.append(cast(npt.ArrayLike, FailedRow(exc)))
        return rows

    return each


class StepRows:
    """The target rows of one step as the caller handed them over: one ``rows x V`` array
    or a sequence of rows, read on the host as :func:`host_rows` reads them (float32 and
    float64 viewed); a 2-D tensor on another device stays there (:attr:`device`).
    """

    def __init__(self, raw: Any, device: Any = None) -> None:
        """Use :meth:`of_matrix` or :meth:`of_rows`."""
        self._raw = raw
        self.device = device
        self._host: dict[int, npt.NDArray[Any] | None] = {}

    @classmethod
    def of_matrix(cls, probs: Any) -> StepRows:
        """``probs``: the step's rows as one 2-D array or tensor (the caller checked its shape)."""
        if _on_device(probs):
            return cls(probs, device=probs)
        matrix = host_rows(probs)
        if matrix.dtype not in _FLOATS:
            matrix = host_array(matrix, _widened(matrix.dtype))
        return cls(matrix)

    @classmethod
    def of_rows(cls, rows: Sequence[Any]) -> StepRows:
        """One row per entry (rows on one device, of one shape, stay there together)."""
        if rows and all(_on_device(r) for r in rows):
            first = rows[0]
            if all(r.device == first.device and r.shape == first.shape for r in rows):
                import torch  # noqa: PLC0415 - the rows are tensors: torch is there

                stacked = torch.stack(list(rows))
                if stacked.ndim == 2:
                    return cls(stacked, device=stacked)
        return cls(rows)

    def __len__(self) -> int:
        """Number of rows."""
        return len(self._raw)

    def raw(self, index: int) -> Any:
        """Row ``index`` as the per-request verifier would be handed it."""
        return self._raw[index]

    def host(self, index: int, vocab: int) -> npt.NDArray[Any] | None:
        """Row ``index`` as a contiguous float32/float64 host array of ``vocab``
        entries; None if it is not one (wrong shape, unreadable)."""
        if index in self._host:
            return self._host[index]
        arr: npt.NDArray[Any] | None
        try:
            raw = self._raw[index]
            arr = raw if isinstance(raw, np.ndarray) else host_rows(raw)
            if arr.dtype not in _FLOATS:
                arr = host_array(raw, _widened(arr.dtype))
        except Exception:  # diagnosed, if the round reaches it, as the verifier would
            arr = None
        if arr is not None and arr.shape != (vocab,):
            arr = None
        if arr is not None and not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        self._host[index] = arr
        return arr


def _widened(dtype: np.dtype[Any]) -> type[np.floating[Any]]:
    """What rows of ``dtype`` become on the host: a narrow float float32, else float64."""
    return np.float32 if dtype.kind == "f" and dtype.itemsize < 4 else np.float64


def _on_device(x: Any) -> bool:
    """A tensor whose device does the step's binary64 arithmetic (not the CPU, where it is
    viewed; not MPS, which has no float64)."""
    device = getattr(x, "device", None)
    kind = getattr(device, "type", "cpu")
    return device is not None and kind not in ("cpu", "mps") and hasattr(x, "cpu")


def step_threads() -> int:
    """Threads the compiled step uses by default: 2, or 1 in a process pinned to one core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without affinity
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


_PARALLEL_ENTRIES = 1 << 20  # below this many row entries a second thread costs more than it saves


Processor = Callable[[Sequence[int], Float64Array], npt.ArrayLike]
"""A pure target processor ``(prefix, p) -> p`` (grammar, penalties, stop rules)."""


def _drawn(weights: Float64Array, u53: int) -> int:
    """:func:`sample_weights`, -1 for weights without mass (the walk's empty residual)."""
    try:
        return sample_weights(weights, u53)
    except VerifyError:
        return -1


@dataclass(eq=False)
class PrefixRows:
    """The per-request backend, for one round: row ``i`` is the target's row for the
    committed prefix and the round's first ``i`` ``tokens`` (``scores[i]`` when already
    computed), then each processor's, scored when the walk reaches it; a row that fails
    keeps in :attr:`failures` the error its target, a processor or its checks raised.
    """

    eager_draws = True

    committed: Sequence[int]
    tokens: Sequence[int]
    target: TargetFn
    processors: Sequence[Processor]
    vocab: int
    scores: Sequence[npt.ArrayLike] | None = None
    failures: dict[int, VerifyError] = field(default_factory=dict, init=False)
    _rows: dict[int, CheckedRow] = field(default_factory=dict, init=False, repr=False)

    def check(self, rows: Sequence[tuple[int, int]]) -> list[bool]:
        """Score, process and check each row (see :class:`~pp1wire.q.walk.RowOps`)."""
        # One round's rows: the walk never comes back to an earlier one, so only
        # the last checked is kept (a row of binary64 at a large vocabulary).
        self._rows.clear()
        return [self._score(r) for r, _ in rows]

    def _score(self, r: int) -> bool:
        prefix: Sequence[int] = self.committed
        if self.tokens:  # the prefix viewed, not copied
            prefix = ExtendedPrefix(self.committed)
            for token in self.tokens[:r]:
                prefix.append(token)
        try:
            raw = self.target(prefix) if self.scores is None else self.scores[r]
            values, total = checked_target(raw, self.vocab)
            row = CheckedRow(values, total)
            if self.processors:
                p = row.full()
                for proc in self.processors:
                    p = check_target(proc(prefix, p), self.vocab)
                row = CheckedRow(p, None)
        except VerifyError as exc:
            self.failures[r] = exc
            return False
        except Exception as exc:  # a plugin failure must not leave a half round
            error = VerifyError(ErrorCode.TARGET_FAILED, f"target evaluation failed: {exc!r}")
            error.__cause__ = exc
            self.failures[r] = error
            return False
        self._rows[r] = row
        return True

    def p_at(self, asks: Sequence[tuple[int, int]]) -> list[float]:
        """p(x) of each checked row (one division)."""
        return [self._rows[r].at(x) for r, x in asks]

    def draw(self, draws: Sequence[Draw]) -> list[int]:
        """Each draw from the row's p, or its residual against q."""
        out = []
        for d in draws:
            p = self._rows[d.row].full()
            out.append(_drawn(p if d.q is None else residual(p, d.q.dense_counts(d.vocab)), d.u53))
        return out


class HostRows:
    """The numpy backend of a step, row by row (at a large vocabulary, stacking rows only
    adds copies: ``benchmarks/verify_batch.py``)."""

    eager_draws = True

    def __init__(self, rows: StepRows) -> None:
        """The step's rows."""
        self.rows = rows
        self._checked: dict[int, tuple[npt.NDArray[Any], float]] = {}

    def check(self, rows: Sequence[tuple[int, int]]) -> list[bool]:
        """Each row's canonical total and :func:`check_target`'s test, kept for what follows."""
        out = []
        for r, vocab in rows:
            arr = self.rows.host(r, vocab)
            if arr is None:
                out.append(False)
                continue
            x = arr.astype(np.float64, copy=False)
            with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN totals are refusals
                total = tree.total(x)
            # check_target's test: min >= 0 (false for NaN), a finite, positive total.
            good = bool(float(x.min()) >= 0.0 and np.isfinite(total) and total > 0.0)
            if good:
                self._checked[r] = (arr, total)
            out.append(good)
        return out

    def p_at(self, asks: Sequence[tuple[int, int]]) -> list[float]:
        """``v[x] / total`` of each checked row."""
        out = []
        for r, x in asks:
            arr, total = self._checked[r]
            out.append(float(arr[x]) / total)
        return out

    def draw(self, draws: Sequence[Draw]) -> list[int]:
        """Each draw, in numpy."""
        out = []
        for d in draws:
            arr, total = self._checked[d.row]
            w = arr.astype(np.float64, copy=False) / total  # p
            if d.q is not None:
                w = residual(w, d.q.dense_counts(d.vocab))
            out.append(_drawn(w, d.u53))
        return out


class CompiledRows(HostRows):
    """The compiled backend of a step (``_fastq.row_checks``, ``_fastq.draw_rows``): each
    row in one pass, the GIL released, on ``threads`` threads; a draw it does not take
    (a q of another form, no memory for its tree) is numpy's."""

    def __init__(self, rows: StepRows, threads: int) -> None:
        """The step's rows, and the threads each call may use."""
        super().__init__(rows)
        self.threads = threads

    def check(self, rows: Sequence[tuple[int, int]]) -> list[bool]:
        """As :meth:`HostRows.check`, each row read once."""
        arrays = [self.rows.host(r, vocab) for r, vocab in rows]
        out = []
        for (r, _), arr, total in zip(
            rows, arrays, _fastq.row_checks(arrays, self.threads), strict=True
        ):
            if total is not None and arr is not None:  # an unreadable row (None) is never one
                self._checked[r] = (arr, total)
            out.append(total is not None)
        return out

    def draw(self, draws: Sequence[Draw]) -> list[int]:
        """As :meth:`HostRows.draw`, each row read once, and its last block once more."""
        specs = [self._spec(d) for d in draws]
        taken = [spec for spec in specs if spec is not None]
        drawn = iter(_fastq.draw_rows(taken, self.threads))
        out = [-2 if spec is None else next(drawn) for spec in specs]
        # -2: no memory for the tree, or a q of another form; -3: a sparse q it does not take.
        rest = [k for k, y in enumerate(out) if y < -1]
        for k, y in zip(rest, super().draw([draws[k] for k in rest]), strict=True):
            out[k] = y
        return out

    def _spec(self, d: Draw) -> tuple[Any, ...] | None:
        """The compiled draw's description of ``d``; None if numpy must draw it."""
        arr, total = self._checked[d.row]
        if d.q is None:
            return (arr, total, None, None, d.u53)
        q = d.q.counts if d.q.counts is not None else d.q.q32
        ids = d.q.ids
        if q is None or q.ndim != 1 or q.dtype not in _Q_KINDS or not q.flags.c_contiguous:
            return None
        if ids is not None and (ids.dtype != np.int32 or not ids.flags.c_contiguous):
            return None
        return (arr, total, q, ids, d.u53)


def decide(jobs: Sequence[RoundRows], rows: StepRows, threads: int | None = None) -> list[Decision]:
    """Walk every round of a step with the backend its rows call for (a device's rows:
    :class:`pp1wire.q.torch_ops.DeviceStep`); one :class:`~pp1wire.q.walk.Decision` per job.

    ``threads``: the compiled backend's (None: :func:`step_threads`, or one for a step of
    fewer than 2**20 row entries). Never raises for a row's values (``BAD_ROW``, ``EMPTY``).
    """
    if not jobs:
        return []
    if rows.device is not None:
        from pp1wire.q import torch_ops  # noqa: PLC0415 - the rows are tensors

        drafts = [(job.rows[i], x) for job in jobs for i, x in enumerate(job.tokens)]
        return walk(jobs, torch_ops.DeviceStep(rows.device, drafts))
    if getattr(_fastq, "row_checks", None) is None:
        return walk(jobs, HostRows(rows))
    if threads is None:
        entries = sum(len(job.rows) * job.vocab for job in jobs)
        threads = step_threads() if entries >= _PARALLEL_ENTRIES else 1
    return walk(jobs, CompiledRows(rows, threads))
