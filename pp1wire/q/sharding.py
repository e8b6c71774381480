"""The dyadic24 kernels on a vocabulary split into contiguous shards (a numpy emulator of a
rank group's collectives, ``docs/protocol.md`` §6.6): each returns exactly what its unsharded
counterpart returns on the concatenation, for every split.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error, ValidationError, VerifyError
from pp1wire.q import dyadic, tree
from pp1wire.q.dyadic import Float64Array, Int32Array, Int64Array, M

_U53 = float(1 << 53)


def _floats(shards: Sequence[npt.ArrayLike]) -> list[Float64Array]:
    out = [np.asarray(s, dtype=np.float64) for s in shards]
    if not out or any(s.ndim != 1 for s in out) or sum(s.size for s in out) == 0:
        raise ConstructionError(ErrorCode.BAD_SHAPE, "shards must be 1-D and not all empty")
    return out


def _refuse_bad_values(shards: list[Float64Array], nonfinite: Pp1Error, negative: Pp1Error) -> None:
    """Raise ``nonfinite`` for any NaN or infinity, else ``negative`` for any value below 0
    (the two flags a group all-reduces first)."""
    if not all(np.isfinite(s).all() for s in shards):
        raise nonfinite
    if any((s < 0).any() for s in shards):
        raise negative


def _check_weights(shards: list[Float64Array]) -> float:
    """The unsharded checks, in their order, then the canonical total."""
    _refuse_bad_values(
        shards,
        ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "weights contain NaN or infinity"),
        ConstructionError(ErrorCode.WEIGHT_NEGATIVE, "weights contain negative values"),
    )
    with np.errstate(over="ignore"):
        total = tree.ShardedTree.build(shards).total
    if not total > 0.0:
        raise ConstructionError(ErrorCode.ZERO_MASS, "weights have zero total mass")
    if not np.isfinite(total):
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "total weight overflows binary64")
    return total


class _ShardRow:
    """:func:`pp1wire.q.dyadic.allocate_with`'s pieces for one row split into shards, each
    piece what a rank computes and the group exchanges."""

    def __init__(self, shards: list[Float64Array], total: float) -> None:
        self.n = sum(s.size for s in shards)
        self.shards, self.total = shards, total
        self.rems = [np.empty(s.size, dtype=np.float64) for s in shards]
        self.out: list[Int64Array] = []

    @staticmethod
    def where(cond: bool, yes: int, no: int) -> int:
        return yes if cond else no

    def floors(self) -> int:
        floors = [np.empty(s.size, dtype=np.int32) for s in self.shards]
        for s, f, r in zip(self.shards, floors, self.rems, strict=True):
            dyadic.floors_and_remainders(s, self.total, f, r)
        self.out = [f.astype(np.int64) for f in floors]
        return sum(int(f.sum(dtype=np.int64)) for f in floors)  # the integer sum

    def threshold(self, left: int, live: bool) -> float:
        if not live:
            return 0.0
        # Each rank offers its `left` largest remainders; the threshold is the
        # left-th largest of all offers.
        offers = np.concatenate([r[dyadic.largest_indices(r, left)] for r in self.rems])
        return float(np.partition(offers, offers.size - left)[offers.size - left])

    def above(self, threshold: float, live: bool) -> int:
        return sum(int((r > threshold).sum()) for r in self.rems) if live else 0

    def assign(self, threshold: float, ties: int, live: bool) -> int:
        for o, r in zip(self.out, self.rems, strict=True):
            if not live:
                break
            np.add(o, r > threshold, out=o)
            taken = np.flatnonzero(r == threshold)[:ties]  # lowest global IDs first
            o[taken] += 1
            ties -= taken.size
        return sum(int(o.sum()) for o in self.out)


def _allocate(shards: list[Float64Array], total: float) -> list[Int64Array]:
    """Floor plus the globally largest remainders, ties to the lowest global ID
    (:func:`pp1wire.q.dyadic.allocate_with` over the shards).

    Raises:
        ConstructionError: ``ALLOCATION_INCONSISTENT``.
    """
    row = _ShardRow(shards, total)
    status = dyadic.allocate_with(row)
    if status:
        raise ConstructionError(*dyadic.ROW_STATUS_ERRORS[status])
    return row.out


def counts_from_weights(shards: Sequence[npt.ArrayLike]) -> list[Int64Array]:
    """The pieces of :func:`pp1wire.q.dyadic.counts_from_weights` of the concatenation.

    Raises:
        ConstructionError: as the unsharded function (same code for the same input).
    """
    w = _floats(shards)
    return _allocate(w, _check_weights(w))


def _weights_from_logits(shards: Sequence[npt.ArrayLike], temperature: float) -> list[Float64Array]:
    dyadic.check_temperature(temperature)
    x = _floats(shards)
    top = dyadic.check_top(float(np.max([s.max() for s in x if s.size])))  # max all-reduce
    return [dyadic.shifted_exp(s, top, temperature) for s in x]


def counts_from_logits(
    shards: Sequence[npt.ArrayLike], temperature: float = 1.0
) -> list[Int64Array]:
    """The pieces of :func:`pp1wire.q.dyadic.counts_from_logits` of the concatenation.

    Raises:
        ConstructionError: as the unsharded function.
    """
    w = _weights_from_logits(shards, temperature)
    return _allocate(w, tree.ShardedTree.build(w).total)


def _sparse(w: list[Float64Array], k: int) -> tuple[Int32Array, Int64Array]:
    offers_w: list[Float64Array] = []
    offers_id: list[npt.NDArray[np.int64]] = []
    start = 0
    for s in w:
        local = dyadic.largest_indices(s, min(k, s.size))
        local = local[s[local] > 0]
        offers_w.append(s[local])
        offers_id.append(local.astype(np.int64) + start)
        start += s.size
    weights, ids = np.concatenate(offers_w), np.concatenate(offers_id)
    order = np.lexsort((ids, -weights))[:k]  # largest weights, ties to the lowest ID
    chosen = np.sort(ids[order])
    sub = weights[np.searchsorted(ids, chosen)]  # ids ascend: shards in order, each ascending
    counts = _allocate([sub], tree.total(sub))[0]
    keep = counts > 0
    return chosen[keep].astype(np.int32), counts[keep]


def sparse_counts_from_weights(
    shards: Sequence[npt.ArrayLike], k: int
) -> tuple[Int32Array, Int64Array]:
    """:func:`pp1wire.q.dyadic.sparse_counts_from_weights` of the concatenation: global IDs.

    Raises:
        ConstructionError: as the unsharded function.
    """
    dyadic.check_k(k)
    w = _floats(shards)
    _check_weights(w)
    return _sparse(w, k)


def sparse_counts_from_logits(
    shards: Sequence[npt.ArrayLike], temperature: float, k: int
) -> tuple[Int32Array, Int64Array]:
    """:func:`pp1wire.q.dyadic.sparse_counts_from_logits` of the concatenation.

    Raises:
        ConstructionError: as the unsharded function.
    """
    dyadic.check_k(k)
    return _sparse(_weights_from_logits(shards, temperature), k)


def sample(count_shards: Sequence[npt.ArrayLike], u24: int) -> int:
    """:func:`pp1wire.q.dyadic.sample` of the concatenation: the global ID drawn by ``u24``, in
    the shard whose slice of the cumulative counts holds it.

    Raises:
        ValidationError: as the unsharded function.
    """
    if not 0 <= u24 < M:
        raise ValidationError(ErrorCode.BAD_DRAW, f"draw {u24} outside [0, 2**24)")
    pieces = [np.asarray(c) for c in count_shards]
    if not pieces or any(c.dtype.kind not in "iu" or c.ndim != 1 for c in pieces):
        raise ValidationError(ErrorCode.MASS_MISMATCH, "counts must be 1-D integer arrays")
    if any(c.size and c.min() < 0 for c in pieces):
        raise ValidationError(ErrorCode.NEGATIVE, "negative count")
    totals = [int(c.sum(dtype=np.int64)) for c in pieces]
    if sum(totals) != M:
        raise ValidationError(ErrorCode.MASS_MISMATCH, "counts do not sum to M")
    # Every shard counts its cumulative counts at most what is left of the draw, owner
    # or not (dyadic.sample's count, the same work whatever the index drawn).
    start = before = 0
    found = -1
    for c, t in zip(pieces, totals, strict=True):
        at = int(np.count_nonzero(np.cumsum(c, dtype=np.int64) <= u24 - before))
        if before <= u24 < before + t:
            found = start + at
        before += t
        start += c.size
    return found


def normalize_target(p_shards: Sequence[npt.ArrayLike]) -> list[Float64Array]:
    """The pieces of :func:`pp1wire.q.verify.check_target` (p over its canonical total).

    Raises:
        VerifyError: ``TARGET_NON_FINITE``, ``TARGET_NEGATIVE`` or ``TARGET_ZERO_MASS``.
    """
    p = [np.asarray(s, dtype=np.float64) for s in p_shards]
    _refuse_bad_values(
        p,
        VerifyError(ErrorCode.TARGET_NON_FINITE, "target has NaN or infinity"),
        VerifyError(ErrorCode.TARGET_NEGATIVE, "target has a negative probability"),
    )
    with np.errstate(over="ignore"):
        total = tree.ShardedTree.build(p).total
    if not (total > 0 and np.isfinite(total)):
        raise VerifyError(ErrorCode.TARGET_ZERO_MASS, "target has no usable mass")
    return [s / total for s in p]


def sample_weights(weight_shards: Sequence[npt.ArrayLike], u53: int) -> int:
    """:func:`pp1wire.q.verify.sample_weights` of the concatenation: a global ID.

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` if the weights have no mass.
    """
    t = tree.ShardedTree.build(weight_shards)
    if not t.total > 0:
        raise VerifyError(ErrorCode.EMPTY_RESIDUAL, "distribution has no mass")
    return t.descend((u53 / _U53) * t.total)


def residual_sample(
    p_shards: Sequence[npt.ArrayLike], count_shards: Sequence[npt.ArrayLike], u53: int
) -> int:
    """:func:`pp1wire.q.verify.residual_sample` of the concatenations: a global ID (each shard
    forms ``max(p - q, 0)`` over every ID it owns).

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` if p <= q everywhere.
    """
    resid = []
    for p, c in zip(p_shards, count_shards, strict=True):
        r = np.asarray(p, dtype=np.float64) - np.asarray(c, dtype=np.float64) / M
        resid.append(np.maximum(r, 0.0, out=r))
    return sample_weights(resid, u53)
