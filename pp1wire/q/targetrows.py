"""Target rows: their checks, totals and draws, for one row or for a whole engine step.

One row (what :class:`pp1wire.q.verify.RequestVerifier` does per position):
:func:`checked_target` reads a row once for its canonical total and its checks,
an accepted draft needs ``p(x) = v[x] / total`` alone (:class:`CheckedRow`),
:func:`accept_exact` decides ``u * q(x) < p(x)`` in integers, and
:func:`sample_weights` / :func:`residual_sample` draw the bonus or the
correction by descending the canonical tree (``docs/protocol.md`` §6.5, §6.6).

A step (:func:`decide`): the rounds of many requests, each a :class:`RoundRows`
that names its rows in the step's flat layout, decided together. Every round
walks its positions as the per-request verifier does, and only the rows a round
reaches are read. Three ways, the same decisions bit for bit (tests check it):

* compiled (``pp1wire/q/_fastq.c`` ``verify_rounds``, when built): the whole
  step in one call with the GIL released (its rounds shared out to two
  threads, one in a pinned process), each reached row read once for its total
  and checks and, where the round ends, once more for the draw;
* numpy (no compiler): the same walk, position by position over every live
  round, with numpy row by row (stacking rows only adds copies at a large
  vocabulary);
* torch on a device (:class:`pp1wire.q.torch_ops.DeviceStep`): the rows stay
  where the engine computed them; totals, checks and ``v[x]`` of every row come
  back in one transfer, the draws run batched over rows there, and the drawn IDs
  come back in another.

Where a step's rows come from: one call of a batched target (:func:`batched`
gives a per-prefix plugin that form, a :class:`FailedRow` in place of each
call that raised).

A row a round reaches that fails its checks stops the round with
:attr:`Stop.BAD_ROW`; the caller diagnoses it with :func:`checked_target`, so
the error is the per-request one exactly.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ErrorCode, VerifyError
from pp1wire.q import tree
from pp1wire.q.arrays import host_array
from pp1wire.q.dyadic import M
from pp1wire.q.proposal import QRow
from pp1wire.q.rng import Domain, Role, RoundStreams

try:  # the optional compiled step (pp1wire/q/_fastq.c), qualified against the numpy walk
    from pp1wire.q import _fastq  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised by tests that disable it
    _fastq = None

Float64Array = npt.NDArray[np.float64]

_U53_SHIFT = 53
_Q_SHIFT = 24
_U53 = float(1 << _U53_SHIFT)
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_Q_KINDS = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64))
_U32 = 0xFFFFFFFF


# -- one row -----------------------------------------------------------------------------


def check_target(p: npt.ArrayLike, vocab_size: int) -> Float64Array:
    """Check a target vector (finite, non-negative, positive mass) and normalize it.

    Raises:
        VerifyError: ``TARGET_FAILED`` for a wrong shape, ``TARGET_NON_FINITE``,
            ``TARGET_NEGATIVE`` or ``TARGET_ZERO_MASS``.
    """
    arr, total = checked_target(p, vocab_size)
    return arr / total  # a new array: the caller's p is never modified


def checked_target(p: npt.ArrayLike, vocab_size: int) -> tuple[Float64Array, float]:
    """:func:`check_target` without the division: the values and their canonical total.

    ``values[x] / total`` is bit-for-bit ``check_target(p)[x]`` (one IEEE division
    either way), so a caller that needs one entry need not divide the whole row.

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
    """Target rows on the host, the one conversion of every form they come in: one row
    (the per-request verifier's, or a per-prefix target's) or a step's matrix.

    As :func:`~pp1wire.q.arrays.host_array` (CPU memory viewed, a device's copied
    once), and a tensor numpy cannot view (bf16) is first widened exactly on its
    side: a narrower float to float32, which holds every such value, anything
    else to float64. So a bf16 row means the same number in every form.

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
    """A checked target row, divided by its total only when the whole row is needed.

    An accepted draft needs p(x) alone; only a correction or a bonus needs all of p.
    """

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


def accept_exact(u53_int: int, count: int, p_x: float) -> bool:
    """Exact test of ``(u53_int / 2**53) * (count / 2**24) < p_x`` in integers."""
    num, den = float(p_x).as_integer_ratio()
    return u53_int * count * den < num << (_U53_SHIFT + _Q_SHIFT)


def sample_weights(weights: Float64Array, u53: int) -> int:
    """The draw ``u53`` (in ``[0, 2**53)``) from non-negative binary64 weights; never a zero weight.

    The canonical tree over the weights is descended with the target
    ``(u53 / 2**53) * total`` (``docs/protocol.md`` §6.6), so any split of the
    weights into shards draws the same ID.

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
    """The correction for the draw ``u53``: :func:`sample_weights` of :func:`residual`.

    ``p`` is the normalized target (:func:`check_target`), ``counts`` the dense
    integer counts of q (zero outside a sparse support).

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` if p <= q everywhere.
    """
    return sample_weights(residual(p, counts), u53)


# -- where a step's rows come from ------------------------------------------------------

TargetFn = Callable[[Sequence[int]], npt.ArrayLike]
"""The target: token prefix → probabilities (or non-negative weights) over the vocabulary."""
BatchTargetFn = Callable[[Sequence[Sequence[int]]], Sequence[npt.ArrayLike] | npt.ArrayLike]
"""A batched target: many prefixes → one probability row each (an engine's batched forward)."""


class FailedRow:
    """The row a per-prefix target could not give: its call raised ``error``.

    :func:`batched` puts one in place of each failed call, so a failure of a
    per-prefix plugin fails only the rounds that needed that prefix.
    """

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


# -- a step ------------------------------------------------------------------------------


class Stop(enum.IntEnum):
    """Where a round of a step stopped (the compiled step's status codes)."""

    EOS = 0
    """An accepted terminal draft: no bonus."""
    CORRECTION = 1
    BONUS = 2
    TARGET = 3
    """The token of a target-only round."""
    BAD_ROW = 4
    """The row the round reached failed its checks (or could not be read)."""
    EMPTY = 5
    """The correction or bonus had no mass to draw from."""
    BAD_Q = 6
    """Compiled only: a sparse q it does not take. This status, and any above it (7:
    out of memory in a draw), leaves the round to the numpy walk."""


class Decision(NamedTuple):
    """How one round of a step ended: ``accepted`` drafts, then ``token`` (-1: none)
    drawn from the round's row ``row`` (an offset into :attr:`RoundRows.rows`)."""

    stop: Stop
    row: int
    accepted: int
    token: int


@dataclass(frozen=True, slots=True)
class RoundRows:
    """One round of a step, as the row work needs it.

    ``rows``: the indices of its rows in the step's layout, one per draft and
    the bonus (or one, for a target-only round: ``drafts`` empty); ``counts``:
    each draft's q count; ``start``: the absolute position of the first draft.
    """

    rows: tuple[int, ...]
    drafts: tuple[QRow, ...]
    tokens: tuple[int, ...]
    counts: tuple[int, ...]
    seed: int
    generation: int
    round_id: int
    start: int
    eos: int | None
    vocab: int

    @property
    def target_only(self) -> bool:
        """A round without drafts: one token from the target."""
        return not self.drafts

    def in_rng_range(self) -> bool:
        """Whether every key field of its draws fits the RNG ABI (else its own
        :class:`~pp1wire.q.rng.RoundStreams` refuses them)."""
        return (
            0 <= self.seed < 1 << 64
            and 0 <= self.generation <= _U32
            and 0 <= self.round_id <= _U32
            and self.start >= 0
            and self.start + len(self.drafts) <= _U32
        )


class StepRows:
    """The target rows of one step, as the caller handed them over.

    Either one ``rows x V`` array (numpy, anything DLPack exports, or a torch
    tensor on any device) or a sequence of rows (a per-prefix target's
    results). Rows on the host are viewed, not copied, when they are float32
    or float64 (other dtypes are widened once, exactly: a narrower float such
    as bf16 to float32, anything else to float64), the same way in either form
    and for the per-request verifier (:func:`host_rows`); a 2-D torch tensor on
    another device stays there (:attr:`device`).
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
    """What rows of ``dtype`` become on the host: a narrow float widens to float32
    (exact, half the copy of float64); anything else (integers too) to float64."""
    return np.float32 if dtype.kind == "f" and dtype.itemsize < 4 else np.float64


def _on_device(x: Any) -> bool:
    """A tensor whose device can do the step's binary64 arithmetic itself (not the
    CPU, where it is viewed; not MPS, which has no float64: copied to the host)."""
    device = getattr(x, "device", None)
    kind = getattr(device, "type", "cpu")
    return device is not None and kind not in ("cpu", "mps") and hasattr(x, "cpu")


def step_threads() -> int:
    """Threads the compiled step uses by default: 2, or 1 where this process may
    run on one core only (pinned)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without affinity
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


_PARALLEL_ENTRIES = 1 << 20  # below this many row entries a second thread costs more than it saves


def decide(jobs: Sequence[RoundRows], rows: StepRows, threads: int | None = None) -> list[Decision]:
    """Decide every round of a step (see the module docstring); one per job, in order.

    ``threads``: how many threads the compiled step uses, taking the rounds
    one by one (None: :func:`step_threads`, or one for a small step).

    Never raises for a row's values: a round that reaches a bad row stops with
    :attr:`Stop.BAD_ROW`, one whose correction has no mass with :attr:`Stop.EMPTY`.
    """
    if not jobs:
        return []
    if rows.device is not None:
        from pp1wire.q import torch_ops  # noqa: PLC0415 - the rows are tensors

        drafts = [(job.rows[i], x) for job in jobs for i, x in enumerate(job.tokens)]
        return _walk(jobs, torch_ops.DeviceStep(rows.device, drafts))
    out: list[Decision | None] = [None] * len(jobs)
    compiled = getattr(_fastq, "verify_rounds", None)
    if compiled is not None:
        work = [(k, _compiled_job(job, rows)) for k, job in enumerate(jobs)]
        ready = [(k, spec) for k, spec in work if spec is not None]
        status = np.empty((len(ready), 4), dtype=np.int64)
        if threads is None:
            entries = sum(len(job.rows) * job.vocab for job in jobs)
            threads = step_threads() if entries >= _PARALLEL_ENTRIES else 1
        compiled([spec for _, spec in ready], status, threads)
        for (k, _), (stop, row, accepted, token) in zip(ready, status.tolist(), strict=True):
            # BAD_Q, and an allocation that failed in the compiled draw: the numpy walk decides.
            if stop < Stop.BAD_Q:
                out[k] = Decision(Stop(stop), row, accepted, token)
    rest = [k for k, d in enumerate(out) if d is None]
    if rest:
        walked = _walk([jobs[k] for k in rest], _HostRows(rows))
        for k, d in zip(rest, walked, strict=True):
            out[k] = d
    return [d for d in out if d is not None]


def _compiled_job(job: RoundRows, rows: StepRows) -> tuple[Any, ...] | None:
    """The compiled step's description of a round; None if it must be walked in numpy."""
    qs = []
    for row in job.drafts:
        q = row.counts if row.counts is not None else row.q32
        ids = row.ids
        if q is None or q.ndim != 1 or q.dtype not in _Q_KINDS or not q.flags.c_contiguous:
            return None
        if ids is not None and (ids.dtype != np.int32 or not ids.flags.c_contiguous):
            return None
        qs.append((q, ids))
    return (
        tuple(rows.host(i, job.vocab) for i in job.rows),
        job.tokens,
        job.counts,
        tuple(qs),
        job.seed,
        job.generation,
        job.round_id,
        job.start,
        int(Domain.TARGET if job.target_only else Domain.CORRECTION),
        -1 if job.eos is None else job.eos,
        job.vocab,
    )


class _Rows(Protocol):
    def stats(self, rows: list[tuple[int, int]]) -> list[tuple[float, bool]]: ...
    def value(self, row: int, vocab: int, x: int) -> float: ...
    def draw(self, jobs: list[tuple[int, float, QRow | None, int, int]]) -> list[int]: ...


class _HostRows:
    """The numpy row work, row by row: at a large vocabulary, stacking rows for numpy
    only adds copies (measured: ``benchmarks/verify_batch.py``, numpy only)."""

    def __init__(self, rows: StepRows) -> None:
        self.rows = rows

    def stats(self, wanted: list[tuple[int, int]]) -> list[tuple[float, bool]]:
        out = []
        for r, vocab in wanted:
            arr = self.rows.host(r, vocab)
            if arr is None:
                out.append((0.0, False))
                continue
            x = arr.astype(np.float64, copy=False)
            with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN totals are refusals
                total = tree.total(x)
            # check_target's test: min >= 0 (false for NaN), a finite, positive total.
            good = float(x.min()) >= 0.0 and np.isfinite(total) and total > 0.0
            out.append((total, bool(good)))
        return out

    def _row(self, row: int, vocab: int) -> npt.NDArray[Any]:
        arr = self.rows.host(row, vocab)
        assert arr is not None  # only rows that passed their checks get here
        return arr

    def value(self, row: int, vocab: int, x: int) -> float:
        return float(self._row(row, vocab)[x])

    def draw(self, jobs: list[tuple[int, float, QRow | None, int, int]]) -> list[int]:
        out = []
        for row, total, qrow, u53, vocab in jobs:
            w = self._row(row, vocab).astype(np.float64, copy=False) / total  # p
            if qrow is not None:
                w = residual(w, qrow.dense_counts(vocab))
            try:
                out.append(sample_weights(w, u53))
            except VerifyError:  # no mass
                out.append(-1)
        return out


class _Draws:
    """A round's Spark-side draws: the compiled Philox when built (qualified against
    :mod:`pp1wire.q.rng` by the tests), else :class:`RoundStreams` itself."""

    __slots__ = ("_job", "_streams")

    def __init__(self, job: RoundRows) -> None:
        self._job = job
        self._streams = RoundStreams(Role.SPARK, job.seed, job.generation, job.round_id)

    def u53_int(self, domain: Domain, position: int) -> int:
        philox = getattr(_fastq, "philox_u53", None)
        if philox is None:
            return self._streams.u53_int(domain, position)
        job = self._job
        return int(philox(job.seed, job.generation, job.round_id, position, int(domain)))


def _walk(jobs: Sequence[RoundRows], ops: _Rows) -> list[Decision]:
    """Every live round one position further at a time: the reached rows' totals
    and checks together, each acceptance test, then every draw together."""
    n = len(jobs)
    out: list[Decision | None] = [None] * n
    streams = [_Draws(j) for j in jobs]
    at, accepted = [0] * n, [0] * n
    draws: list[tuple[int, float, QRow | None, int, int]] = []
    drawing: list[int] = []
    live = list(range(n))
    while live:
        stats = ops.stats([(jobs[k].rows[at[k]], jobs[k].vocab) for k in live])
        still = []
        for k, (total, ok) in zip(live, stats, strict=True):
            job, i = jobs[k], at[k]
            row, position = job.rows[i], job.start + i
            if not ok:
                out[k] = Decision(Stop.BAD_ROW, i, accepted[k], -1)
                continue
            if i == len(job.drafts):  # the bonus, or the target-only token
                domain = Domain.TARGET if job.target_only else Domain.CORRECTION
                draws.append((row, total, None, streams[k].u53_int(domain, position), job.vocab))
                drawing.append(k)
                continue
            x = job.tokens[i]
            u = streams[k].u53_int(Domain.ACCEPTANCE, position)
            if accept_exact(u, job.counts[i], ops.value(row, job.vocab, x) / total):
                accepted[k] += 1
                if x == job.eos:
                    out[k] = Decision(Stop.EOS, i, accepted[k], -1)
                else:
                    at[k] += 1
                    still.append(k)
                continue
            u = streams[k].u53_int(Domain.CORRECTION, position)
            draws.append((row, total, job.drafts[i], u, job.vocab))
            drawing.append(k)
        live = still
    if draws:
        for k, spec, y in zip(drawing, draws, ops.draw(draws), strict=True):
            job = jobs[k]
            if spec[2] is not None:
                stop = Stop.CORRECTION
            else:
                stop = Stop.TARGET if job.target_only else Stop.BONUS
            out[k] = Decision(stop if y >= 0 else Stop.EMPTY, at[k], accepted[k], y)
    done = [d for d in out if d is not None]
    assert len(done) == n  # every round ends once: a bad row, an accepted terminal, or a draw
    return done
