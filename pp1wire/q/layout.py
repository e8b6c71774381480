"""Vocabulary shard layouts and the checks of one shard's q row (``docs/protocol.md`` §6.7):
contiguous ranges in rank order, digested for HELLO; what a shard checks alone, and what a
group checks over the values each rank reports (:func:`check_group`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

from pp1wire.errors import ErrorCode, ValidationError
from pp1wire.q.dyadic import Float32Array, Int32Array, M
from pp1wire.q.validate import check_ascending, checked_counts

MAX_SHARDS: Final = 0xFFFF
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ShardLayout:
    """Contiguous vocabulary ranges in rank order: ``bounds[0] = 0 ≤ … ≤ bounds[-1] = V``."""

    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        """Refuse a layout that is not a split of ``[0, V)``.

        Raises:
            ValueError: fewer than one shard or more than 65,535, a first bound
                other than 0, bounds that decrease, or V outside 1..2**31 - 1.
        """
        b = self.bounds
        if not 2 <= len(b) <= MAX_SHARDS + 1:
            raise ValueError(f"a layout has 1..{MAX_SHARDS} shards, not {len(b) - 1}")
        if b[0] != 0 or any(y < x for x, y in itertools.pairwise(b)):
            raise ValueError("layout bounds must start at 0 and never decrease")
        if not 1 <= b[-1] <= 0x7FFFFFFF:
            raise ValueError(f"vocabulary size {b[-1]} out of range")

    @classmethod
    def even(cls, vocab_size: int, shards: int) -> ShardLayout:
        """The split both daemons use: rank r owns ``[r·V div N, (r + 1)·V div N)``.

        Raises:
            ValueError: as the constructor.
        """
        if shards < 1:
            raise ValueError(f"a layout has 1..{MAX_SHARDS} shards, not {shards}")
        return cls(tuple(r * vocab_size // shards for r in range(shards + 1)))

    @property
    def shards(self) -> int:
        """The number of ranges."""
        return len(self.bounds) - 1

    @property
    def vocab_size(self) -> int:
        """V, the end of the last range."""
        return self.bounds[-1]

    def range(self, shard: int) -> tuple[int, int]:
        """``(start, end)`` of rank ``shard``'s global IDs.

        Raises:
            ValueError: if ``shard`` is not a rank of this layout.
        """
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} outside a layout of {self.shards}")
        return self.bounds[shard], self.bounds[shard + 1]

    @property
    def digest(self) -> int:
        """xxh3-64 (seed 0) of the bounds as little-endian uint32: the HELLO field ``layout``."""
        return xxhash.xxh3_64_intdigest(np.asarray(self.bounds, dtype="<u4").tobytes())


def _mass(counts: npt.NDArray[np.int64]) -> int:
    """The shard's exact count sum.

    Raises:
        ValidationError: ``MASS_MISMATCH`` above 2**24: no shard holds more than the whole.
    """
    total = int(counts.sum())
    if total > M:
        raise ValidationError(ErrorCode.MASS_MISMATCH, "a shard's counts exceed 2**24")
    return total


def check_dense_shard(q: Float32Array, start: int, end: int, vocab_size: int, proposed: int) -> int:
    """Validate a dense shard row (q over ``[start, end)``) by §6.7, first failure wins; return
    its count sum.

    Raises:
        ValidationError: ``ROW_LENGTH``, ``PROPOSED_OUT_OF_RANGE``, ``NON_FINITE``, ``NEGATIVE``,
            ``NON_DYADIC``, ``MASS_MISMATCH`` or ``ZERO_Q_AT_PROPOSED``.
    """
    if q.shape != (end - start,):
        raise ValidationError(ErrorCode.ROW_LENGTH, f"shard row has {q.size} entries")
    if not 0 <= proposed < vocab_size:
        raise ValidationError(ErrorCode.PROPOSED_OUT_OF_RANGE, f"token {proposed} out of range")
    total = _mass(checked_counts(q))
    if start <= proposed < end and q[proposed - start] == 0:
        raise ValidationError(ErrorCode.ZERO_Q_AT_PROPOSED, f"q({proposed}) is zero")
    return total


def check_sparse_shard(
    ids: Int32Array,
    q: Float32Array,
    start: int,
    end: int,
    vocab_size: int,
    max_k: int,
    proposed: int,
) -> int:
    """Validate a sparse shard row (IDs in ``[start, end)``, possibly none) by §6.7, first
    failure wins; return its count sum.

    Raises:
        ValidationError: ``ROW_LENGTH``, ``SUPPORT_TOO_LARGE``, ``PROPOSED_OUT_OF_RANGE``,
            ``SPARSE_ID_OUT_OF_RANGE``, ``SPARSE_DUPLICATE_ID``, ``SPARSE_UNSORTED``,
            ``NON_FINITE``, ``NEGATIVE``, ``NON_DYADIC``, ``SPARSE_ZERO_ENTRY``, ``MASS_MISMATCH``
            or ``ZERO_Q_AT_PROPOSED``.
    """
    if ids.size != q.size:
        raise ValidationError(ErrorCode.ROW_LENGTH, f"{ids.size} ids but {q.size} q values")
    if ids.size > max_k:
        raise ValidationError(ErrorCode.SUPPORT_TOO_LARGE, f"{ids.size} entries > limit {max_k}")
    if not 0 <= proposed < vocab_size:
        raise ValidationError(ErrorCode.PROPOSED_OUT_OF_RANGE, f"token {proposed} out of range")
    if ids.size == 0:
        if start <= proposed < end:
            raise ValidationError(ErrorCode.ZERO_Q_AT_PROPOSED, f"q({proposed}) is zero")
        return 0
    if int(ids.min()) < start or int(ids.max()) >= end:
        raise ValidationError(ErrorCode.SPARSE_ID_OUT_OF_RANGE, "sparse id outside the shard")
    check_ascending(ids)
    counts = checked_counts(q)
    if (counts == 0).any():
        raise ValidationError(ErrorCode.SPARSE_ZERO_ENTRY, "sparse row carries a zero q")
    total = _mass(counts)
    if start <= proposed < end:
        where = int(np.searchsorted(ids, proposed))
        if where >= ids.size or int(ids[where]) != proposed:
            raise ValidationError(ErrorCode.ZERO_Q_AT_PROPOSED, f"q({proposed}) is zero")
    return total


@dataclass(frozen=True)
class ShardSummary:
    """What one shard of a validated reply tells the group: its key, tokens and masses."""

    key: tuple[int, ...]  # generation, round, position, prefix digest, depth, context
    tokens: tuple[int, ...]
    masses: tuple[int, ...]  # each row's count sum on this shard


def as_int64(value: int) -> int:
    """A uint64 (a session, a prefix digest, a context) as the int64 with the same bits, a
    tensor word: the one conversion every group word uses."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def as_uint64(word: int) -> int:
    """Inverse of :func:`as_int64`."""
    return word & _MASK64


def check_group(shards: Sequence[ShardSummary]) -> ErrorCode | None:
    """The checks no shard can make alone (§6.7): None if the shards form one proposal, else
    ``GROUP_SHARD_MISMATCH`` (key or tokens differ) or ``GROUP_MASS_MISMATCH`` (a row's
    counts do not add up to 2**24)."""
    first = shards[0]
    if any(s.key != first.key or s.tokens != first.tokens for s in shards[1:]):
        return ErrorCode.GROUP_SHARD_MISMATCH
    if any(len(s.masses) != len(first.tokens) for s in shards):
        return ErrorCode.GROUP_SHARD_MISMATCH
    for i in range(len(first.tokens)):
        if sum(s.masses[i] for s in shards) != M:
            return ErrorCode.GROUP_MASS_MISMATCH
    return None


__all__ = [
    "MAX_SHARDS",
    "ShardLayout",
    "ShardSummary",
    "as_int64",
    "as_uint64",
    "check_dense_shard",
    "check_group",
    "check_sparse_shard",
]
