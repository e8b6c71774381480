"""The ``dyadic24-standard-v1`` proposal distribution (``docs/protocol.md`` §6.1): integer
counts summing to ``M = 2**24``, built from weights by the one allocation rule
(:func:`allocate_with`), and sampled in integers over the whole row (:func:`sample`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ConstructionError, ErrorCode, ValidationError
from pp1wire.q import tree

try:  # the optional compiled fast paths (pp1wire/q/_fastq.c), qualified against numpy
    from pp1wire.q import _fastq  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised by tests that disable it
    _fastq = None

M: Final = 1 << 24
SEMANTIC_ID: Final = "dyadic24-standard-v1"

_MIN_NORMAL: Final = 2.0**-1022

_T = TypeVar("_T")
_local = threading.local()

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]
Float64Array = npt.NDArray[np.float64]


def _as_weights(weights: npt.ArrayLike) -> Float64Array:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ConstructionError(
            ErrorCode.BAD_SHAPE, f"weights must be a non-empty 1-D array, got shape {w.shape}"
        )
    return w


def _check_weights(w: Float64Array) -> float:
    """Refuse NaN, +inf, negative weights and zero mass; return the binary64 total."""
    if not np.isfinite(w).all():
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "weights contain NaN or infinity")
    if (w < 0).any():  # -0.0 is a zero weight here; only the wire insists on +0.0
        raise ConstructionError(ErrorCode.WEIGHT_NEGATIVE, "weights contain negative values")
    with np.errstate(over="ignore"):
        total = tree.total(w)  # the canonical pairwise total (§6.6): any split agrees
    if not total > 0.0:
        raise ConstructionError(ErrorCode.ZERO_MASS, "weights have zero total mass")
    if not np.isfinite(total):
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "total weight overflows binary64")
    return total


def largest_indices(
    values: Float64Array, count: int, *, work: Float64Array | None = None
) -> npt.NDArray[np.intp]:
    """Indices of the ``count`` largest values, ties to the lowest index, ascending, in one
    partition (``work``: scratch of the same shape)."""
    n = values.size
    if count <= 0:
        return np.empty(0, dtype=np.intp)
    if count >= n:
        return np.arange(n, dtype=np.intp)
    if work is None:
        work = values.copy()
    else:
        np.copyto(work, values)
    work.partition(n - count)
    threshold = work[n - count]
    above = np.flatnonzero(values > threshold)
    ties = np.flatnonzero(values == threshold)[: count - above.size]
    return np.sort(np.concatenate([above, ties]))


class QBuilder:
    """Builds dense dyadic24 counts for one vocabulary size in reusable scratch (fresh
    temporaries per row cost more in page faults than the arithmetic). Results are views
    of the scratch, overwritten by the next call. Not thread-safe: one per thread.
    """

    def __init__(self, n: int) -> None:
        """Allocate scratch for rows of ``n`` entries."""
        self.n = n
        self.weights = np.empty(n, dtype=np.float64)
        self.share = np.empty(n, dtype=np.float64)
        self.work = np.empty(n, dtype=np.float64)
        self.above = np.empty(n, dtype=np.bool_)
        # int32 halves the memory traffic; counts never exceed 2**24.
        self.out = np.empty(n, dtype=np.int32)

    def from_logits(self, logits: npt.ArrayLike, temperature: float = 1.0) -> Int32Array:
        """Counts from one logits row (a scratch view; see the class docstring).

        Raises:
            ConstructionError: see :func:`weights_from_logits`; ``BAD_SHAPE`` if
                the row length is not this builder's.
        """
        w = weights_from_logits(logits, temperature, out=self.weights)
        return self.allocate(w, tree.total(w))

    def sparse_from_logits(
        self, logits: npt.ArrayLike, temperature: float, k: int
    ) -> tuple[Int32Array, Int64Array]:
        """Sparse top-k ``(ids, counts)`` from one logits row (fresh arrays).

        Raises:
            ConstructionError: see :func:`sparse_counts_from_logits`.
        """
        check_k(k)
        w = weights_from_logits(logits, temperature, out=self.weights)
        return _sparse_from_checked(w, k, self.work)

    def allocate(self, w: Float64Array, total: float) -> Int32Array:
        """Counts for checked weights ``w`` normalized by ``total`` (a scratch view), by
        :func:`allocate_with` or the compiled pass that follows it.

        Raises:
            ConstructionError: ``BAD_SHAPE`` for a length other than this builder's;
                ``ALLOCATION_INCONSISTENT`` when the binary64 allocation does not close exactly.
        """
        if w.shape != (self.n,):
            raise ConstructionError(ErrorCode.BAD_SHAPE, f"row of {w.size}, builder for {self.n}")
        if _fastq is not None and w.flags.c_contiguous and w.dtype == np.float64:
            status = _fastq.allocate(w, total, self.out, self.share, self.work)
        else:
            status = allocate_with(_NumpyRow(self, w, total))
        if status:
            raise ConstructionError(*ROW_STATUS_ERRORS[status])
        return self.out


class AllocationPieces(Protocol):
    """What a backend of :func:`allocate_with` computes over its rows of ``n`` weights: a
    row's values as numbers, a batch's as arrays (``live``: the rows a piece applies to)."""

    n: int

    def floors(self) -> Any:
        """Each weight's share of M (§6.1 step 3), floor kept as its count, remainder aside;
        each row's sum of floors."""

    def threshold(self, left: Any, live: Any) -> Any:
        """The ``left``-th largest remainder of each live row (anything elsewhere)."""

    def above(self, threshold: Any, live: Any) -> Any:
        """How many remainders of each live row exceed its threshold (0 elsewhere)."""

    def assign(self, threshold: Any, ties: Any, live: Any) -> Any:
        """One more count in each live row for every remainder above the threshold and the
        first ``ties`` equal to it in ID order; each row's sum of counts."""

    def where(self, cond: Any, yes: Any, no: Any) -> Any:
        """``yes`` where ``cond``, else ``no`` (elementwise for a batch)."""


def allocate_with(rows: AllocationPieces) -> Any:
    """The allocation of M tickets (``docs/protocol.md`` §6.1 steps 3-5), the one statement
    of the rule for every backend: floors, ``left`` refused unless ``0 <= left < n``, the
    ``left``-th largest remainder refused unless positive, one ticket above it and the rest
    to its ties in ID order, the sum refused unless M. Every piece is called whatever the
    data (a sharded backend's collectives run on every rank).

    Returns each row's status: 0, or 1 to 3 of :data:`ROW_STATUS_ERRORS`.
    """
    left = M - rows.floors()
    fits = (left >= 0) & (left < rows.n)
    status = rows.where(fits, 0, 1)
    live = fits & (left > 0)
    threshold = rows.threshold(left, live)
    status = rows.where(live, rows.where(threshold > 0, status, 2), status)
    live = live & (status == 0)
    above = rows.above(threshold, live)
    total = rows.assign(threshold, left - above, live)
    return rows.where((status == 0) & (total != M), 3, status)


class _NumpyRow:
    """:func:`allocate_with`'s pieces for one row of a :class:`QBuilder`, in its scratch."""

    def __init__(self, b: QBuilder, w: Float64Array, total: float) -> None:
        self.n, self.b, self.w, self.total = b.n, b, w, total

    @staticmethod
    def where(cond: bool, yes: int, no: int) -> int:
        return yes if cond else no

    def floors(self) -> int:
        floors_and_remainders(self.w, self.total, self.b.out, self.b.share)
        return int(self.b.out.sum(dtype=np.int64))

    def threshold(self, left: int, live: bool) -> float:
        if not live:
            return 0.0
        work = self.b.work
        np.copyto(work, self.b.share)
        work.partition(self.n - left)
        return float(work[self.n - left])

    def above(self, threshold: float, live: bool) -> int:
        if not live:
            return 0
        return int(np.count_nonzero(np.greater(self.b.share, threshold, out=self.b.above)))

    def assign(self, threshold: float, ties: int, live: bool) -> int:
        out = self.b.out
        if live:
            out += self.b.above
            if ties:
                out[np.flatnonzero(self.b.share == threshold)[:ties]] += 1
        return int(out.sum(dtype=np.int64))


def floors_and_remainders(
    w: Float64Array, total: float, floors: Int32Array, remainders: Float64Array
) -> None:
    """Each weight's share of M tickets (§6.1 step 3, elementwise): its floor into ``floors``,
    the rest into ``remainders``."""
    # Dividing by total / M is the same correctly rounded division, because M
    # is a power of two (barring a subnormal total / M, where the two steps are kept).
    scale = total / M
    if scale >= _MIN_NORMAL:
        np.divide(w, scale, out=remainders)
    else:
        np.divide(w, total, out=remainders)
        remainders *= M
    # share >= 0, so truncation to an integer is the floor.
    np.copyto(floors, remainders, casting="unsafe")
    np.subtract(remainders, floors, out=remainders)  # fractional parts, in [0, 1)


def _scratch(kind: str, key: object, factory: Callable[[], _T]) -> _T:
    """A per-thread cache of scratch objects (a few shapes per process)."""
    cache: dict[tuple[str, object], object] = _local.__dict__.setdefault("cache", {})
    found = cache.get((kind, key))
    if found is None:
        found = factory()
        if len(cache) < 32:
            cache[(kind, key)] = found
    return found  # type: ignore[return-value]


def builder(n: int) -> QBuilder:
    """This thread's :class:`QBuilder` for rows of ``n`` entries."""
    return _scratch("alloc", n, lambda: QBuilder(n))


def _allocate(w: Float64Array, total: float) -> Int64Array:
    return builder(w.size).allocate(w, total).astype(np.int64)


def counts_from_weights(weights: npt.ArrayLike) -> Int64Array:
    """Dense dyadic24 counts (same length as ``weights``) from non-negative weights.

    Raises:
        ConstructionError: ``BAD_SHAPE`` (not a non-empty 1-D array), ``WEIGHT_NON_FINITE`` (NaN or
            infinity), ``WEIGHT_NEGATIVE``, ``ZERO_MASS`` or ``ALLOCATION_INCONSISTENT``.
    """
    w = _as_weights(weights)
    return _allocate(w, _check_weights(w))


def weights_from_logits(
    logits: npt.ArrayLike, temperature: float, *, out: Float64Array | None = None
) -> Float64Array:
    """``exp((logits - max) / temperature)`` in binary64; ``-inf`` logits give 0.

    ``out``, if given, receives the weights and must have the logits' shape.

    Raises:
        ConstructionError: ``BAD_TEMPERATURE`` unless the temperature is finite
            and positive; ``BAD_SHAPE``; ``WEIGHT_NON_FINITE`` for NaN or
            ``+inf`` logits; ``ZERO_MASS`` when every logit is ``-inf``.
    """
    check_temperature(temperature)
    x = _as_weights(logits)
    top = check_top(float(x.max()))  # NaN propagates through max
    if out is not None and out.shape != x.shape:
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"out has shape {out.shape}, logits {x.shape}")
    return shifted_exp(x, top, temperature, out=out)


def check_temperature(temperature: float) -> None:
    """Refuse a temperature that is not finite and positive.

    Raises:
        ConstructionError: ``BAD_TEMPERATURE``.
    """
    if not (np.isfinite(temperature) and temperature > 0):
        raise ConstructionError(
            ErrorCode.BAD_TEMPERATURE, f"temperature {temperature!r} must be > 0"
        )


def check_probs_temperature(temperature: float) -> None:
    """Refuse a temperature other than 1 for a probabilities drafter's row (0, greedy,
    is the caller's): its values are the weights as given (``docs/protocol.md`` §6.1).

    Raises:
        ConstructionError: ``BAD_TEMPERATURE``.
    """
    if temperature != 1.0:
        raise ConstructionError(
            ErrorCode.BAD_TEMPERATURE,
            f"temperature {temperature!r}: a probabilities drafter's rows are drawn "
            "at temperature 1 (or 0, greedy) only",
        )


def counts_from_fp32(weights: npt.ArrayLike) -> Int32Array:
    """Dense counts (int32, a fresh array) from FP32 weights, a probabilities drafter's
    row: :func:`counts_from_weights` of the values widened exactly to binary64.

    Raises:
        ConstructionError: as :func:`counts_from_weights`.
    """
    with np.errstate(over="ignore"):  # beyond the FP32 range: infinite, and refused
        w = _as_weights(np.asarray(weights, dtype=np.float32))
    return builder(w.size).allocate(w, _check_weights(w)).copy()


def check_top(top: float) -> float:
    """The largest logit, once it is known to be finite (NaN propagates through max).

    Raises:
        ConstructionError: ``WEIGHT_NON_FINITE`` for NaN or ``+inf``;
            ``ZERO_MASS`` when every logit is ``-inf``.
    """
    if np.isnan(top):
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "logits contain NaN")
    if top == np.inf:
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "logits contain +inf")
    if top == -np.inf:
        raise ConstructionError(ErrorCode.ZERO_MASS, "every logit is -inf")
    return top


def shifted_exp(
    x: Float64Array, top: float, temperature: float, *, out: Float64Array | None = None
) -> Float64Array:
    """``exp((x - top) / temperature)`` elementwise in binary64 (``-inf`` gives 0)."""
    w = np.subtract(x, top, out=out)
    if temperature != 1.0:
        w /= temperature
    np.exp(w, out=w)
    return w


def counts_from_logits(logits: npt.ArrayLike, temperature: float = 1.0) -> Int64Array:
    """Dense counts from draft logits after temperature (softmax then allocation).

    Raises:
        ConstructionError: see :func:`weights_from_logits` and :func:`counts_from_weights`.
    """
    x = _as_weights(logits)
    # exp of a finite shifted logit is finite and >= 0, and the max maps to 1.
    return builder(x.size).from_logits(x, temperature).astype(np.int64)


def check_k(k: int) -> None:
    """Refuse a sparse support size below 1.

    Raises:
        ConstructionError: ``BAD_SHAPE``.
    """
    if k < 1:
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"sparse support k={k} must be >= 1")


def _sparse_from_checked(
    w: Float64Array, k: int, work: Float64Array | None = None
) -> tuple[Int32Array, Int64Array]:
    ids = largest_indices(w, k, work=work)
    ids = ids[w[ids] > 0]  # zero weights are never in the support
    return _support_counts(w, ids)


def _support_counts(
    w: Float64Array | Float32Array, ids: npt.NDArray[np.intp] | npt.NDArray[np.int64]
) -> tuple[Int32Array, Int64Array]:
    """The sparse row of the support ``ids`` (ascending) of ``w``: its weights widened
    exactly to binary64, allocated over their canonical total, zero counts dropped."""
    sub = w[ids].astype(np.float64, copy=False)
    counts = _allocate(sub, tree.total(sub))
    keep = counts > 0
    return ids[keep].astype(np.int32), counts[keep]


def sparse_counts_from_weights(weights: npt.ArrayLike, k: int) -> tuple[Int32Array, Int64Array]:
    """Sparse top-k dyadic24 q, ``(ids ascending int32, counts int64)``: the support chosen
    first (largest positive weights, ties to the lowest ID), allocated, zero counts dropped.

    Raises:
        ConstructionError: as :func:`counts_from_weights`, or ``BAD_SHAPE`` for k < 1.
    """
    check_k(k)
    w = _as_weights(weights)
    _check_weights(w)
    return _sparse_from_checked(w, k)


#: The error of each failure status a row gets: 1 to 3 from :func:`allocate_with`, the
#: others from the compiled and torch checks (4, a draw out of range, names its draw).
ROW_STATUS_ERRORS: Final[dict[int, tuple[ErrorCode, str]]] = {
    1: (ErrorCode.ALLOCATION_INCONSISTENT, "tickets left over outside the row"),
    2: (ErrorCode.ALLOCATION_INCONSISTENT, "tickets left over for zero remainders"),
    3: (ErrorCode.ALLOCATION_INCONSISTENT, "allocation does not sum to M"),
    5: (ErrorCode.WEIGHT_NON_FINITE, "weights contain NaN or infinity, or overflow binary64"),
    6: (ErrorCode.WEIGHT_NEGATIVE, "weights contain negative values"),
    7: (ErrorCode.ZERO_MASS, "weights have zero total mass"),
}


class _TopkScratch:
    """Per-thread scratch of :func:`sparse_counts_from_fp32` for rows of n and a support k."""

    def __init__(self, n: int, k: int) -> None:
        self.cap = max(64 * k, 4096)
        self.ids = np.empty(self.cap, dtype=np.int64)
        self.work = np.empty((n + 63) // 64 + 2 * self.cap, dtype=np.uint32)


def sparse_counts_from_fp32(weights: npt.ArrayLike, k: int) -> tuple[Int32Array, Int64Array]:
    """:func:`sparse_counts_from_weights` of FP32 weights widened exactly, bit for bit; the
    compiled pass chooses the support on the bit patterns (numpy where it cannot).

    Raises:
        ConstructionError: as :func:`sparse_counts_from_weights`.
    """
    check_k(k)
    w = np.ascontiguousarray(weights, dtype=np.float32)
    if w.ndim != 1 or w.size == 0:
        raise ConstructionError(
            ErrorCode.BAD_SHAPE, f"weights must be a non-empty 1-D array, got shape {w.shape}"
        )
    if _fastq is not None:
        n = w.size
        scratch = _scratch("topk", (n, k), lambda: _TopkScratch(n, k))
        count, status = _fastq.topk_f32(w, k, scratch.ids, scratch.work)
        if status:
            raise ConstructionError(*ROW_STATUS_ERRORS[status])
        if count >= 0:
            return _support_counts(w, scratch.ids[:count])  # ascending
    return sparse_counts_from_weights(w.astype(np.float64), k)


def sparse_counts_from_logits(
    logits: npt.ArrayLike, temperature: float, k: int
) -> tuple[Int32Array, Int64Array]:
    """Sparse top-k q from logits after temperature (see :func:`sparse_counts_from_weights`).

    Raises:
        ConstructionError: see :func:`weights_from_logits`, or ``BAD_SHAPE`` for k < 1.
    """
    check_k(k)
    x = _as_weights(logits)
    check_temperature(temperature)
    return sparse_row_from_logits(x, check_top(float(x.max())), temperature, k)


# Sparse candidates: logits bucketed by their distance below the top in 1/16
# temperature units, taken up to one unit (a factor e) past the k-th's bucket.
_BUCKETS_PER_UNIT: Final = 16.0
_CANDIDATE_MARGIN = 16
# A weight computed by exp is within a relative 2**-32 of the exact value (a
# few ulps for any libm or numpy); twice that, and some, separates two weights
# whose exact values are in order.
_EXP_SLACK: Final = 1.0 + 2.0**-20
_MIN_THETA: Final = 2.0**-1000


def sparse_row_from_logits(
    logits: Float64Array, top: float, temperature: float, k: int
) -> tuple[Int32Array, Int64Array]:
    """:func:`sparse_counts_from_logits` bit for bit for a checked row (``top`` its maximum),
    without the exponential over the whole row where the compiled candidates provably hold
    the support: the largest weight left out, times ``1 + 2**-20``, is below the k-th.

    Raises:
        ConstructionError: ``ALLOCATION_INCONSISTENT`` (as the full path).
    """
    x = np.ascontiguousarray(logits, dtype=np.float64)
    n = x.size
    if _fastq is not None and k < n:
        cap = max(64 * k, 4096)
        cand = np.empty(cap, dtype=np.int64)
        count, x_out = _fastq.sparse_candidates(
            x, top, _BUCKETS_PER_UNIT / temperature, k, _CANDIDATE_MARGIN, cand
        )
        if count >= k:
            ids = cand[:count]
            w = shifted_exp(x[ids], top, temperature)
            order = np.argsort(-w, kind="stable")[:k]  # ties: ascending ID
            theta = float(w[order[-1]])
            outside = float(shifted_exp(np.array([x_out]), top, temperature)[0])
            if theta >= _MIN_THETA and outside * _EXP_SLACK < theta:
                at, counts = _support_counts(w, np.sort(order))
                return ids[at].astype(np.int32), counts
    return builder(n).sparse_from_logits(x, temperature, k)


def point_mass(vocab_size: int, token: int) -> Int64Array:
    """The greedy (v1) proposal: ``c = M`` at ``token``, zero elsewhere.

    Raises:
        ConstructionError: ``BAD_SHAPE`` if ``token`` is not in ``[0, vocab_size)``.
    """
    if not 0 <= token < vocab_size:
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"token {token} outside [0, {vocab_size})")
    out = np.zeros(vocab_size, dtype=np.int64)
    out[token] = M
    return out


def counts_to_fp32(counts: npt.ArrayLike) -> Float32Array:
    """Encode counts as the exact little-endian FP32 q values ``c / M``.

    Raises:
        ConstructionError: ``BAD_SHAPE`` unless counts are integers in ``[0, M]``.
    """
    c = np.asarray(counts)
    if c.dtype.kind not in "iu" or c.ndim != 1 or (c.size and (c.min() < 0 or c.max() > M)):
        raise ConstructionError(ErrorCode.BAD_SHAPE, "counts must be 1-D integers in [0, M]")
    return (c.astype(np.float32) * np.float32(1.0 / M)).astype("<f4", copy=False)


def sample(counts: npt.ArrayLike, u24: int) -> int:
    """Index of the first entry whose cumulative count is strictly greater than ``u24``,
    counted over the whole row: its time tells nothing of the token (``docs/adaptive.md`` §7).

    Raises:
        ValidationError: ``BAD_DRAW`` if ``u24`` is outside ``[0, M)``; ``MASS_MISMATCH`` if the
            counts are not integers summing to M; ``NEGATIVE`` if a count is negative.
    """
    if not 0 <= u24 < M:
        raise ValidationError(ErrorCode.BAD_DRAW, f"draw {u24} outside [0, 2**24)")
    c = np.asarray(counts)
    if c.dtype.kind not in "iu" or c.ndim != 1:
        raise ValidationError(ErrorCode.MASS_MISMATCH, "counts must be a 1-D integer array")
    if _fastq is not None and c.dtype in _DRAWN_DTYPES and c.flags.c_contiguous:
        # One pass, no cumulative array: the worker draws from every row it builds.
        index, status = _fastq.sample_counts(c, u24)
        if status == 1:
            raise ValidationError(ErrorCode.NEGATIVE, "negative count")
        if status == 2:
            raise ValidationError(ErrorCode.MASS_MISMATCH, "counts do not sum to M")
        return int(index)
    if c.size and c.min() < 0:
        raise ValidationError(ErrorCode.NEGATIVE, "negative count")
    cumulative = np.cumsum(c, dtype=np.int64)
    if cumulative.size == 0 or int(cumulative[-1]) != M:
        raise ValidationError(ErrorCode.MASS_MISMATCH, "counts do not sum to M")
    return int(np.count_nonzero(cumulative <= u24))


_DRAWN_DTYPES: Final = (np.dtype(np.int32), np.dtype(np.int64))
