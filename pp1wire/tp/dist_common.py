"""What the vocabulary-sharded kernels share: a batch's rows checked against this rank's
range, and the collectives every kernel ends with (an all-gather, an all-reduce MAX)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from pp1wire.tp.coordinator import MAX, GroupCoordinator
from pp1wire.tp.shard_tree import TreePlan, plan_of

Float64Array = npt.NDArray[np.float64]
Int64Array = npt.NDArray[np.int64]
_S = TypeVar("_S", bound=np.generic)


def rows_of(
    values: npt.ArrayLike,
    coord: GroupCoordinator,
    dtype: type[_S],
    draws: Sequence[int] | None = None,
) -> tuple[TreePlan, npt.NDArray[_S]]:
    """The coordinator's tree plan, and rows of ``dtype`` in its rank's range, each
    contiguous (a slice of wider rows is not copied).

    Raises:
        ValueError: rows that are not this rank's range, or not one per draw in ``draws``,
            or a coordinator without a layout.
    """
    plan = plan_of(coord)
    x: npt.NDArray[_S] = np.asarray(values, dtype=dtype)
    if x.ndim != 2 or x.strides[1] != x.itemsize or x.strides[0] < 0:
        x = np.ascontiguousarray(x)
    if x.ndim != 2 or x.shape[1] != plan.stop - plan.start:
        raise ValueError(
            f"rank {plan.rank} holds {plan.stop - plan.start} entries per row, got shape {x.shape}"
        )
    if draws is not None and x.shape[0] != len(draws):
        raise ValueError(f"{len(draws)} draws for {x.shape[0]} rows")
    return plan, x


def on_device(coord: GroupCoordinator, local: npt.NDArray[Any]) -> torch.Tensor:
    """``local`` as the tensor a collective takes: on the group's CUDA device when its
    ranks have one (the words then travel on NCCL), else the array itself (gloo)."""
    t = torch.from_numpy(np.ascontiguousarray(local))
    return t.to(coord.device) if coord.device.type == "cuda" else t


def gather(local: npt.NDArray[_S], coord: GroupCoordinator) -> npt.NDArray[_S]:
    """Every rank's ``local`` (the same shape everywhere), stacked: ``[world, *shape]``;
    on NCCL when the group's ranks have CUDA devices, else gloo, the same values.

    Raises:
        GroupFailedError: the collective failed.
    """
    out: npt.NDArray[_S] = coord.all_gather(on_device(coord, local)).cpu().numpy()
    return out


def reduce_max(local: npt.NDArray[_S], coord: GroupCoordinator) -> npt.NDArray[_S]:
    """The element-wise maximum of every rank's ``local`` (one all-reduce, as :func:`gather`).

    Raises:
        GroupFailedError: the collective failed.
    """
    out: npt.NDArray[_S] = coord.all_reduce(on_device(coord, local), MAX).cpu().numpy()
    return out


def pick(counts: npt.NDArray[_S], per_rank: list[int], u: int, plan: TreePlan) -> tuple[int, int]:
    """The global ID a draw ``u`` of 24 bits picks from a row's counts and its count, if
    it falls in this rank's slice of their cumulative sum (every rank's total in
    ``per_rank``), else ``(-1, -1)``.

    Every rank counts its whole slice, owner or not (:func:`pp1wire.q.dyadic.sample`'s
    count of cumulative counts at most the draw), so that no rank's time depends on
    the index drawn."""
    before = sum(per_rank[: plan.rank])
    cumulative = np.cumsum(counts, dtype=np.int64)
    at = int(np.count_nonzero(cumulative <= u - before))
    count = int(counts[min(at, counts.size - 1)]) if counts.size else 0
    if not before <= u < before + per_rank[plan.rank]:
        return -1, -1
    return plan.start + at, count


def owners_answer(coord: GroupCoordinator, local: Sequence[int]) -> list[int]:
    """The owners' answers (-1 elsewhere), one all-reduce (MAX); never for an empty batch."""
    return [int(v) for v in reduce_max(np.asarray(local, dtype=np.int64), coord).tolist()]
