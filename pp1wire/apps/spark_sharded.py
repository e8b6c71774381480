"""``pp1-spark --tp N --vocab-shards N``: the strategy of a vocabulary-sharded Spark group.

Every rank runs the same round driver (:class:`pp1wire.apps.driver.RoundDriver`)
on the same requests (``docs/protocol.md`` §6.7): rank r connects to the worker
address's port + r, declares shard r of the even layout and the group's nonce
(:meth:`ShardedStrategy.group_nonce`) in HELLO, and sends the same OPEN, STEP
and COMMIT on its link as every other rank. What a link alone
decides — can this request STEP, did its proposal arrive, stop — the ranks
agree on (:meth:`ShardedStrategy.agree`: the first rank's reason wins), and
each step is decided by the group together
(:meth:`pp1wire.tp.shard_spark.ShardedVerifyGroup.decide`).

A link that is lost stays lost (its rank reports every later round as
``CONNECTION_LOST``, so the group decodes target-only; no reconnection in this
mode: the ranks' links could come back at different generations).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

import torch

from pp1wire.apps.driver import Round, Verdict, verdict_of
from pp1wire.q.verify import BatchTargetFn
from pp1wire.tp.coordinator import GroupCoordinator
from pp1wire.tp.shard_spark import ShardedVerifyGroup, ShardRound
from pp1wire.tp.shard_worker import nonce_words
from pp1wire.wire.messages import GROUP_NONCE_SIZE


class ShardedStrategy:
    """Decide steps with a vocabulary-sharded group; agree on every link-local choice."""

    collective = True  # agree is an all-gather: the driver runs it off the event loop

    def __init__(self, coord: GroupCoordinator, target: BatchTargetFn) -> None:
        """This rank's strategy over ``coord`` (which carries the layout).

        Raises:
            ValueError: if the coordinator has no vocabulary layout.
        """
        self.coord = coord
        self.group = ShardedVerifyGroup(coord)
        self.target = target

    def group_nonce(self) -> bytes:
        """The group session's nonce, the same on every rank: rank 0 draws 16 random
        bytes and broadcasts them (one collective). Every link of the group carries it
        in HELLO, so that the worker ranks match its STEPs only with each other's
        (``docs/protocol.md`` §6.7).

        Raises:
            GroupFailedError: the collective failed.
        """
        words = torch.zeros(2, dtype=torch.int64)
        if self.coord.rank == 0:
            words = torch.tensor(
                nonce_words(secrets.token_bytes(GROUP_NONCE_SIZE)), dtype=torch.int64
            )
        shared = self.coord.broadcast(words, 0).tolist()
        return b"".join(int(w).to_bytes(8, "little", signed=True) for w in shared)

    def agree(self, local: list[int]) -> list[int]:
        """Per entry, the first rank's nonzero value (one all-gather).

        Raises:
            GroupFailedError: the collective failed.
        """
        if not local:
            return []
        gathered = self.coord.all_gather(torch.tensor(local, dtype=torch.int64)).tolist()
        return [next((row[i] for row in gathered if row[i]), 0) for i in range(len(local))]

    def decide(self, rounds: list[Round]) -> list[Verdict]:
        """The group's decision on the step (the same on every rank).

        Raises:
            GroupFailedError: a collective failed or the ranks' outcomes differ.
        """
        shard_rounds = [
            ShardRound(r.state.verifier, r.round_id, r.proposal, r.failure) for r in rounds
        ]
        decided = self.group.decide(shard_rounds, self.target)
        verdicts = []
        for r, sr, d in zip(rounds, shard_rounds, decided, strict=True):
            verdict = verdict_of(d)
            if sr.proposal is not r.proposal:  # the group verified fewer rows (a cut link)
                verdict = dataclasses.replace(verdict, block=sr.proposal)
            verdicts.append(verdict)
        return verdicts

    def summary(self) -> dict[str, Any]:
        """The sharded keys of the summary."""
        layout = self.coord.layout
        assert layout is not None
        return {
            "tp": self.coord.world,
            "vocab_shards": layout.shards,
            "shard_ranges": [list(layout.range(i)) for i in range(layout.shards)],
            "tp_collectives": self.coord.collectives,
        }


__all__ = ["ShardedStrategy"]
