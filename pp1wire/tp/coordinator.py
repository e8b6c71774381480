"""One rank's view of its process group: every collective of every Spark and worker group.

A failed collective becomes :class:`GroupFailedError` and the coordinator stays dead
(``docs/tp.md`` §6); collectives run on the group objects, so ranks may share a process.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pp1wire.errors import ErrorCode, Pp1Error
from pp1wire.q.layout import ShardLayout

_T = TypeVar("_T")
Group = Any
"""A process group: ``dist.ProcessGroup`` or a backend (the stubs do not relate the two)."""

ReduceOp = dist.ReduceOp.RedOpType
"""The type of :data:`MAX` and :data:`MIN`."""
MAX = dist.ReduceOp.MAX
MIN = dist.ReduceOp.MIN


class GroupFailedError(Pp1Error):
    """The group cannot continue (a collective failed, or the ranks disagreed in a vote):
    nothing of the round in progress was committed on any rank."""

    def __init__(self, detail: str) -> None:
        """A ``GROUP_FAILED`` error with ``detail``."""
        super().__init__(ErrorCode.GROUP_FAILED, detail)


class GroupCoordinator:
    """Rank, world, groups, device, layout and timeout of one rank, and its collectives."""

    def __init__(
        self,
        group: Group,
        *,
        rank: int,
        world: int,
        timeout: float,
        device_group: Group | None = None,
        device: torch.device | None = None,
        layout: ShardLayout | None = None,
    ) -> None:
        """Wrap ``group`` (rank ``rank`` of ``world``); ``layout``: the vocabulary split of
        a sharded group (one range per rank), None for a replicated one.

        Raises:
            ValueError: a rank outside the world, or a layout without one range per rank.
        """
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        if layout is not None and layout.shards != world:
            raise ValueError(f"a layout of {layout.shards} shards for {world} ranks")
        self.group = group
        self.device_group = device_group if device_group is not None else group
        self.device = device or torch.device("cpu")
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.layout = layout
        self.collectives = 0
        self.dead: str | None = None

    # -- construction ----------------------------------------------------------------

    @classmethod
    def join(
        cls, timeout: float, layout: ShardLayout | None = None, *, device: bool = False
    ) -> GroupCoordinator:
        """The default group from the launcher's environment, wrapped. With ``device`` (the
        same on every rank) and CUDA on every rank (one all-reduce), each rank takes
        ``cuda:LOCAL_RANK`` and a NCCL device group; else the control group serves both.

        Raises:
            RuntimeError: from ``torch.distributed`` if the rendezvous fails.
            GroupFailedError: the ranks could not agree on their devices.
            ValueError: as the constructor.
        """
        delta = timedelta(seconds=timeout)
        dist.init_process_group("gloo", timeout=delta)
        group = dist.distributed_c10d._get_default_group()
        coord = cls(
            group, rank=dist.get_rank(), world=dist.get_world_size(), timeout=timeout, layout=layout
        )
        has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
        if device and coord.everyone(has_cuda):
            local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            coord.device = torch.device("cuda", local)
            torch.cuda.set_device(coord.device)
            coord.device_group = nccl_group(delta)
        coord.collectives = 0  # the group's count of collectives starts with its rounds
        # The objects from before the rounds (torch's modules, some 170,000) are never
        # garbage; full collections walking them were a sixth of a Spark rank's CPU.
        gc.freeze()
        return coord

    @classmethod
    def over_store(
        cls,
        store: Any,
        rank: int,
        world: int,
        timeout: float,
        layout: ShardLayout | None = None,
    ) -> GroupCoordinator:
        """A gloo group of its own over ``store`` (blocks until every rank has joined);
        several in one process, one per thread, form a whole group.

        Raises:
            RuntimeError: from gloo if the ranks do not meet within ``timeout``.
            ValueError: as the constructor.
        """
        group = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout))
        return cls(group, rank=rank, world=world, timeout=timeout, layout=layout)

    def leave(self) -> None:
        """Tear the default group down after a clean stop (nothing for a group of its own)."""
        if dist.is_initialized() and self.group is dist.distributed_c10d._get_default_group():
            dist.destroy_process_group()

    # -- the one place collectives run -------------------------------------------------

    def _run(self, what: str, op: Callable[[], _T]) -> _T:
        if self.dead is not None:
            raise GroupFailedError(self.dead)
        self.collectives += 1
        try:
            return op()
        except (RuntimeError, ValueError) as exc:  # gloo timeouts and dead peers raise these
            self.dead = (
                f"rank {self.rank}: {what} failed, the process group is unusable: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"
            )
            raise GroupFailedError(self.dead) from exc

    def fail(self, detail: str) -> GroupFailedError:
        """Mark the group dead for a reason found outside a collective (a vote that
        disagrees, an unreadable header); returns the error to raise."""
        if self.dead is None:
            self.dead = f"rank {self.rank}: {detail}"
        return GroupFailedError(self.dead)

    def broadcast(self, t: torch.Tensor, src: int = 0, *, device: bool = False) -> torch.Tensor:
        """``t`` from rank ``src`` on every rank, in place (the device group with ``device``).

        Raises:
            GroupFailedError: the collective failed (or the group already had).
        """
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        group = self.device_group if device else self.group
        self._run("broadcast", lambda: group.broadcast([t], opts).wait())
        return t

    def _group_for(self, t: torch.Tensor) -> Group:
        """The device group for a CUDA tensor (one the group can carry), else the control one."""
        if t.device.type != "cuda":
            return self.group
        if self.device.type != "cuda":
            raise ValueError("a CUDA tensor, but this group's ranks have no device group")
        return self.device_group

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (the same shape everywhere), stacked in rank order, on ``t``'s device.

        Raises:
            GroupFailedError: the collective failed.
            ValueError: a CUDA tensor on a coordinator without a CUDA device.
        """
        t = t.contiguous()
        group = self._group_for(t)
        out = [torch.empty_like(t) for _ in range(self.world)]
        self._run("all-gather", lambda: group.allgather([out], [t]).wait())
        return torch.stack(out)

    def all_reduce(self, t: torch.Tensor, op: ReduceOp = MAX) -> torch.Tensor:
        """``t`` reduced over the group (a new tensor on ``t``'s device; ``t`` is unchanged).

        Raises:
            GroupFailedError: the collective failed.
            ValueError: as :meth:`all_gather`.
        """
        out = t.clone()
        group = self._group_for(out)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        self._run("all-reduce", lambda: group.allreduce([out], opts).wait())
        return out

    # -- small forms ------------------------------------------------------------------------

    def everyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (one all-reduce).

        Raises:
            GroupFailedError: the collective failed.
        """
        out = self.all_reduce(torch.tensor([int(flag)], dtype=torch.int64), MIN)
        return bool(out[0])


BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
"""Makes a NCCL group's ``wait()`` block and raise at its timeout (read when it is made)."""


def nccl_group(timeout: timedelta) -> Group:
    """A NCCL group of every rank whose collectives fail the way gloo's do: in
    blocking-wait mode (unless the environment chose), a timeout raises instead of
    NCCL's watchdog ending the process (``docs/tp.md`` §6).

    Raises:
        RuntimeError: from ``torch.distributed`` if the group cannot be made.
    """
    os.environ.setdefault(BLOCKING_WAIT, "1")
    return dist.new_group(backend="nccl", timeout=timeout)


__all__ = [
    "BLOCKING_WAIT",
    "MAX",
    "MIN",
    "GroupCoordinator",
    "GroupFailedError",
    "ReduceOp",
    "nccl_group",
]
