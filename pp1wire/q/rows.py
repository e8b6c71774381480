"""Batches of rows: q construction and the proposal draw for many requests at once.

What the worker does when it drafts a step of several requests together
(:func:`pp1wire.q.proposal.propose_batch`): the weights of every row in one
exponential call, then every row's canonical total, allocation and draw in
one compiled call with the GIL released (``pp1wire/q/_fastq.c``:
``build_rows``), optionally writing each row's FP32 wire values straight into
a buffer of its own that is sent as it is. Each row gets exactly what
:mod:`pp1wire.q.dyadic` gives it alone; without the compiled module, numpy
gives the same results.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, TypeVar

import numpy as np

from pp1wire.errors import ConstructionError, ErrorCode, ValidationError
from pp1wire.q import dyadic, tree
from pp1wire.q.dyadic import Float32Array, Float64Array, Int32Array, M, builder, sample

_V = TypeVar("_V")


def _compiled() -> Any:
    """The compiled module as :mod:`pp1wire.q.dyadic` has it now (None: numpy)."""
    return getattr(dyadic, "_fastq", None)


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
    """:func:`~pp1wire.q.dyadic.shifted_exp` of each logits row, as the rows of one
    array (this thread's scratch).

    Row ``r`` is ``exp((logits[r] - tops[r]) / temperatures[r])`` by exactly
    the operations of :func:`~pp1wire.q.dyadic.weights_from_logits` (the checks are the caller's:
    :func:`~pp1wire.q.dyadic.check_temperature` and
    :func:`~pp1wire.q.dyadic.check_top`), with one exponential call
    over the whole block. The result is overwritten by this thread's next call.

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
    """Counts and proposal draws for rows of weights: per row what
    ``sample(builder(n).from_logits(...), draw)`` gives after the weights.

    ``weights`` is ``[rows, n]`` float64, each row finite, non-negative and not
    all zero (as :func:`weights_rows` makes them). Each row is normalized by
    its canonical total, allocated (:meth:`~pp1wire.q.dyadic.QBuilder.allocate`) and sampled with
    its 24-bit draw (:func:`~pp1wire.q.dyadic.sample`). Returns the counts (a fresh ``[rows, n]``
    int32 array) and, per row, the drawn index or the error that row gets. The
    compiled path does every row in one call with the GIL released; without it
    numpy gives the same results.

    Raises:
        ConstructionError: ``BAD_SHAPE`` unless ``weights`` is 2-D with one
            draw per row (a row's own failure is returned, not raised).
    """
    w, rows, n = _rows_shape(weights, draws)
    out = np.empty((rows, n), dtype=np.int32)
    if _compiled() is not None and rows:
        return out, _build_rows(w, draws, out, None)
    results: list[int | ConstructionError | ValidationError] = []
    for r in range(rows):
        try:
            out[r] = builder(n).allocate(w[r], tree.total(w[r]))
            results.append(sample(out[r], draws[r]))
        except (ConstructionError, ValidationError) as exc:
            results.append(exc)
    return out, results


class RowBuffers:
    """Recycled FP32 row buffers of one length, for rows written as they travel.

    A row's payload lives until its reply is no longer needed (the next
    COMMIT or RESET of its slot), far beyond the call that wrote it; fresh
    half-megabyte arrays would cost a page fault per 4 KiB on every write
    (the allocator returns them to the system when freed). A buffer is handed
    out again only when nothing but the pool refers to it: not the row, not a
    view, not a memoryview a transport still holds (each of those holds a
    reference to the array). At most ``limit`` buffers are kept; beyond them
    fresh arrays are used.
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


class PerSize(Generic[_V]):
    """One ``make(size)`` per size for the whole process, made on first use (under a
    lock, so two threads asking at once never make two)."""

    def __init__(self, make: Callable[[int], _V]) -> None:
        """Make values with ``make``."""
        self._make = make
        self._made: dict[int, _V] = {}
        self._lock = threading.Lock()

    def __call__(self, size: int) -> _V:
        """The value for ``size``."""
        with self._lock:
            value = self._made.get(size)
            if value is None:
                value = self._made[size] = self._make(size)
            return value


#: The process's pool of FP32 row buffers of a number of entries.
row_buffers: Final = PerSize(RowBuffers)


def allocate_rows_fp32(
    weights: Float64Array, draws: Sequence[int], entries: int
) -> tuple[list[Float32Array], list[int | ConstructionError | ValidationError]]:
    """:func:`allocate_rows` with each row written once, as it travels: FP32
    ``c / 2**24`` (:func:`counts_to_fp32`) followed by ``+0.0`` up to
    ``entries`` values, in an array per row of its own (from
    :func:`row_buffers`; valid for the rows whose result is a drawn index).
    The counts themselves stay in scratch.

    Raises:
        ConstructionError: ``BAD_SHAPE`` as :func:`allocate_rows`, or for
            ``entries`` below the row length.
    """
    w, rows, n = _rows_shape(weights, draws)
    if entries < n:
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"{entries} entries for rows of {n}")
    pool = row_buffers(entries)
    payloads = [pool.take() for _ in range(rows)]
    if _compiled() is not None and rows:
        counts = builder(n).out  # scratch: each row's counts live only until its payload
        return payloads, _build_rows(w, draws, counts, payloads)
    results: list[int | ConstructionError | ValidationError] = []
    scale = np.float32(1.0 / M)
    for r in range(rows):
        try:
            c = builder(n).allocate(w[r], tree.total(w[r]))
            results.append(sample(c, draws[r]))
        except (ConstructionError, ValidationError) as exc:
            results.append(exc)
            continue
        np.multiply(c, scale, out=payloads[r][:n], dtype=np.float32, casting="unsafe")
        payloads[r][n:] = 0.0
    return payloads, results


def _rows_shape(weights: Float64Array, draws: Sequence[int]) -> tuple[Float64Array, int, int]:
    w = np.ascontiguousarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != len(draws) or w.shape[1] < 1:
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"weights {w.shape} for {len(draws)} draws")
    return w, w.shape[0], w.shape[1]


def _build_rows(
    w: Float64Array,
    draws: Sequence[int],
    counts: Int32Array,
    payloads: list[Float32Array] | None,
) -> list[int | ConstructionError | ValidationError]:
    rows, n = w.shape
    scratch = builder(n)
    tokens = np.empty(rows, dtype=np.int64)
    status = np.empty(rows, dtype=np.int32)
    u = np.asarray(draws, dtype=np.int64)
    _compiled().build_rows(w, n, counts, u, tokens, status, scratch.share, scratch.work, payloads)
    results: list[int | ConstructionError | ValidationError] = []
    for r in range(rows):
        code = int(status[r])
        if code == 0:
            results.append(int(tokens[r]))
        elif code == 4:
            results.append(
                ValidationError(ErrorCode.BAD_DRAW, f"draw {draws[r]} outside [0, 2**24)")
            )
        else:
            results.append(ConstructionError(ErrorCode.ALLOCATION_INCONSISTENT, _ROWS_STATUS[code]))
    return results


_ROWS_STATUS: Final = {
    1: "tickets left over outside the row",
    2: "tickets left over for zero remainders",
    3: "allocation does not sum to M",
}
