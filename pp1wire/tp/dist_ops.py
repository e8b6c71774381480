"""The vocabulary-sharded kernels over a group's ranks, by batch: one fixed set of
collectives per batch, each row's code returned, results bit for bit the unsharded
functions' (``docs/tp.md`` §11); :func:`construct_rows` is re-exported from its module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pp1wire.errors import ErrorCode, Pp1Error, VerifyError
from pp1wire.q import dyadic
from pp1wire.q.dyadic import M
from pp1wire.q.proposal import _host
from pp1wire.tp.coordinator import GroupCoordinator
from pp1wire.tp.dist_common import Float64Array, gather, owners_answer, pick, reduce_max, rows_of
from pp1wire.tp.dist_construct import BuiltRow, RowSpec, construct_rows
from pp1wire.tp.shard_tree import plan_of

_U53 = float(1 << 53)


@dataclass
class TargetRows:
    """Target rows after :func:`normalize_targets`: this rank's values, each row's
    canonical total and code (None: a distribution)."""

    values: list[Float64Array]
    totals: Float64Array
    codes: list[ErrorCode | None]
    start: int

    def at(self, row: int, x: int) -> float:
        """``p(x)`` of ``row`` for an ``x`` this rank owns: bit for bit ``check_target(p)[x]``."""
        return float(self.values[row][x - self.start]) / float(self.totals[row])

    def normalized(self, row: int) -> Float64Array:
        """This rank's range of ``check_target(p)`` for ``row`` (a new array)."""
        out: Float64Array = self.values[row] / self.totals[row]
        return out


def normalize_targets(
    p: Float64Array | Sequence[Float64Array],
    coord: GroupCoordinator,
    failed: Sequence[bool] | None = None,
) -> TargetRows:
    """:func:`pp1wire.q.verify.check_target` of each global row (one all-gather) of ``p``,
    ``[rows, this rank's range]`` or such rows (not copied): a row ``failed`` marks gets
    ``TARGET_FAILED`` on every rank, any other the unsharded function's code.

    Raises:
        ValueError: rows that are not this rank's range, or ``failed`` of another length.
        GroupFailedError: the collective failed.
    """
    plan = plan_of(coord)
    width = plan.stop - plan.start
    xs: list[Float64Array] = [np.ascontiguousarray(row, dtype=np.float64) for row in p]
    rows = len(xs)
    lost = [False] * rows if failed is None else list(failed)
    if len(lost) != rows:
        raise ValueError(f"{len(lost)} failure flags for {rows} rows")
    if any(x.shape != (width,) for x, gone in zip(xs, lost, strict=True) if not gone):
        raise ValueError(f"rank {plan.rank} holds {width} entries per row")
    if not rows:
        return TargetRows([], np.zeros(0), [], plan.start)
    local = np.zeros((rows, 3 + plan.slots), dtype=np.float64)
    for r, x in enumerate(xs):
        if lost[r]:
            local[r, 0] = 1.0
            xs[r] = np.zeros(width)
            continue
        covers = plan.cover_totals(x.reshape(1, -1))[0]
        local[r, 3:] = covers
        with np.errstate(invalid="ignore"):
            low = x.min() if width else 0.0
        # The common case in two read passes; the classifying ones only when something is wrong.
        if not (low >= 0.0 and np.isfinite(covers).all()):
            local[r, 1] = float(not np.isfinite(x).all())
            local[r, 2] = float(bool((x < 0).any()))
    gathered = gather(local, coord)
    totals = plan.totals(gathered[:, :, 3:])[plan.root]
    codes: list[ErrorCode | None] = []
    for r in range(rows):
        if gathered[:, r, 0].any():
            codes.append(ErrorCode.TARGET_FAILED)
        elif gathered[:, r, 1].any():
            codes.append(ErrorCode.TARGET_NON_FINITE)
        elif gathered[:, r, 2].any():
            codes.append(ErrorCode.TARGET_NEGATIVE)
        elif not (totals[r] > 0 and np.isfinite(totals[r])):
            codes.append(ErrorCode.TARGET_ZERO_MASS)
        else:
            codes.append(None)
    return TargetRows(xs, np.asarray(totals, dtype=np.float64), codes, plan.start)


def residual_rows(p: npt.ArrayLike, q: npt.ArrayLike) -> Float64Array:
    """``max(p - q, 0)`` elementwise, with ``q`` the values ``counts / 2**24`` (exact in
    binary64): :func:`pp1wire.q.verify.residual`."""
    r = np.subtract(p, q, dtype=np.float64)
    np.maximum(r, 0.0, out=r)
    return r


def sample_weights_rows(
    weights: npt.ArrayLike, u53s: Sequence[int], coord: GroupCoordinator
) -> list[int | ErrorCode]:
    """:func:`pp1wire.q.verify.sample_weights` of each global row (non-negative, finite)
    with its draw: the ID, or ``EMPTY_RESIDUAL``. Two collectives (none for no rows).

    Raises:
        ValueError: rows that are not ``[len(u53s), this rank's range]``.
        GroupFailedError: a collective failed.
    """
    plan, w = rows_of(weights, coord, np.float64, u53s)
    if not len(u53s):
        return []
    upper = plan.totals(gather(plan.cover_totals(w), coord))
    totals = upper[plan.root]
    local: list[int] = []
    for r, u53 in enumerate(u53s):
        total = float(totals[r])
        if not total > 0:
            local.append(-1)
            continue
        node, t = plan.descend_upper(upper, r, (u53 / _U53) * total)
        local.append(plan.descend_local(w[r], node, t) if plan.owner[node] == plan.rank else -1)
    found = owners_answer(coord, local)
    return [f if float(totals[r]) > 0 else ErrorCode.EMPTY_RESIDUAL for r, f in enumerate(found)]


def sample_counts(
    counts: npt.ArrayLike, u24s: Sequence[int], coord: GroupCoordinator
) -> list[int | ErrorCode]:
    """:func:`pp1wire.q.dyadic.sample` of each global count row with its draw: the ID,
    or ``BAD_DRAW`` / ``MASS_MISMATCH``. Two collectives (none for no rows).

    Raises:
        ValueError, GroupFailedError: as :func:`sample_weights_rows` (``u24s`` its draws).
    """
    plan, c = rows_of(counts, coord, np.int64, u24s)
    if not len(u24s):
        return []
    sums = gather(c.sum(axis=1).astype(np.int64), coord)  # [world, rows]
    local: list[int] = []
    for r, u24 in enumerate(u24s):
        per_rank = [int(v) for v in sums[:, r]]
        usable = 0 <= u24 < M and sum(per_rank) == M
        local.append(pick(c[r], per_rank, u24, plan)[0] if usable else -1)
    out: list[int | ErrorCode] = []
    for r, token in enumerate(owners_answer(coord, local)):
        if not 0 <= u24s[r] < M:
            out.append(ErrorCode.BAD_DRAW)
        elif int(sums[:, r].sum()) != M:
            out.append(ErrorCode.MASS_MISMATCH)
        else:
            out.append(token)
    return out


# -- one row: the batched kernels with a batch of one, the code raised ------------------


def _one(coord: GroupCoordinator, t: torch.Tensor | npt.ArrayLike) -> Float64Array:
    """One rank's piece of one global row, as a batch of one row (``ValueError`` if
    it is not this rank's range)."""
    x: Float64Array = np.asarray(_host(t), dtype=np.float64)
    plan = plan_of(coord)
    if x.ndim != 1 or x.size != plan.stop - plan.start:
        raise ValueError(
            f"rank {coord.rank} holds {x.size} entries, its range has {plan.stop - plan.start}"
        )
    return x.reshape(1, -1)


def counts_from_logits(
    x: torch.Tensor | npt.ArrayLike, temperature: float, coord: GroupCoordinator
) -> torch.Tensor:
    """This rank's piece of :func:`pp1wire.q.dyadic.counts_from_logits` of the global logits.

    Raises:
        ConstructionError: the unsharded function's code, on every rank.
        ValueError: a piece that is not this rank's range.
    """
    if temperature == 0:  # a greedy spec: the dense function has no such temperature
        dyadic.check_temperature(temperature)
    (got,) = construct_rows(_one(coord, x), [RowSpec(temperature)], coord)
    if isinstance(got, Pp1Error):
        raise got
    return torch.from_numpy(got.counts)


def residual_sample(
    p: torch.Tensor | npt.ArrayLike,
    counts: torch.Tensor | npt.ArrayLike,
    u53: int,
    coord: GroupCoordinator,
) -> int:
    """:func:`pp1wire.q.verify.residual_sample` of the global p and q (the same ID on every rank).

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` on every rank if p <= q everywhere.
        ValueError: a piece that is not this rank's range.
    """
    w = residual_rows(_one(coord, p), _one(coord, counts) / M)
    (got,) = sample_weights_rows(w, [u53], coord)
    if isinstance(got, ErrorCode):
        raise VerifyError(got, "distribution has no mass")
    return got


__all__ = [
    "BuiltRow",
    "RowSpec",
    "TargetRows",
    "construct_rows",
    "counts_from_logits",
    "gather",
    "normalize_targets",
    "reduce_max",
    "residual_rows",
    "residual_sample",
    "sample_counts",
    "sample_weights_rows",
]
