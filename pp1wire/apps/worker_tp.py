"""``pp1-worker --tp N --vocab-shards N``: the ranks of a vocabulary-sharded worker group, rank r
listening on ``--port`` + r for Spark rank r and drawing the matched STEPs with its group; only
rank 0 prints on stdout, and torch is imported only here."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pp1wire.apps import ranks
from pp1wire.apps.settings import SettingsError
from pp1wire.q.layout import ShardLayout
from pp1wire.q.proposal import DrafterFn

if TYPE_CHECKING:
    from pp1wire.tp.shard_worker import AfterDraw, ShardedDrafting

AFTER_DRAW: AfterDraw | None = None  # a test hook, set by pp1wire.testing.shard_faults


def world_size(args: argparse.Namespace) -> int:
    """The group size, checked against ``--vocab-shards`` and the ports.

    Raises:
        SettingsError: ``--tp`` and ``--vocab-shards`` differ, ``--port 0`` with more
            than one rank (the ports must be known: rank r uses port + r), or a
            last rank's port above 65535.
    """
    world = ranks.world_size(args)
    if args.vocab_shards != world:
        raise SettingsError(
            f"the worker's --tp {world} and --vocab-shards {args.vocab_shards} must be equal"
        )
    if world > 1 and args.port == 0:
        raise SettingsError("--tp above 1 needs an explicit --port (rank r listens on port + r)")
    if args.port + world - 1 > 0xFFFF:
        raise SettingsError(
            f"--port {args.port} with --tp {world}: rank {world - 1} would listen on "
            f"{args.port + world - 1}, above 65535"
        )
    return world


def launch(world: int, argv: list[str]) -> int:
    """Start the ranks and wait for them (:func:`pp1wire.apps.ranks.launch`).

    Raises:
        SettingsError: if torch is not installed.
    """
    return ranks.launch(world, argv, module="pp1wire.apps.worker")


def join(args: argparse.Namespace, drafter: DrafterFn) -> tuple[ShardLayout, int, ShardedDrafting]:
    """Join the group (``--group-timeout``); this rank's layout, rank and drafting.

    Raises:
        SettingsError: if torch is not installed.
    """
    ranks.require_torch("--vocab-shards")
    from pp1wire.tp.shard_worker import ShardedDrafting  # noqa: PLC0415 - torch is optional

    layout = ShardLayout.even(args.vocab, ranks.world_size(args))
    coord = ranks.join_group(args.group_timeout, layout)
    drafting = ShardedDrafting(
        coord, drafter, match_timeout=args.match_timeout, after_draw=AFTER_DRAW
    )
    return layout, drafting.rank, drafting


def leave(drafting: ShardedDrafting) -> None:
    """Stop the group thread and tear the group down (skipped for a broken group)."""
    drafting.stop()
    # A group thread still in a collective (a peer gone) would hang it: left to the exit.
    if drafting.broken is None and not drafting.running:
        drafting.coord.leave()
