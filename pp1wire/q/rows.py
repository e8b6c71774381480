"""Batches of rows: q construction and the proposal draw for many requests at once (the worker's
step), each row exactly what :mod:`pp1wire.q.dyadic` gives it alone: one compiled call with the
GIL released where built, numpy otherwise; and the recycled buffers rows travel in.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ConstructionError, ErrorCode, ValidationError
from pp1wire.q import dyadic, tree
from pp1wire.q.dyadic import Float32Array, Float64Array, Int32Array, M, builder, sample

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class _RowsScratch:
    """Per-thread float64 scratch for rows of weights, grown as needed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.buf = np.empty(0, dtype=np.float64)

    def rows(self, count: int) -> Float64Array:
        if self.buf.size < count * self.n:
            self.buf = np.empty(count * self.n, dtype=np.float64)
        return self.buf[: count * self.n].reshape(count, self.n)


def weights_rows(
    logits: Sequence[Float64Array], tops: Sequence[float], temperatures: Sequence[float]
) -> Float64Array:
    """:func:`~pp1wire.q.dyadic.shifted_exp` of each (checked) logits row, with one exponential
    call, as the rows of one array (this thread's scratch, overwritten by its next call).

    Raises:
        ConstructionError: ``BAD_SHAPE`` unless the rows are 1-D of one length.
    """
    if not logits:
        return np.empty((0, 0), dtype=np.float64)
    n = logits[0].shape[0] if logits[0].ndim == 1 else -1
    if n < 1 or any(x.shape != (n,) for x in logits):
        raise ConstructionError(ErrorCode.BAD_SHAPE, "logits rows must be 1-D of one length")
    w = dyadic._scratch("rows", n, lambda: _RowsScratch(n)).rows(len(logits))
    for r, (x, top, temperature) in enumerate(zip(logits, tops, temperatures, strict=True)):
        np.subtract(x, top, out=w[r])
        if temperature != 1.0:
            w[r] /= temperature
    # Elementwise, so the same values as one call per row.
    np.exp(w, out=w)
    return w


def allocate_rows(
    weights: Float64Array, draws: Sequence[int]
) -> tuple[Int32Array, list[int | ConstructionError | ValidationError]]:
    """Counts (a fresh ``[rows, n]`` int32 array) and, per row, the drawn index or its error:
    :meth:`~pp1wire.q.dyadic.QBuilder.allocate` over the canonical total, then
    :func:`~pp1wire.q.dyadic.sample`, of each row of checked float64 ``weights``.

    Raises:
        ConstructionError: ``BAD_SHAPE`` unless ``weights`` is 2-D with one
            draw per row (a row's own failure is returned, not raised).
    """
    w = np.ascontiguousarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != len(draws) or w.shape[1] < 1:
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"weights {w.shape} for {len(draws)} draws")
    rows, n = w.shape
    out = np.empty((rows, n), dtype=np.int32)
    fast = getattr(dyadic, "_fastq", None)  # as dyadic has it now (None: numpy)
    if fast is not None and rows:
        return out, _compiled_rows(fast, list(w), list(out), draws, wire=False)
    results: list[int | ConstructionError | ValidationError] = []
    for r in range(rows):
        try:
            out[r] = builder(n).allocate(w[r], tree.total(w[r]))
            results.append(sample(out[r], draws[r]))
        except (ConstructionError, ValidationError) as exc:
            results.append(exc)
    return out, results


class RowBuffers:
    """Recycled FP32 row buffers of one length (fresh ones cost a page fault per 4 KiB written):
    one is handed out again only when nothing but the pool refers to it (no row, view or
    memoryview a transport holds). At most ``limit`` are kept.
    """

    def __init__(self, entries: int, limit: int = 256) -> None:
        """A pool of ``entries``-value buffers."""
        self.entries = entries
        self.limit = limit
        self._buffers: list[Float32Array] = []
        self._next = 0
        self._lock = threading.Lock()
        self._probe = np.empty(0, dtype="<f4")

    def _idle_refs(self) -> int:
        # The count an idle buffer shows in take's test: measured the same way
        # on a probe (one reference more: this object's own), so it holds on
        # any interpreter's reference accounting.
        probes = [self._probe]
        return sys.getrefcount(probes[0]) - 1

    def take(self) -> Float32Array:
        """A buffer that nothing else refers to (its contents are stale)."""
        with self._lock:
            idle = self._idle_refs()
            buffers = self._buffers
            count = len(buffers)
            # Round robin from the last one handed out: the oldest are the
            # likeliest to be free again.
            for step in range(count):
                j = (self._next + step) % count
                if sys.getrefcount(buffers[j]) == idle:
                    self._next = (j + 1) % count
                    return buffers[j]
            fresh = np.empty(self.entries, dtype="<f4")
            if count < self.limit:
                buffers.append(fresh)
            return fresh


class PerSize(Generic[_K, _V]):
    """One ``make(size)`` per size (any hashable key) for the process, made on first use under
    a lock."""

    def __init__(self, make: Callable[[_K], _V]) -> None:
        """Make values with ``make``."""
        self._make = make
        self._made: dict[_K, _V] = {}
        self._lock = threading.Lock()

    def __call__(self, size: _K) -> _V:
        """The value for ``size``."""
        with self._lock:
            value = self._made.get(size)
            if value is None:
                value = self._made[size] = self._make(size)
            return value


#: The process's pool of FP32 row buffers of a number of entries.
row_buffers: Final = PerSize(RowBuffers)


class _ConstructScratch:
    """Per-thread scratch of the compiled pass (:func:`_compiled_rows`): its remainders,
    keys and indices (16 bytes per entry), and the small per-call outputs."""

    def __init__(self, n: int) -> None:
        self.work = np.empty(2 * n, dtype=np.float64)
        self.tokens = np.empty(0, dtype=np.int64)
        self.status = np.empty(0, dtype=np.int32)
        self.draws = np.empty(0, dtype=np.int64)

    def outputs(self, count: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        if self.tokens.size < count:
            self.tokens = np.empty(count, dtype=np.int64)
            self.status = np.empty(count, dtype=np.int32)
            self.draws = np.empty(count, dtype=np.int64)
        return self.tokens[:count], self.status[:count]


def construct_rows(
    weights: Sequence[Float32Array] | Sequence[Float64Array],
    draws: Sequence[int],
    entries: int,
    payloads: Sequence[Float32Array] | None = None,
) -> tuple[list[Float32Array], list[int | ConstructionError | ValidationError]]:
    """Rows of weights to their wire values and proposal draws, written once, as they travel.

    Each row (FP32 or float64, all of one length and dtype) gets what
    ``counts_from_weights(row)`` and ``sample(counts, draw)`` give it, its FP32 values
    ``c / 2**24`` then ``+0.0`` up to ``entries`` written into its own buffer
    (``payloads``, else :func:`row_buffers`); per row the drawn index or its error.

    Raises:
        ConstructionError: ``BAD_SHAPE`` for rows that are not 1-D of one length and one floating
            dtype, for a draw count other than the rows', or for ``entries`` below the row length (a
            row's own failure is returned, not raised).
    """
    count = len(weights)
    if count != len(draws):
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"{count} rows for {len(draws)} draws")
    if not count:
        return [], []
    first = weights[0]
    n = first.shape[0] if first.ndim == 1 else 0
    if n < 1 or any(
        w.shape != (n,) or w.dtype != first.dtype or w.dtype not in _ROW_DTYPES for w in weights
    ):
        raise ConstructionError(
            ErrorCode.BAD_SHAPE, "rows must be 1-D float32 or float64, of one length and dtype"
        )
    if entries < n:
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"{entries} entries for rows of {n}")
    if payloads is None:
        pool = row_buffers(entries)
        payloads = [pool.take() for _ in range(count)]
    elif len(payloads) != count:
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"{len(payloads)} payloads for {count} rows")
    out = list(payloads)
    fast = getattr(dyadic, "_fastq", None)
    if fast is not None and all(w.flags.c_contiguous for w in weights):
        return out, _compiled_rows(fast, weights, out, draws, wire=True)
    results: list[int | ConstructionError | ValidationError] = []
    scale = np.float32(1.0 / M)
    for r in range(count):
        try:
            c = dyadic.counts_from_weights(np.asarray(weights[r], dtype=np.float64))
            results.append(sample(c, draws[r]))
        except (ConstructionError, ValidationError) as exc:
            results.append(exc)
            continue
        np.multiply(c, scale, out=out[r][:n], dtype=np.float32, casting="unsafe")
        out[r][n:] = 0.0
    return out, results


_ROW_DTYPES: Final = (np.dtype(np.float32), np.dtype(np.float64))


def _compiled_rows(
    fast: Any, weights: Sequence[Any], payloads: Sequence[Any], draws: Sequence[int], wire: bool
) -> list[int | ConstructionError | ValidationError]:
    """The compiled pass over rows of one length: each row's wire values (``wire``) or int32
    counts into its payload, and its drawn index or error."""
    n = weights[0].shape[0]
    scratch = dyadic._scratch("construct", n, lambda: _ConstructScratch(n))
    tokens, status = scratch.outputs(len(draws))
    u = scratch.draws[: len(draws)]
    u[:] = draws
    fast.construct_rows(weights, n, u, tokens, status, payloads, scratch.work, wire)
    return _row_results(status, tokens, draws)


def _row_results(
    status: npt.NDArray[np.int32], tokens: npt.NDArray[np.int64], draws: Sequence[int]
) -> list[int | ConstructionError | ValidationError]:
    """Each row's drawn index, or its error, from the compiled pass's statuses
    (:data:`pp1wire.q.dyadic.ROW_STATUS_ERRORS`, 4 a draw out of range)."""
    results: list[int | ConstructionError | ValidationError] = []
    for r in range(len(draws)):
        code = int(status[r])
        if code == 0:
            results.append(int(tokens[r]))
        elif code == 4:
            results.append(
                ValidationError(ErrorCode.BAD_DRAW, f"draw {draws[r]} outside [0, 2**24)")
            )
        else:
            results.append(ConstructionError(*dyadic.ROW_STATUS_ERRORS[code]))
    return results
