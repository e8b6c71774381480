"""``pp1-worker --tp N --vocab-shards N``: the ranks of a vocabulary-sharded worker group.

``pp1-worker --tp N`` starts N ranks with torch's elastic launcher (as
``pp1-spark --tp N`` does); ``torchrun --nproc-per-node N -m pp1wire.apps.worker``
starts them directly. Rank r listens on ``--port`` + r and serves the link of
Spark rank r, declaring shard r of the even layout in HELLO; the ranks draw
every STEP together (:class:`pp1wire.tp.shard_worker.ShardedDrafting`). Only
rank 0 prints the ``listening`` line on stdout (the others on stderr). Torch is
imported only here, so an unsharded worker never needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from datetime import timedelta
from typing import TYPE_CHECKING

from pp1wire.apps import spark_tp
from pp1wire.apps.settings import SettingsError
from pp1wire.q.layout import ShardLayout
from pp1wire.q.proposal import DrafterFn

if TYPE_CHECKING:
    from pp1wire.tp.shard_worker import AfterDraw, ShardedDrafting

AFTER_DRAW: AfterDraw | None = None
"""Fault hook for tests only: set by :mod:`pp1wire.testing.shard_faults`, never by a flag."""


def world_size(args: argparse.Namespace) -> int:
    """The group size, checked against ``--vocab-shards``.

    Raises:
        SettingsError: ``--tp`` and ``--vocab-shards`` differ, or ``--port 0``
            with more than one rank (the ports must be known: rank r uses port + r).
    """
    world = spark_tp.world_size(args)
    if args.vocab_shards != world:
        raise SettingsError(
            f"the worker's --tp {world} and --vocab-shards {args.vocab_shards} must be equal"
        )
    if world > 1 and args.port == 0:
        raise SettingsError("--tp above 1 needs an explicit --port (rank r listens on port + r)")
    return world


def launch(world: int, argv: list[str]) -> int:
    """Start the ranks and wait for them (see :func:`pp1wire.apps.spark_tp.launch`).

    Raises:
        SettingsError: if torch is not installed.
    """
    return spark_tp.launch(world, argv, module="pp1wire.apps.worker")


def join(args: argparse.Namespace, drafter: DrafterFn) -> tuple[ShardLayout, int, ShardedDrafting]:
    """Join the gloo group (``--group-timeout``); this rank's layout, rank and drafting.

    Raises:
        SettingsError: if torch is not installed.
    """
    try:
        import torch.distributed as dist  # noqa: PLC0415

        from pp1wire.tp.shard_worker import ShardedDrafting  # noqa: PLC0415
    except ImportError:
        raise SettingsError("--tp above 1 needs torch: pip install 'pp1wire[tp]'") from None
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.group_timeout))
    layout = ShardLayout.even(args.vocab, dist.get_world_size())
    drafting = ShardedDrafting(
        layout, drafter, match_timeout=args.match_timeout, after_draw=AFTER_DRAW
    )
    return layout, drafting.rank, drafting


def leave(drafting: ShardedDrafting) -> None:
    """Stop the group thread and tear the group down (skipped for a broken group)."""
    import torch.distributed as dist  # noqa: PLC0415

    drafting.stop()
    # A group thread still inside a collective (a peer gone) would hang the teardown:
    # leave it to the process exit.
    if drafting.broken is None and not drafting.running and dist.is_initialized():
        with contextlib.suppress(RuntimeError):
            dist.destroy_process_group()


__all__ = ["join", "launch", "leave", "world_size"]
