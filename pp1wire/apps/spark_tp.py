"""``pp1-spark`` as a tensor-parallel group: launching the ranks, joining, following.

``pp1-spark --tp N`` starts N ranks with torch's elastic launcher (what
``torchrun --standalone`` runs); ``torchrun --nproc-per-node N -m pp1wire.spark``
starts them directly. Each rank runs ``pp1-spark`` with the same flags: rank 0
drives the requests over the worker connection (:class:`pp1wire.apps.spark.Runner`
with a :class:`pp1wire.tp.group.SparkGroup`), the other ranks follow its
attempts. Everything here imports torch lazily, so ``--tp 1`` never needs it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pp1wire.apps.settings import SettingsError
from pp1wire.errors import Pp1Error
from pp1wire.q.rng import derive_seed
from pp1wire.q.verify import RequestVerifier, TargetFn

if TYPE_CHECKING:
    from pp1wire.tp.fanout import Header
    from pp1wire.tp.group import Faults, RankReport, SparkGroup

FAULTS: Faults | None = None
"""Fault hooks for tests only: set by :mod:`pp1wire.testing.tp_faults`, never by a flag."""

GROUP_FAILED_EXIT = 3
"""Exit status of every rank that saw the group fail (nothing of that round committed)."""


def world_size(args: argparse.Namespace) -> int:
    """The group size: ``WORLD_SIZE`` inside a launched rank, else ``--tp``.

    Raises:
        SettingsError: for ``--tp`` below 1, or a ``--tp`` other than 1 that
            disagrees with the launcher's ``WORLD_SIZE``.
    """
    if args.tp < 1:
        raise SettingsError("--tp must be at least 1")
    launched = os.environ.get("WORLD_SIZE")
    if launched is None or not in_launched_rank():
        return int(args.tp)
    world = int(launched)
    if args.tp not in (1, world):
        raise SettingsError(f"--tp {args.tp} but the launcher started {world} ranks")
    return world


def in_launched_rank() -> bool:
    """Whether this process is a rank that torchrun or the elastic launcher started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launch(tp: int, argv: Sequence[str], module: str = "pp1wire.spark") -> int:
    """Start ``tp`` ranks of ``python -m module argv`` (``pp1-spark`` by default) on
    this machine and wait for them.

    Returns 0 when every rank exited 0 (or the launcher was stopped by SIGTERM
    or SIGINT, which it passes on to the ranks and waits for), else the first
    failed rank's exit code (one line on stderr names it).

    Raises:
        SettingsError: if torch is not installed.
    """
    try:
        # torch is an optional extra: imported only when --tp asks for ranks.
        from torch.distributed.elastic.multiprocessing.api import (  # noqa: PLC0415
            SignalException,
        )
        from torch.distributed.elastic.multiprocessing.errors import (  # noqa: PLC0415
            ChildFailedError,
        )
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: PLC0415
    except ImportError:
        raise SettingsError("--tp above 1 needs torch: pip install 'pp1wire[tp]'") from None
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=tp,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    # As torchrun does: one OpenMP thread per rank unless the user chose, so N
    # ranks do not each spin a thread per core (measured: 2.1x slower rounds
    # with two ranks and a worker on two cores).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        elastic_launch(config, sys.executable)("-m", module, *argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"{module}: rank {rank} exited with {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:
        # The launcher has passed the signal on and waited for the ranks: rank 0
        # finished its rounds, wrote its results and stopped the group, as a
        # single rank does on SIGTERM (followers ignore the signal).
        print(f"{module}: stopped by signal {exc.sigval}", file=sys.stderr)
        return 0
    return 0


def join(args: argparse.Namespace, vocab_size: int) -> SparkGroup:
    """Initialize the default gloo group (``--group-timeout``) and this rank's SparkGroup.

    Raises:
        SettingsError: if torch is not installed.
        RuntimeError: from ``torch.distributed`` if the rendezvous fails.
    """
    try:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        from pp1wire.tp.group import SparkGroup  # noqa: PLC0415
    except ImportError:
        raise SettingsError("--tp above 1 needs torch: pip install 'pp1wire[tp]'") from None
    timeout = timedelta(seconds=args.group_timeout)
    dist.init_process_group("gloo", timeout=timeout)
    device_group, device = None, None
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        # Bulk q on the device fabric, control on gloo (the split engines use).
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        device_group = dist.new_group(backend="nccl", timeout=timeout)
    return SparkGroup(
        vocab_size,
        device_group=device_group,
        device=device,
        max_batch=args.concurrency,  # every slot's round can go in one attempt
        faults=FAULTS,
    )


def leave() -> None:
    """Tear the default group down after a clean stop."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_initialized():
        dist.destroy_process_group()


def follow(
    args: argparse.Namespace, group: SparkGroup, target: TargetFn, prompts: list[list[int]]
) -> int:
    """A rank other than 0: follow rank 0's attempts until it stops; returns the exit code."""

    def verifier_for(header: Header) -> RequestVerifier:
        verifier = group.held.get(header.request)
        if verifier is None:
            verifier = RequestVerifier(
                session=header.session,
                seed=derive_seed(args.seed, header.request),
                vocab_size=args.vocab,
                prefix=prompts[header.request % len(prompts)],
                target=target,
                eos=args.eos,
                audit=args.audit,
                generation=header.generation,
            )
        elif (verifier.session, verifier.generation) != (header.session, header.generation):
            # Rank 0 rebuilt its verifier when it (re)opened the slot under this generation.
            verifier.rebuild(verifier.committed, header.generation)
            verifier.session = header.session
        return verifier

    # Rank 0 drives shutdown (it finishes its rounds and stops the group), so a
    # signal only starts a grace period: a follower that left at once would turn
    # a clean stop into a group failure, one that never left could outlive a dead rank 0.
    grace = args.group_timeout + 1.0

    def stop_later(signum: int, _frame: object) -> None:
        timer = threading.Timer(grace, os._exit, [GROUP_FAILED_EXIT])
        timer.daemon = True
        timer.start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_later)
    try:
        group.follow(verifier_for)
    except Pp1Error as exc:
        print(f"pp1-spark rank {group.rank}: {exc}", file=sys.stderr, flush=True)
        return GROUP_FAILED_EXIT
    leave()
    return 0


def summary(reports: list[RankReport], group: SparkGroup) -> dict[str, Any]:
    """The ``tp_*`` keys of rank 0's ``--json`` summary."""
    return {
        "tp": group.world,
        "tp_attempts": group.stats.attempts,
        "tp_votes_failed_by_reason": dict(group.stats.votes_failed),
        "tp_fanout_bytes": group.stats.fanout_bytes,
        "tp_fanout_seconds": group.stats.fanout_seconds,
        "tp_rounds_per_attempt": group.stats.entries / max(group.stats.attempts - 1, 1),
        # None when the group failed before it could compare.
        "tp_prefixes_agree": len({r.prefixes_digest for r in reports}) == 1 if reports else None,
        "tp_ranks": [
            {
                "rank": r.rank,
                "collectives": r.collectives,
                "attempts": r.attempts,
                "fanout_bytes": r.fanout_bytes,
                "fanout_seconds": r.fanout_seconds,
                "bulk": r.bulk,
            }
            for r in reports
        ],
    }
