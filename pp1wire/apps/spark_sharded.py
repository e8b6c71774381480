"""``pp1-spark --tp N --vocab-shards N``: every rank drives the same requests on its own link to
its worker rank (``docs/protocol.md`` §6.7), the ranks agree on what a link alone decides, and the
group decides each step; a lost link stays lost (its rounds ``CONNECTION_LOST``)."""

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
        """The group session's nonce, drawn by rank 0 and broadcast: every link carries it in
        HELLO, so that the worker ranks match its STEPs only with each other's (§6.7).

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
