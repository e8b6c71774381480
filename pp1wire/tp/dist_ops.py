"""The vocabulary-sharded kernels across the ranks of a ``torch.distributed`` group.

Rank ``r`` holds the contiguous slice of the global vocabulary that its
coordinator's layout gives it (any sizes, empty ones included). Every function
runs the same collectives, with the same fixed shapes, on every rank and in
the same order whatever the data (failure paths included: refusals are
decided from all-reduced flags, so every rank raises the same error after the
same collectives). The results equal :mod:`pp1wire.q.sharding` and the
unsharded numpy kernels (``docs/protocol.md`` §6.6); the rank-local work is
:mod:`pp1wire.q.torch_ops` on the shard's own device.

Every collective goes through the rank's
:class:`~pp1wire.tp.coordinator.GroupCoordinator` (a failure is the group's
``GROUP_FAILED``); its layout is static, so no kernel gathers shard sizes.
"""

from __future__ import annotations

import numpy as np
import torch

from pp1wire.errors import ConstructionError, ErrorCode, ValidationError, VerifyError
from pp1wire.q import dyadic, torch_ops, tree
from pp1wire.q.torch_ops import M
from pp1wire.tp.coordinator import MAX, SUM, GroupCoordinator, ReduceOp

_U53 = float(1 << 53)


class Layout:
    """Where this rank's shard sits in the global vocabulary: the coordinator's static
    layout (no collective), and the collectives the kernels run through it."""

    def __init__(self, coord: GroupCoordinator, local_size: int, device: torch.device):
        """This rank's range of ``coord.layout``.

        Raises:
            ValueError: if the coordinator has no layout, or ``local_size`` is not
                the size of this rank's range.
        """
        if coord.layout is None:
            raise ValueError("the sharded kernels need a coordinator with a vocabulary layout")
        self.coord = coord
        self.device = device
        self.world = coord.world
        self.rank = coord.rank
        self.start, self.stop = coord.layout.range(coord.rank)
        if self.stop - self.start != local_size:
            raise ValueError(
                f"rank {coord.rank} holds {local_size} entries, its range has "
                f"{self.stop - self.start}"
            )
        self.total_size = coord.layout.vocab_size
        self.depth = tree.depth_for(self.total_size)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (same shape on all ranks), stacked in rank order."""
        return self.coord.all_gather(t)

    def all_reduce(self, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """``t`` reduced over the group (a new tensor)."""
        return self.coord.all_reduce(t, op)

    def flags(self, *local: bool) -> list[bool]:
        """Each flag OR-ed over the group (one all-reduce, the same on every rank)."""
        return self.coord.flags(*local)


class _Tree:
    """The canonical tree across the group: cover nodes local, the rest shared."""

    def __init__(self, values: torch.Tensor, layout: Layout):
        depth = layout.depth
        stop = layout.stop if layout.rank < layout.world - 1 else 1 << depth
        self.local: dict[tuple[int, int], list[torch.Tensor]] = {}
        slots = 2 * (depth + 1)  # a range has at most 2 cover nodes per level
        rows = torch.full((slots, 3), -1.0, dtype=torch.float64, device=layout.device)
        for n, (level, index) in enumerate(tree.cover(layout.start, stop, depth)):
            first = (index << level) - layout.start
            block = values[first : first + (1 << level)]
            padded = torch.zeros(1 << level, dtype=torch.float64, device=values.device)
            padded[: block.numel()] = block
            levels = torch_ops.tree_levels(padded)
            self.local[(level, index)] = levels
            rows[n, 0], rows[n, 1], rows[n, 2] = level, index, levels[-1][0]
        gathered = layout.all_gather(rows).reshape(-1, 3).cpu().tolist()
        self.owner: dict[tuple[int, int], int] = {}
        self.upper: dict[tuple[int, int], float] = {}
        for n, (level, index, value) in enumerate(gathered):
            if level >= 0:
                node = (int(level), int(index))
                self.owner[node] = n // slots
                self.upper[node] = value
        for level in range(depth):
            for index in sorted(i for (lv, i) in list(self.upper) if lv == level):
                if index & 1 or (level + 1, index >> 1) in self.upper:
                    continue
                right = self.upper.get((level, index + 1))
                if right is not None:
                    self.upper[(level + 1, index >> 1)] = self.upper[(level, index)] + right
        self.depth = depth
        self.layout = layout

    @property
    def total(self) -> float:
        return self.upper[(self.depth, 0)]

    def descend(self, t: float) -> int:
        """The global index reached (an all-reduce shares the owner's answer)."""
        level, index = self.depth, 0
        while (level, index) not in self.owner:
            a, b = self.upper[(level - 1, 2 * index)], self.upper[(level - 1, 2 * index + 1)]
            right = b > 0.0 and (a == 0.0 or t >= a)
            t = t - a if right else t
            level, index = level - 1, 2 * index + int(right)
        found = -1
        if self.owner[(level, index)] == self.layout.rank:
            levels = self.local[(level, index)]
            target = torch.tensor(t, dtype=torch.float64, device=levels[0].device)
            found = (index << level) + int(torch_ops.descend(levels, target))
        result = torch.tensor([found], dtype=torch.int64, device=self.layout.device)
        return int(self.layout.all_reduce(result, MAX)[0])


def _weights_checked(w: torch.Tensor, layout: Layout, tree_: _Tree) -> float:
    nonfinite, negative = layout.flags(
        bool((~torch.isfinite(w)).any()), bool((w < 0).any()) if w.numel() else False
    )
    if nonfinite:
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "weights contain NaN or infinity")
    if negative:
        raise ConstructionError(ErrorCode.WEIGHT_NEGATIVE, "weights contain negative values")
    total = tree_.total
    if not total > 0.0:
        raise ConstructionError(ErrorCode.ZERO_MASS, "weights have zero total mass")
    if total == float("inf"):
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "total weight overflows binary64")
    return total


def _largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest values of ``x`` (in no order).

    On the CPU a linear-time partition (numpy's introselect): ``torch.topk`` with
    a k of tens of thousands was the largest cost of a sharded row (5.8 of 27 ms
    at 64,640 entries per rank). The values are the same either way.
    """
    if x.device.type != "cpu":
        return torch.topk(x, k).values
    if k == 0:
        return x[:0]
    return torch.from_numpy(np.partition(x.numpy(), x.numel() - k)[x.numel() - k :])


def _kth_smallest(x: torch.Tensor, k: int) -> float:
    """The value of rank ``k`` (0-based) in ascending order (a partition on the CPU)."""
    if x.device.type != "cpu":
        return float(torch.kthvalue(x, k + 1).values)
    return float(np.partition(x.numpy(), k)[k])


def _allocate(w: torch.Tensor, total: float, layout: Layout) -> torch.Tensor:
    floors, rem = torch_ops.floors_and_remainders(
        w, torch.tensor(total, dtype=torch.float64, device=w.device)
    )
    summed = layout.all_reduce(floors.sum().reshape(1), SUM)
    remaining = M - int(summed[0])
    if not 0 <= remaining < layout.total_size:
        raise ConstructionError(ErrorCode.ALLOCATION_INCONSISTENT, f"{remaining} tickets left over")
    if remaining:
        offer = torch.full((remaining,), -1.0, dtype=torch.float64, device=w.device)
        best = _largest(rem, min(remaining, rem.numel()))  # values only: ties do not matter
        offer[: best.numel()] = best
        offers = layout.all_gather(offer).reshape(-1)
        threshold = _kth_smallest(offers, offers.numel() - remaining)
        above = rem > threshold
        ties = rem == threshold
        counts = (
            layout.all_gather(torch.stack([above.sum(), ties.sum()]).to(torch.int64)).cpu().tolist()
        )
        if not threshold > 0.0:
            raise ConstructionError(
                ErrorCode.ALLOCATION_INCONSISTENT, "tickets left over for zero remainders"
            )
        ties_left = remaining - sum(c[0] for c in counts) - sum(c[1] for c in counts[: layout.rank])
        take = max(0, min(ties_left, counts[layout.rank][1]))
        floors = floors + above.to(torch.int64)
        tie_ids = torch.nonzero(ties).reshape(-1)[:take]
        floors = floors.index_add(0, tie_ids, torch.ones_like(tie_ids))
    check = layout.all_reduce(floors.sum().reshape(1), SUM)
    if int(check[0]) != M:
        raise ConstructionError(ErrorCode.ALLOCATION_INCONSISTENT, "allocation does not sum to M")
    return floors


def counts_from_weights(w: torch.Tensor, coord: GroupCoordinator) -> torch.Tensor:
    """This rank's piece of :func:`pp1wire.q.dyadic.counts_from_weights` of the global vector.

    Raises:
        ConstructionError: the unsharded function's code, on every rank.
    """
    w = w.to(torch.float64)
    layout = Layout(coord, w.numel(), w.device)
    t = _Tree(w, layout)
    return _allocate(w, _weights_checked(w, layout, t), layout)


def _weights_from_logits(x: torch.Tensor, temperature: float, layout: Layout) -> torch.Tensor:
    dyadic.check_temperature(temperature)
    local = (
        x.max() if x.numel() else torch.tensor(float("-inf"), dtype=torch.float64, device=x.device)
    )
    nan = layout.flags(bool(torch.isnan(x).any()))[0]
    top = float(layout.all_reduce(local.reshape(1).to(torch.float64), MAX)[0])
    top = dyadic.check_top(float("nan") if nan else top)
    w = x - top
    if temperature != 1.0:
        w = w / temperature
    return torch.exp(w)


def counts_from_logits(
    x: torch.Tensor, temperature: float, coord: GroupCoordinator
) -> torch.Tensor:
    """This rank's piece of :func:`pp1wire.q.dyadic.counts_from_logits` of the global logits.

    Raises:
        ConstructionError: the unsharded function's code, on every rank.
    """
    x = x.to(torch.float64)
    layout = Layout(coord, x.numel(), x.device)
    w = _weights_from_logits(x, temperature, layout)
    return _allocate(w, _Tree(w, layout).total, layout)


def sparse_counts_from_logits(
    x: torch.Tensor, temperature: float, k: int, coord: GroupCoordinator
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pp1wire.q.dyadic.sparse_counts_from_logits` of the global logits, on every rank.

    Each rank offers its top-k ``(weight, global ID)``; the merge keeps the
    global top-k (ties to the lowest ID), and every rank allocates the same
    counts on that support.

    Raises:
        ConstructionError: the unsharded function's code, on every rank.
    """
    dyadic.check_k(k)
    x = x.to(torch.float64)
    layout = Layout(coord, x.numel(), x.device)
    w = _weights_from_logits(x, temperature, layout)
    offer = torch.full((k, 2), -1.0, dtype=torch.float64, device=w.device)
    local = torch_ops.top_k_ids(w, k)
    offer[: local.numel(), 0] = w[local]
    offer[: local.numel(), 1] = (local + layout.start).to(torch.float64)
    offers = layout.all_gather(offer).reshape(-1, 2).cpu()
    offers = offers[offers[:, 0] > 0]
    # Stable sort by ID, then by weight descending: ties keep the lowest ID first.
    by_id = offers[torch.sort(offers[:, 1], stable=True).indices]
    chosen = by_id[torch.sort(by_id[:, 0], descending=True, stable=True).indices[:k]]
    chosen = chosen[torch.sort(chosen[:, 1]).indices]
    counts = torch_ops.allocate(chosen[:, 0], torch_ops.tree_total(chosen[:, 0]))
    keep = counts > 0
    return chosen[keep, 1].to(torch.int32), counts[keep]


def sample(counts: torch.Tensor, u24: int, coord: GroupCoordinator) -> int:
    """:func:`pp1wire.q.dyadic.sample` of the global counts (the same ID on every rank).

    Raises:
        ValidationError: ``BAD_DRAW`` or ``MASS_MISMATCH``, on every rank.
    """
    if not 0 <= u24 < M:
        raise ValidationError(ErrorCode.BAD_DRAW, f"draw {u24} outside [0, 2**24)")
    layout = Layout(coord, counts.numel(), counts.device)
    totals = layout.all_gather(counts.to(torch.int64).sum().reshape(1))[:, 0].cpu().tolist()
    if sum(totals) != M:
        raise ValidationError(ErrorCode.MASS_MISMATCH, "counts do not sum to M")
    before = sum(totals[: layout.rank])
    found = -1
    if before <= u24 < before + totals[layout.rank]:
        found = layout.start + int(torch_ops.sample(counts, u24 - before))
    result = torch.tensor([found], dtype=torch.int64, device=counts.device)
    return int(layout.all_reduce(result, MAX)[0])


def normalize_target(p: torch.Tensor, coord: GroupCoordinator) -> torch.Tensor:
    """This rank's piece of :func:`pp1wire.q.verify.check_target` of the global target.

    Raises:
        VerifyError: the unsharded function's code, on every rank.
    """
    x = p.to(torch.float64)
    layout = Layout(coord, x.numel(), x.device)
    nonfinite, negative = layout.flags(
        bool((~torch.isfinite(x)).any()), bool((x < 0).any()) if x.numel() else False
    )
    t = _Tree(x, layout)
    if nonfinite:
        raise VerifyError(ErrorCode.TARGET_NON_FINITE, "target has NaN or infinity")
    if negative:
        raise VerifyError(ErrorCode.TARGET_NEGATIVE, "target has a negative probability")
    if not (t.total > 0 and t.total != float("inf")):
        raise VerifyError(ErrorCode.TARGET_ZERO_MASS, "target has no usable mass")
    return x / t.total


def residual_sample(
    p: torch.Tensor, counts: torch.Tensor, u53: int, coord: GroupCoordinator
) -> int:
    """:func:`pp1wire.q.verify.residual_sample` of the global p and q (the same ID on every rank).

    Every rank forms ``max(p - q, 0)`` over every ID it owns; the draw descends
    the canonical tree, finished by the rank owning the node it reaches.

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` on every rank if p <= q everywhere.
    """
    r = torch_ops.residual(p, counts)
    layout = Layout(coord, r.numel(), r.device)
    t = _Tree(r, layout)
    if not t.total > 0:
        raise VerifyError(ErrorCode.EMPTY_RESIDUAL, "distribution has no mass")
    return t.descend((u53 / _U53) * t.total)
