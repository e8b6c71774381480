"""Validation of a received q row against the ``dyadic24-standard-v1`` contract
(``docs/protocol.md`` §6.2): a row passes or is refused with one specific error code,
never renormalized.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ErrorCode, ValidationError
from pp1wire.q import dyadic
from pp1wire.q.dyadic import Float32Array, Int32Array, Int64Array, M, _scratch

ONE_BITS: Final = 0x3F800000  # binary32 bits of 1.0
_EXP_MASK: Final = 0x7F800000
_SIGN_BIT: Final = 0x80000000
# 128 counts of at most 2**24 each stay below 2**31, so int32 partial sums of
# 128-row blocks are exact (_exact_count_sum).
_SUM_BLOCK: Final = 128


def diagnose_range(bits: npt.NDArray[np.uint32]) -> ValidationError:
    """Name the first failing class for a row whose max bits exceed 1.0's."""
    if ((bits & _EXP_MASK) == _EXP_MASK).any():
        return ValidationError(ErrorCode.NON_FINITE, "q contains NaN or infinity")
    if (bits >= _SIGN_BIT).any():
        return ValidationError(ErrorCode.NEGATIVE, "q contains a negative value or -0.0")
    return ValidationError(ErrorCode.NON_DYADIC, "q value above 1")


def checked_counts(q: Float32Array) -> Int64Array:
    """The counts of FP32 q values, each c / 2**24 in [0, 1] (§6.2's value checks, in order).

    Raises:
        ValidationError: ``NON_FINITE``, ``NEGATIVE`` or ``NON_DYADIC``.
    """
    bits = q.view(np.uint32)
    if bits.size and int(bits.max()) > ONE_BITS:
        raise diagnose_range(bits)
    scaled = q * np.float32(M)  # exact: a power-of-two scaling
    counts = scaled.astype(np.int64)
    if not np.array_equal(counts.astype(np.float32), scaled):
        raise ValidationError(ErrorCode.NON_DYADIC, "q value is not a multiple of 2**-24")
    return counts


def _le_view(buf: object, what: str, dtype: str, kind: str) -> npt.NDArray[Any]:
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.dtype(dtype) or buf.ndim != 1:
            raise ValidationError(
                ErrorCode.ROW_LENGTH, f"{what} must be a 1-D little-endian {kind} array"
            )
        return buf
    mv = memoryview(buf)  # type: ignore[arg-type]
    if mv.nbytes % 4:
        raise ValidationError(
            ErrorCode.ROW_LENGTH, f"{what} is {mv.nbytes} bytes, not a multiple of 4"
        )
    return np.frombuffer(mv, dtype=dtype)


def _f32_view(buf: object, what: str) -> Float32Array:
    return _le_view(buf, what, "<f4", "float32")


def _i32_view(buf: object, what: str) -> Int32Array:
    return _le_view(buf, what, "<i4", "int32")


class DenseRowValidator:
    """Validates dense dyadic24 rows of one negotiated shape in preallocated scratch (compiled:
    one pass, ``_fastq.check_dense``): the row length, then §6.2's checks in order, first
    failure wins. Not thread-safe: one per receiving thread.
    """

    def __init__(self, vocab_size: int, row_entries: int | None = None) -> None:
        """Prepare scratch for rows of ``row_entries`` (default ``vocab_size``) FP32 values.

        Raises:
            ValidationError: ``ROW_LENGTH`` if ``row_entries < vocab_size`` or ``vocab_size < 1``.
        """
        entries = vocab_size if row_entries is None else row_entries
        if vocab_size < 1 or entries < vocab_size:
            raise ValidationError(ErrorCode.ROW_LENGTH, "row entries must cover the vocabulary")
        self.vocab_size = vocab_size
        self.row_entries = entries
        self._scaled = np.empty(vocab_size, dtype=np.float32)
        self._back = np.empty(vocab_size, dtype=np.float32)
        self._counts = np.empty(vocab_size, dtype=np.int32)
        self._body = vocab_size - vocab_size % _SUM_BLOCK
        self._fresh = True
        self._last: Float32Array = self._scaled

    def check(self, row: Float32Array, proposed: int) -> None:
        """Validate one row given as a float32 view; raise on the first failing class.

        Raises:
            ValidationError: ``ROW_LENGTH``, ``PROPOSED_OUT_OF_RANGE``, ``NON_FINITE``,
                ``NEGATIVE``, ``NON_DYADIC``, ``DENSE_PADDING_NONZERO``, ``MASS_MISMATCH`` or
                ``ZERO_Q_AT_PROPOSED``.
        """
        if row.shape != (self.row_entries,):
            raise ValidationError(
                ErrorCode.ROW_LENGTH,
                f"dense row has {row.size} entries, expected {self.row_entries}",
            )
        if not 0 <= proposed < self.vocab_size:
            raise ValidationError(ErrorCode.PROPOSED_OUT_OF_RANGE, f"token {proposed} out of range")
        v = self.vocab_size
        body = row[:v]
        bits = body.view(np.uint32)
        fast = getattr(dyadic, "_fastq", None)  # off where dyadic has it off
        if fast is not None:
            # One compiled pass over the row: every check, in this order (§6.2).
            code = fast.check_dense(row, v, proposed)
            self._fresh = False
            if code:
                raise ValidationError(ErrorCode(code), _DENSE_REFUSALS.get(code, "q row refused"))
            self._last = body
            return
        # One pass over the raw bits rejects NaN, infinities, every value with
        # the sign bit (so -0.0 too) and values above 1.
        if int(bits.max()) > ONE_BITS:
            raise diagnose_range(bits)
        if self.row_entries > v and row[v:].view(np.uint32).any():
            raise ValidationError(ErrorCode.DENSE_PADDING_NONZERO, "dense padding is not +0.0")
        scaled = self._scaled
        np.multiply(body, np.float32(M), out=scaled)  # exact: power-of-two scaling
        counts = self._counts
        np.copyto(counts, scaled, casting="unsafe")  # truncates; exact for values <= 2**24
        np.copyto(self._back, counts, casting="unsafe")
        if not np.array_equal(self._back, scaled):
            raise ValidationError(ErrorCode.NON_DYADIC, "q value is not a multiple of 2**-24")
        if _exact_count_sum(counts, self._body) != M:
            raise ValidationError(ErrorCode.MASS_MISMATCH, "q counts do not sum to 2**24")
        if counts[proposed] == 0:
            raise ValidationError(ErrorCode.ZERO_Q_AT_PROPOSED, f"q({proposed}) is zero")
        self._fresh = True

    def counts(self) -> Int32Array:
        """The counts of the last row that passed :meth:`check` (scratch; copy to keep)."""
        if not self._fresh:
            np.multiply(self._last, np.float32(M), out=self._scaled)
            np.copyto(self._counts, self._scaled, casting="unsafe")
            self._fresh = True
        return self._counts


_DENSE_REFUSALS: Final = {
    int(ErrorCode.NON_FINITE): "q contains NaN or infinity",
    int(ErrorCode.NEGATIVE): "q contains a negative value or -0.0",
    int(ErrorCode.NON_DYADIC): "q value above 1 or not a multiple of 2**-24",
    int(ErrorCode.DENSE_PADDING_NONZERO): "dense padding is not +0.0",
    int(ErrorCode.MASS_MISMATCH): "q counts do not sum to 2**24",
    int(ErrorCode.ZERO_Q_AT_PROPOSED): "q is zero at the proposed token",
}


def _exact_count_sum(counts: Int32Array, body: int) -> int:
    """Exact integer sum of counts in ``[0, 2**24]``: 128-row blocks column-wise in int32 (never
    overflows), then the column sums in int64."""
    head = counts[:body].reshape(_SUM_BLOCK, -1).sum(axis=0, dtype=np.int32)
    return int(head.sum(dtype=np.int64)) + int(counts[body:].sum(dtype=np.int64))


def validate_dense(
    buf: object, vocab_size: int, proposed: int, *, row_entries: int | None = None
) -> Int64Array:
    """Validate a received dense row (float32 array or buffer of little-endian FP32 values, the
    entries past ``vocab_size`` padding) and return its counts (int64, ``vocab_size``).

    Raises:
        ValidationError: with the code of the first failing class (see :class:`DenseRowValidator`).
    """
    row = _f32_view(buf, "dense row")
    key = (vocab_size, vocab_size if row_entries is None else row_entries)
    validator = _scratch("dense", key, lambda: DenseRowValidator(*key))
    validator.check(row, proposed)
    return validator.counts().astype(np.int64)


def validate_sparse(
    ids_buf: object, q_buf: object, vocab_size: int, max_k: int, proposed: int
) -> tuple[Int32Array, Int64Array]:
    """Validate a received sparse row and return ``(ids, counts)``: a standalone validator's
    checks of §6.2 in order, first failure wins.

    Raises:
        ValidationError: ``ROW_LENGTH``, ``MISSING_Q``, ``SUPPORT_TOO_LARGE``,
            ``PROPOSED_OUT_OF_RANGE``, ``SPARSE_ID_OUT_OF_RANGE``, ``SPARSE_DUPLICATE_ID``,
            ``SPARSE_UNSORTED``, ``NON_FINITE``, ``NEGATIVE``, ``NON_DYADIC``,
            ``SPARSE_ZERO_ENTRY``, ``MASS_MISMATCH`` or ``ZERO_Q_AT_PROPOSED``.
    """
    ids = _i32_view(ids_buf, "sparse ids")
    q = _f32_view(q_buf, "sparse q")
    check_sparse(ids, q, vocab_size, max_k, proposed)
    return ids.copy(), (q.astype(np.float64) * M).astype(np.int64)


def check_ascending(ids: Int32Array) -> None:
    """Sparse IDs strictly ascending (§6.2 step 3).

    Raises:
        ValidationError: ``SPARSE_DUPLICATE_ID`` for a repeated ID, else ``SPARSE_UNSORTED``.
    """
    if ids.size > 1 and (np.diff(ids) <= 0).any():
        if np.unique(ids).size != ids.size:
            raise ValidationError(ErrorCode.SPARSE_DUPLICATE_ID, "sparse ids repeat")
        raise ValidationError(ErrorCode.SPARSE_UNSORTED, "sparse ids not strictly ascending")


def check_sparse(
    ids: Int32Array, q: Float32Array, vocab_size: int, max_k: int, proposed: int
) -> None:
    """:func:`validate_sparse`'s checks on int32 and float32 views, nothing copied.

    Raises:
        ValidationError: see :func:`validate_sparse`.
    """
    fast = getattr(dyadic, "_fastq", None)  # off where dyadic has it off
    if fast is not None and ids.size == q.size:
        code = fast.check_sparse(ids, q, vocab_size, max_k, proposed)
        if code:
            raise ValidationError(ErrorCode(code), "sparse row refused")
        return
    if ids.size != q.size:
        raise ValidationError(ErrorCode.ROW_LENGTH, f"{ids.size} ids but {q.size} q values")
    if ids.size == 0:
        raise ValidationError(ErrorCode.MISSING_Q, "sparse row has no entries")
    if ids.size > max_k:
        raise ValidationError(ErrorCode.SUPPORT_TOO_LARGE, f"{ids.size} entries > limit {max_k}")
    if not 0 <= proposed < vocab_size:
        raise ValidationError(ErrorCode.PROPOSED_OUT_OF_RANGE, f"token {proposed} out of range")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValidationError(ErrorCode.SPARSE_ID_OUT_OF_RANGE, "sparse id outside the vocabulary")
    check_ascending(ids)
    counts = checked_counts(q)
    if (counts == 0).any():
        raise ValidationError(ErrorCode.SPARSE_ZERO_ENTRY, "sparse row carries a zero q")
    if int(counts.sum()) != M:
        raise ValidationError(ErrorCode.MASS_MISMATCH, "q counts do not sum to 2**24")
    where = int(np.searchsorted(ids, proposed))
    if where >= ids.size or int(ids[where]) != proposed:
        raise ValidationError(ErrorCode.ZERO_Q_AT_PROPOSED, f"q({proposed}) is zero")
