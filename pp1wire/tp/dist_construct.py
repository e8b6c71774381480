"""The worker side of the vocabulary-sharded kernels: a position's q rows built from the
ranks' slices of the logits (or probabilities) and drawn, one fixed set of collectives
for the batch, bit for bit the unsharded rows (``docs/protocol.md`` §6.6).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error
from pp1wire.q import dyadic, tree
from pp1wire.q.dyadic import M
from pp1wire.tp.coordinator import GroupCoordinator
from pp1wire.tp.dist_common import Float64Array, Int64Array, gather, pick, reduce_max, rows_of
from pp1wire.tp.shard_tree import TreePlan

# The leftover tickets' threshold is found by bucket: a remainder in [0, 1) by its
# binary64 bits (ordered as the values), 16 per binade down to 2**-128, below in bucket 0.
_SUB_BITS: Final = 4
_LOW_EXPONENT: Final = 1023 - 128
_BUCKETS: Final = 1 + (128 << _SUB_BITS)
# A remainder's top 16 bits (sign, exponent, 4 mantissa bits) less this are its bucket.
_KEY_LOW: Final = (_LOW_EXPONENT << _SUB_BITS) - 1
# With its histogram each rank sends its remainders in the three buckets around its guess
# of the threshold (or the guessed one alone) if they are at most this many: usually the
# threshold's bucket is among them on every rank, and no further collective is needed.
_WINDOW: Final = 4096
_GUESS: Final = 1 + _BUCKETS  # the guess's words: first bucket, last bucket, how many
_WORDS: Final = _GUESS + 3 + _WINDOW


@dataclass(frozen=True)
class RowSpec:
    """One row of a position: temperature (0: greedy), support (0: dense), rank 0's
    24-bit draw or its RNG's code (other ranks: 0), and this rank's drafter failure."""

    temperature: float
    support: int = 0
    u24: int = 0
    draw_code: int = 0
    drafter_code: int = 0


@dataclass(frozen=True)
class BuiltRow:
    """One row built by the group: the drawn token, this rank's part of q (dense counts,
    ``ids`` None, or its sparse entries) and q's count at the token (known to every rank)."""

    token: int
    counts: Int64Array | npt.NDArray[np.int32]
    ids: npt.NDArray[np.int32] | None
    count: int


# The first collective's columns: drafter code, two flags (logits: NaN, +inf; probabilities:
# non-finite, negative), the maximum, its first global index, rank 0's draw and RNG code;
# then a sparse row's offers or a dense probabilities row's cover totals.
_C1: Final = 7


def construct_rows(
    logits: npt.ArrayLike,
    specs: Sequence[RowSpec],
    coord: GroupCoordinator,
    *,
    probs: bool = False,
) -> list[BuiltRow | Pp1Error]:
    """Build and draw a position's rows together, each exactly what one process's
    :func:`pp1wire.q.proposal.build_row` and rank 0's proposal draw give, or the code the
    unsharded chain raises, in its order (a drafter failure on any rank: the lowest rank's).
    ``logits``: this rank's range of each row (with ``probs``, weights rounded to FP32).

    Raises:
        ValueError: rows that are not ``[len(specs), this rank's range]``.
        GroupFailedError: a collective failed.
    """
    if probs:
        with np.errstate(over="ignore"):  # beyond FP32: infinite, and refused
            plan, x32 = rows_of(logits, coord, np.float32)
        x = x32.astype(np.float64)
    else:
        plan, x = rows_of(logits, coord, np.float64)
        x32 = np.empty((0, 0), dtype=np.float32)
    rows = x.shape[0]
    if rows != len(specs):
        raise ValueError(f"{len(specs)} specs for {rows} rows")
    if not rows:
        return []
    k = max((s.support for s in specs if s.temperature != 0), default=0)
    dense_probs = probs and any(s.temperature != 0 and not s.support for s in specs)
    extra = max(2 * k + (0 if probs else 1), plan.slots if dense_probs else 0)
    local = np.zeros((rows, _C1 + extra), dtype=np.float64)
    for r, spec in enumerate(specs):
        local[r, 0] = spec.drafter_code
        local[r, 5] = spec.u24 if coord.rank == 0 else -1.0
        local[r, 6] = spec.draw_code if coord.rank == 0 else -1.0
    _first_words(x, x32, specs, probs, plan, local)
    c1 = gather(local, coord)
    out: list[BuiltRow | Pp1Error | None] = [None] * rows
    draws: list[int] = [0] * rows
    dense: list[int] = []
    sparse: list[int] = []
    tops: dict[int, float] = {}
    for r, spec in enumerate(specs):
        failed = next((int(c) for c in c1[:, r, 0] if c), 0)
        if failed:
            out[r] = Pp1Error(ErrorCode(failed), "the drafter failed on a rank")
            continue
        draws[r] = int(c1[0, r, 5])
        try:
            if spec.temperature == 0:
                out[r] = _greedy(c1[:, r], spec.support, probs, plan)
                continue
            if probs:
                dyadic.check_probs_temperature(spec.temperature)
                if spec.support:
                    dyadic.check_k(spec.support)
                _check_probs(c1[:, r])
            else:
                if spec.support:
                    dyadic.check_k(spec.support)
                dyadic.check_temperature(spec.temperature)
                nan = bool(c1[:, r, 1].any())
                tops[r] = dyadic.check_top(float("nan") if nan else float(c1[:, r, 3].max()))
        except Pp1Error as exc:
            out[r] = exc
            continue
        (sparse if spec.support else dense).append(r)
    at = _Position(x, c1, tops, specs, draws, probs, plan, coord)
    for r, got in zip(dense, _dense_rows(at, dense) if dense else [], strict=True):
        out[r] = got
    for r, got in zip(sparse, _sparse_rows(at, sparse) if sparse else [], strict=True):
        out[r] = got
    for r, o in enumerate(out):
        code = int(c1[0, r, 6])
        if code and isinstance(o, BuiltRow):  # the draw's error counts after the row's own
            out[r] = Pp1Error(ErrorCode(code), "the proposal draw failed on rank 0")
    assert all(o is not None for o in out)
    return [o for o in out if o is not None]


def _first_words(
    x: Float64Array,
    x32: npt.NDArray[np.float32],
    specs: Sequence[RowSpec],
    probs: bool,
    plan: TreePlan,
    local: Float64Array,
) -> None:
    """This rank's words of a position's first collective (``local``, in place)."""
    if not x.shape[1]:  # an empty range: no maximum, nothing to offer but "nothing"
        local[:, 3] = -np.inf
        local[:, 4] = plan.vocab
        for r, spec in enumerate(specs):
            if spec.temperature != 0 and spec.support:
                _offer(x[r], x32[r] if probs else None, spec, probs, plan, local[r, _C1:])
        return
    with np.errstate(invalid="ignore", over="ignore"):
        highest: Float64Array = x.max(axis=1)  # NaN propagates: one pass finds both
        if probs:
            lowest = x.min(axis=1)
            local[:, 1] = ~(np.isfinite(highest) & np.isfinite(lowest))
            local[:, 2] = lowest < 0
        else:
            for bad in np.flatnonzero(np.isnan(highest)):
                local[bad, 1] = 1.0
                highest[bad] = np.where(np.isnan(x[bad]), -np.inf, x[bad]).max()
            local[:, 2] = highest == np.inf
    local[:, 3] = highest
    for r, spec in enumerate(specs):
        if spec.temperature == 0:  # greedy: the first maximal value (a refused row's is moot)
            local[r, 4] = plan.start + int(x[r].argmax())
        elif spec.support:
            _offer(x[r], x32[r] if probs else None, spec, probs, plan, local[r, _C1:])
        elif probs and local[r, 1] == 0:
            local[r, _C1 : _C1 + plan.slots] = plan.cover_totals(x[r : r + 1])[0]


def _offer(
    x: Float64Array,
    x32: npt.NDArray[np.float32] | None,
    spec: RowSpec,
    probs: bool,
    plan: TreePlan,
    out: Float64Array,
) -> None:
    """A sparse row's offer into ``out``: k values, global IDs (-1: none), largest left out."""
    k = spec.support
    out[: 2 * k] = -1.0
    if probs:
        assert x32 is not None
        ids = _top_weights(x, x32, k)
    else:
        out[:k] = -np.inf
        ids, out[2 * k] = _top_logits(x, k, spec.temperature)
    out[: ids.size] = x[ids]
    out[k : k + ids.size] = ids + plan.start


def _top_weights(w: Float64Array, w32: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.intp]:
    """The indices of a row's k largest positive weights, ties to the lowest index."""
    fast = getattr(dyadic, "_fastq", None)
    if fast is not None and w32.size:
        cap = max(64 * k, 4096)
        found = np.empty(cap, dtype=np.int64)
        work = np.empty((w32.size + 63) // 64 + 2 * cap, dtype=np.uint32)
        count, status = fast.topk_f32(np.ascontiguousarray(w32), k, found, work)
        if not status and count >= 0:
            return found[:count].astype(np.intp)
    with np.errstate(invalid="ignore"):
        ids = dyadic.largest_indices(w, k)
        return ids[w[ids] > 0]


def _top_logits(x: Float64Array, k: int, temperature: float) -> tuple[npt.NDArray[np.intp], float]:
    """Some k indices of a row's largest logits and the largest logit left out."""
    n = x.size
    if n <= k:
        return np.arange(n), -np.inf
    fast = getattr(dyadic, "_fastq", None)
    top = float(x.max())
    if fast is not None and np.isfinite(top) and np.isfinite(temperature) and temperature > 0:
        cap = max(64 * k, 4096)
        cand = np.empty(cap, dtype=np.int64)
        count, x_out = fast.sparse_candidates(x, top, _SPARSE_BUCKETS / temperature, k, 0, cand)
        if count >= k:
            ids = cand[:count]
            if count > k:
                part = np.argpartition(x[ids], count - k - 1)
                x_out = max(float(x_out), float(x[ids[part[count - k - 1]]]))
                ids = ids[part[count - k :]]
            return ids.astype(np.intp), float(x_out)
    part = np.argpartition(x, n - k - 1)
    return part[n - k :], float(x[part[n - k - 1]])


# The compiled candidates pass buckets logits by their distance below the maximum in
# 1/16 temperature units (pp1wire.q.dyadic.sparse_row_from_logits).
_SPARSE_BUCKETS: Final = 16.0


def _check_probs(words: Float64Array) -> None:
    """A probabilities row's refusals from every rank's flags, in one process's order."""
    if words[:, 1].any():
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "weights contain NaN or infinity")
    if words[:, 2].any():
        raise ConstructionError(ErrorCode.WEIGHT_NEGATIVE, "weights contain negative values")
    if not float(words[:, 3].max()) > 0:
        raise ConstructionError(ErrorCode.ZERO_MASS, "weights have zero total mass")


def _greedy(words: Float64Array, support: int, probs: bool, plan: TreePlan) -> BuiltRow:
    """The greedy row from every rank's first words, or one process's refusal of it."""
    top = float(words[:, 3].max())
    if probs:
        _check_probs(words)
    elif words[:, 1].any() or words[:, 2].any():
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "greedy logits must be finite or -inf")
    elif top == -np.inf:
        raise ConstructionError(ErrorCode.ZERO_MASS, "every logit is -inf")
    token = int(min(w[4] for w in words if w[3] == top))
    return _point(token, support, plan)


def _shifted_exp(
    x: Float64Array, top: float, temperature: float, out: Float64Array | None = None
) -> Float64Array:
    # A logit far below the top over a small temperature overflows to -inf: weight 0.
    with np.errstate(over="ignore"):
        return dyadic.shifted_exp(x, top, temperature, out=out)


def _point(token: int, support: int, plan: TreePlan) -> BuiltRow:
    """The greedy row: all of the mass at ``token``, in this rank's range if it owns it."""
    mine = plan.start <= token < plan.stop
    if support:
        ids = np.array([token] if mine else [], dtype=np.int32)
        return BuiltRow(token, np.array([M] if mine else [], dtype=np.int64), ids, M)
    counts = np.zeros(plan.stop - plan.start, dtype=np.int64)
    if mine:
        counts[token - plan.start] = M
    return BuiltRow(token, counts, None, M)


# -- dense rows -------------------------------------------------------------------------


class _Position(NamedTuple):
    """A position's rows, every rank's first words (``c1``) and each logits row's maximum."""

    x: Float64Array
    c1: Float64Array
    tops: dict[int, float]
    specs: Sequence[RowSpec]
    draws: list[int]
    probs: bool
    plan: TreePlan
    coord: GroupCoordinator


def _dense_rows(at: _Position, rows: list[int]) -> list[BuiltRow | Pp1Error]:
    """The dense rows of a position: weights and canonical totals, allocation, draw."""
    x, c1, tops, specs, draws, probs, plan, coord = at
    n = x.shape[1]
    w: Float64Array
    if probs:
        w = x[rows]  # indexing by a list copies once
        covers = c1[:, rows, _C1 : _C1 + plan.slots]
        mine = covers[plan.rank].sum(axis=1)
    else:
        w = np.empty((len(rows), n), dtype=np.float64)
        for j, r in enumerate(rows):
            _shifted_exp(x[r], tops[r], specs[r].temperature, w[j])
        local = plan.cover_totals(w)
        mine = local.sum(axis=1)
        covers = gather(local, coord)
    with np.errstate(over="ignore", invalid="ignore"):
        totals = np.asarray(plan.totals(covers)[plan.root], dtype=np.float64)
    out: list[BuiltRow | Pp1Error | None] = [None] * len(rows)
    usable: list[int] = []
    for j, total in enumerate(totals):
        # Overflow is the only failure of a logits row's total (its top weighs exp(0) = 1).
        if not np.isfinite(total):
            out[j] = ConstructionError(
                ErrorCode.WEIGHT_NON_FINITE, "total weight overflows binary64"
            )
        elif not total > 0:
            out[j] = ConstructionError(ErrorCode.ZERO_MASS, "weights have zero total mass")
        else:
            usable.append(j)
    if usable:
        built = _allocate_and_draw(
            w[usable], totals[usable], mine[usable], [draws[rows[j]] for j in usable], plan, coord
        )
        for j, got in zip(usable, built, strict=True):
            out[j] = got
    assert all(o is not None for o in out)
    return [o for o in out if o is not None]


class _Scratch(threading.local):
    """Per-thread scratch of the dense rows' remainders and bucket keys."""

    def __init__(self) -> None:
        self.rem = np.empty(0, dtype=np.float64)
        self.keys = np.empty(0, dtype=np.int64)


_SCRATCH = _Scratch()


def _scratch(count: int, n: int) -> tuple[Float64Array, Int64Array]:
    """This thread's ``[count, n]`` remainders and ``[n]`` keys (overwritten by its next call)."""
    own = _SCRATCH
    if own.rem.size < count * n:
        own.rem = np.empty(count * n, dtype=np.float64)
    if own.keys.size < n:
        own.keys = np.empty(n, dtype=np.int64)
    return own.rem[: count * n].reshape(count, n), own.keys[:n]


def _histogram(rem: Float64Array, keys: Int64Array) -> Int64Array:
    """A row's remainders counted by bucket (``keys``: scratch of the row's length)."""
    np.right_shift(rem.view(np.int64), 52 - _SUB_BITS, out=keys)
    raw = np.bincount(keys, minlength=_KEY_LOW + _BUCKETS)
    hist: Int64Array = raw[_KEY_LOW : _KEY_LOW + _BUCKETS].astype(np.int64)
    hist[0] += int(raw[:_KEY_LOW].sum())
    return hist


def _bucket_keys(rem: Float64Array) -> npt.NDArray[np.int64]:
    """Each remainder's bucket (monotone in the value; bucket 0 below 2**-128)."""
    keys: npt.NDArray[np.int64] = rem.view(np.int64) >> (52 - _SUB_BITS)
    keys -= _KEY_LOW
    np.maximum(keys, 0, out=keys)
    return keys


def _bucket_floor(bucket: int) -> float:
    """The least binary64 value in ``bucket`` (0.0 for bucket 0)."""
    if bucket <= 0:
        return 0.0
    bits = np.array([(bucket + _KEY_LOW) << (52 - _SUB_BITS)], dtype=np.int64)
    return float(bits.view(np.float64)[0])


class _ShardedRows:
    """:func:`pp1wire.q.dyadic.allocate_with`'s pieces for a position's dense rows over the
    ranks: one collective, one more when a rank's guess of a threshold's bucket missed."""

    where = staticmethod(np.where)

    def __init__(
        self, w: Float64Array, totals: Float64Array, mine: Float64Array, plan: TreePlan,
        coord: GroupCoordinator,
    ) -> None:  # fmt: skip
        self.w, self.totals, self.mine, self.plan, self.coord = w, totals, mine, plan, coord
        self.n = plan.vocab
        rows, width = w.shape
        # The counts travel in the rows (fresh); the rest is scratch.
        self.counts = np.empty((rows, width), dtype=np.int32)  # counts never exceed 2**24
        self.rem, self.keys = _scratch(rows, width)

    def floors(self) -> Int64Array:
        """Every rank's floors, histograms and guesses gathered: the rows' floor sums."""
        count = len(self.w)
        words = np.zeros((count, _WORDS), dtype=np.int64)
        for j in range(count):
            dyadic.floors_and_remainders(self.w[j], float(self.totals[j]), self.counts[j],
                                         self.rem[j])  # fmt: skip
            # A rank's floors sum to at most 2**24 (its shares do, to within rounding): int32.
            floor_sum = int(self.counts[j].sum(dtype=np.int32))
            hist = _histogram(self.rem[j], self.keys)
            words[j, 0] = floor_sum
            words[j, 1 : 1 + _BUCKETS] = hist
            # About the sum of its remainders: a guess, the threshold does not depend on it.
            tickets = float(self.mine[j]) / float(self.totals[j]) * M - floor_sum
            _guess(words[j], hist, self.rem[j], tickets)
        self.gathered = gather(words, self.coord)  # [world, rows, words]
        self.floor_sums: Int64Array = self.gathered[:, :, 0]
        sums: Int64Array = self.floor_sums.sum(axis=0)
        return sums

    def threshold(self, left: Int64Array, live: npt.NDArray[np.bool_]) -> Float64Array:
        """Each live row's threshold, among every rank's remainders in its bucket."""
        hists = self.gathered[:, :, 1 : 1 + _BUCKETS]
        count = len(left)
        self.bucket = np.full(count, -1, dtype=np.int64)
        self.pools: list[list[Float64Array]] = [[] for _ in range(count)]
        missed = []
        for j in np.flatnonzero(live):
            above = np.cumsum(hists[:, j].sum(axis=0)[::-1])  # from the top bucket down
            b = self.bucket[j] = _BUCKETS - 1 - int(np.searchsorted(above, left[j]))
            pool = _guessed(self.gathered[:, j], b)
            if pool is None:
                missed.append(j)
            else:
                self.pools[j] = pool
        if missed:  # one more collective, the same on every rank: the buckets themselves
            width = max(int(hists[:, j, self.bucket[j]].max()) for j in missed)
            offers = np.full((len(missed), width), -1.0, dtype=np.float64)
            for m, j in enumerate(missed):
                ours = _in_buckets(self.rem[j], int(self.bucket[j]), int(self.bucket[j]))
                offers[m, : ours.size] = ours
            exact = gather(offers, self.coord)
            for m, j in enumerate(missed):
                sizes = hists[:, j, self.bucket[j]]
                self.pools[j] = [exact[k, m, : int(sizes[k])] for k in range(self.plan.world)]
        threshold = np.zeros(count, dtype=np.float64)
        self.above_bucket = np.zeros((self.plan.world, count), dtype=np.int64)
        for j in np.flatnonzero(live):
            self.above_bucket[:, j] = hists[:, j, self.bucket[j] + 1 :].sum(axis=1)
            wanted = int(left[j]) - int(self.above_bucket[:, j].sum())  # 1..the bucket's size
            merged = np.concatenate(self.pools[j])
            threshold[j] = np.partition(merged, merged.size - wanted)[merged.size - wanted]
        return threshold

    def above(self, threshold: Float64Array, live: npt.NDArray[np.bool_]) -> Int64Array:
        """Every rank's remainders above each live row's threshold."""
        self.above_k: Int64Array = np.zeros_like(self.above_bucket)
        for j in np.flatnonzero(live):
            self.above_k[:, j] = self.above_bucket[:, j] + [
                int((values > threshold[j]).sum()) for values in self.pools[j]
            ]
        above: Int64Array = self.above_k.sum(axis=0)
        return above

    def assign(
        self, threshold: Float64Array, ties: Int64Array, live: npt.NDArray[np.bool_]
    ) -> Int64Array:
        """This rank's tickets (ties to lower ranks first), every rank's total in ``per_rank``."""
        takes = np.zeros_like(self.above_bucket)
        for j in np.flatnonzero(live):
            equal = [int((values == threshold[j]).sum()) for values in self.pools[j]]
            before = np.cumsum([0, *equal[:-1]])
            takes[:, j] = np.clip(int(ties[j]) - before, 0, equal)
            mine, row = self.rem[j], self.counts[j]
            row += mine > threshold[j]
            take = int(takes[self.plan.rank, j])
            if take:
                row[np.flatnonzero(mine == threshold[j])[:take]] += 1
        self.per_rank: Int64Array = self.floor_sums + np.where(live, self.above_k + takes, 0)
        totals: Int64Array = self.per_rank.sum(axis=0)
        return totals


def _allocate_and_draw(
    w: Float64Array,
    totals: Float64Array,
    mine: Float64Array,
    draws: list[int],
    plan: TreePlan,
    coord: GroupCoordinator,
) -> list[BuiltRow | Pp1Error]:
    """Dense counts (:func:`pp1wire.q.dyadic.allocate_with` over every rank) and the draw."""
    rows = _ShardedRows(w, totals, mine, plan, coord)
    status = dyadic.allocate_with(rows)
    out: list[BuiltRow | Pp1Error] = []
    picks = np.full((len(w), 2), -1, dtype=np.int64)
    for j, code in enumerate(status):
        if code:
            out.append(ConstructionError(*dyadic.ROW_STATUS_ERRORS[int(code)]))
            continue
        out.append(BuiltRow(-1, rows.counts[j], None, 0))
        # The draw: the rank whose slice of the cumulative counts holds it finds the ID.
        picks[j] = pick(rows.counts[j], [int(v) for v in rows.per_rank[:, j]], draws[j], plan)
    found = reduce_max(picks, coord)
    for j, built in enumerate(out):
        if isinstance(built, BuiltRow):
            out[j] = BuiltRow(int(found[j, 0]), built.counts, None, int(found[j, 1]))
    return out


def _guess(words: Int64Array, hist: Int64Array, rem: Float64Array, tickets: float) -> None:
    """This rank's guess of the threshold's bucket, and the remainders around it if they fit."""
    share = max(1, round(tickets)) if np.isfinite(tickets) else 1
    above = np.cumsum(hist[::-1])
    guess = _BUCKETS - 1 - min(int(np.searchsorted(above, share)), _BUCKETS - 1)
    lo, hi = max(0, guess - 1), min(_BUCKETS - 1, guess + 1)
    if int(hist[lo : hi + 1].sum()) > _WINDOW:
        lo = hi = guess
    words[_GUESS], words[_GUESS + 1] = lo, hi
    if int(hist[lo : hi + 1].sum()) > _WINDOW:
        words[_GUESS + 2] = -1  # too many: the bucket will be asked for
        return
    inside = _in_buckets(rem, lo, hi)
    words[_GUESS + 2] = inside.size
    words[_GUESS + 3 : _GUESS + 3 + inside.size] = inside.view(np.int64)


def _in_buckets(rem: Float64Array, lo: int, hi: int) -> Float64Array:
    """The remainders in buckets ``lo..hi``, in index order."""
    low, high = _bucket_floor(lo), _bucket_floor(hi + 1)  # above the last bucket: 1.0
    mask = rem >= low
    mask &= rem < high
    out: Float64Array = rem[mask]
    return out


def _guessed(ranks: Int64Array, bucket: int) -> list[Float64Array] | None:
    """Every rank's remainders in ``bucket`` from their guesses (None: one missed it)."""
    pool: list[Float64Array] = []
    for words in ranks:
        lo, hi, size = (int(v) for v in words[_GUESS : _GUESS + 3])
        if size < 0 or not lo <= bucket <= hi:
            return None
        values = np.ascontiguousarray(words[_GUESS + 3 : _GUESS + 3 + size]).view(np.float64)
        pool.append(values[_bucket_keys(values) == bucket])
    return pool


# -- sparse rows ------------------------------------------------------------------------


def _sparse_rows(at: _Position, rows: list[int]) -> list[BuiltRow | Pp1Error]:
    """The sparse rows of a position, from the first collective's offers (or :func:`_sparse`)."""
    x, c1, tops, specs, draws, probs, plan, coord = at
    out: dict[int, BuiltRow | Pp1Error] = {}
    retry: list[int] = []
    for r in rows:
        k = specs[r].support
        offers = c1[:, r, _C1 : _C1 + 2 * k]
        values, ids = offers[:, :k].reshape(-1), offers[:, k:].reshape(-1)
        keep = ids >= 0
        ids = ids[keep]
        # A logit's weight is computed as the whole row's would be: elementwise.
        w = values[keep] if probs else _shifted_exp(values[keep], tops[r], specs[r].temperature)
        order = np.lexsort((ids, -w))[:k]  # by weight descending, ties to the lowest ID
        if not probs:
            theta = float(w[order[-1]]) if order.size == k else 0.0
            outside = c1[:, r, _C1 + 2 * k]
            left_out = outside[outside > -np.inf]
            if left_out.size:
                bound = float(_shifted_exp(left_out, tops[r], specs[r].temperature).max())
                # The bound of dyadic.sparse_row_from_logits: the offers hold the support
                # when the largest logit left out weighs, times the slack, below the k-th.
                if not (theta >= dyadic._MIN_THETA and bound * dyadic._EXP_SLACK < theta):
                    retry.append(r)
                    continue
        out[r] = _support_row(w[order], ids[order], draws[r], plan)
    if retry:
        weights = {r: _shifted_exp(x[r], tops[r], specs[r].temperature) for r in retry}
        for r, got in zip(retry, _sparse(weights, retry, specs, draws, plan, coord), strict=True):
            out[r] = got
    return [out[r] for r in rows]


def _support_row(
    w: Float64Array, ids: Float64Array, u24: int, plan: TreePlan
) -> BuiltRow | Pp1Error:
    """The sparse row over a chosen support (weights, global IDs), as one process draws it."""
    positive = w > 0
    w, ids = w[positive], ids[positive]
    by_id = np.argsort(ids, kind="stable")
    sub = np.ascontiguousarray(w[by_id])
    chosen = ids[by_id].astype(np.int32)
    try:
        counts = dyadic.builder(sub.size).allocate(sub, tree.total(sub)).astype(np.int64)
        keep = counts > 0
        support = chosen[keep]
        counts = counts[keep]
        at = dyadic.sample(counts, u24)
    except Pp1Error as exc:
        return exc
    mine = (support >= plan.start) & (support < plan.stop)
    return BuiltRow(int(support[at]), counts[mine], support[mine], int(counts[at]))


def _sparse(
    weights: dict[int, Float64Array],
    rows: list[int],
    specs: Sequence[RowSpec],
    draws: list[int],
    plan: TreePlan,
    coord: GroupCoordinator,
) -> list[BuiltRow | Pp1Error]:
    """The global top-k support merged from every rank's own top k (one all-gather)."""
    k = max(specs[r].support for r in rows)
    offer = np.full((len(rows), k, 2), -1.0, dtype=np.float64)
    for j, r in enumerate(rows):
        w = weights[r]
        ids = dyadic.largest_indices(w, specs[r].support) if w.size else np.zeros(0, np.intp)
        ids = ids[w[ids] > 0]
        offer[j, : ids.size, 0] = w[ids]
        offer[j, : ids.size, 1] = ids + plan.start
    offers = gather(offer, coord)
    out: list[BuiltRow | Pp1Error] = []
    for j, r in enumerate(rows):
        pool = offers[:, j].reshape(-1, 2)
        pool = pool[pool[:, 0] > 0]
        # By weight descending, ties to the lowest ID; the k chosen.
        order = np.lexsort((pool[:, 1], -pool[:, 0]))[: specs[r].support]
        out.append(_support_row(pool[order, 0], pool[order, 1], draws[r], plan))
    return out


__all__ = ["BuiltRow", "RowSpec", "construct_rows"]
