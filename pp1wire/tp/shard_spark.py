"""A rank of a vocabulary-sharded Spark group: group checks, sharded verification, the vote.

Spark rank r holds only its link's shard of each proposal and only its range
of the target's probabilities (``docs/protocol.md`` §6.7). Every rank runs the
same program on the same requests (SPMD): for each round it reports what its
shard showed (:class:`ShardReport`), and :meth:`ShardedVerifyGroup.check`
gathers every rank's report, so each rank takes the same decision. A round
that passes is verified by the ranks together — the acceptance test by the
rank that owns the drafted token, the correction and bonus by the sharded
descent of §6.6 — giving exactly the tokens of the unsharded verifier
(:meth:`pp1wire.q.verify.RequestVerifier.verify`) for the same p, q and seed.
A round that fails anywhere is decoded target-only by the group instead. The
vote (:meth:`ShardedVerifyGroup.agree`) compares every rank's outcome before
anything is committed; a disagreement fails the group closed.

Every method runs the same collectives on every rank, in the same order, for
the same inputs (failure paths included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from pp1wire.errors import ErrorCode, VerifyError
from pp1wire.q import dist_ops
from pp1wire.q.dyadic import M
from pp1wire.q.layout import ShardLayout, ShardSummary, as_int64, check_group
from pp1wire.q.proposal import MAX_DEPTH, ExtendedPrefix, Proposal, QRow
from pp1wire.q.rng import Domain, Role, RoundStreams, u53_int_from_block
from pp1wire.q.verify import Outcome, TargetFn, accept_exact

_KEY = 6  # generation, round, position, prefix digest, depth, context
_REPORT = 3 + _KEY + 2 * MAX_DEPTH


@dataclass(frozen=True)
class ShardReport:
    """What this rank's link gave for one round: a checked shard, or the code that refused it."""

    code: ErrorCode | None
    summary: ShardSummary | None = None

    @classmethod
    def of(cls, proposal: Proposal) -> ShardReport:
        """The report of a shard proposal that passed every check of its link."""
        masses = tuple(_mass(row) for row in proposal.rows)
        key = (
            proposal.generation,
            proposal.round_id,
            proposal.position,
            as_int64(proposal.digest),
            proposal.depth,
            as_int64(proposal.context),
        )
        return cls(None, ShardSummary(key, proposal.tokens, masses))

    def words(self) -> list[int]:
        """The fixed-size int64 words every rank gathers."""
        out = [int(self.code is None), 0 if self.code is None else int(self.code)]
        if self.summary is None:
            return out + [0] * (_REPORT - 2)
        s = self.summary
        out += [len(s.tokens), *s.key]
        out += [*s.tokens, *[-1] * (MAX_DEPTH - len(s.tokens))]
        out += [*s.masses, *[-1] * (MAX_DEPTH - len(s.masses))]
        return out


def _mass(row: QRow) -> int:
    assert row.q32 is not None
    return int((row.q32.astype(np.float64) * M).sum())


def _summary(words: list[int]) -> ShardSummary:
    n = words[2]
    key = tuple(words[3 : 3 + _KEY])
    tokens = tuple(words[3 + _KEY : 3 + _KEY + n])
    masses = tuple(words[3 + _KEY + MAX_DEPTH : 3 + _KEY + MAX_DEPTH + n])
    return ShardSummary(key, tokens, masses)


@dataclass(frozen=True)
class Decided:
    """One round's result on every rank: the tokens to commit and how they were chosen."""

    round_id: int
    accepted: int
    tokens: tuple[int, ...]
    extra: int | None
    outcome: Outcome


class ShardedVerifyGroup:
    """This rank's part in deciding rounds of a vocabulary-sharded Spark group."""

    def __init__(self, layout: ShardLayout, group: dist.ProcessGroup | None = None) -> None:
        """Join as this process's rank of ``group`` (the default group if None).

        Raises:
            ValueError: if the layout does not have one range per rank.
        """
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if layout.shards != self.world:
            raise ValueError(f"a layout of {layout.shards} shards for {self.world} ranks")
        self.start, self.end = layout.range(self.rank)
        self.vocab = layout.vocab_size

    # -- collectives ---------------------------------------------------------

    def _gather(self, words: list[int]) -> list[list[int]]:
        t = torch.tensor(words, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.group)
        return [[int(v) for v in o.tolist()] for o in out]

    def _max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0])

    # -- decisions -------------------------------------------------------------

    def check(self, report: ShardReport) -> ErrorCode | None:
        """None if every rank's shard passed and together they form one proposal (§6.7);
        else the reason: the lowest rank's own refusal, or the group check's code."""
        gathered = self._gather(report.words())
        for words in gathered:
            if not words[0]:
                return ErrorCode(words[1])
        return check_group([_summary(w) for w in gathered])

    def common_round(self, local: int) -> int:
        """The largest of every rank's candidate round ID (links may disagree after a loss)."""
        return self._max(local)

    def agree(self, decided: Decided) -> bool:
        """Whether every rank decided exactly this (the vote before any COMMIT)."""
        tokens = list(decided.tokens) + [-1] * (MAX_DEPTH + 1 - len(decided.tokens))
        words = [decided.round_id, decided.accepted, -1 if decided.extra is None else decided.extra]
        gathered = self._gather(words + tokens)
        return all(w == gathered[0] for w in gathered)

    # -- verification ------------------------------------------------------------

    def _p(self, target: TargetFn, context: Sequence[int]) -> torch.Tensor:
        full = np.asarray(target(context), dtype=np.float64)
        if full.shape != (self.vocab,):
            raise VerifyError(ErrorCode.TARGET_FAILED, f"target shape {full.shape}")
        return dist_ops.normalize_target(
            torch.from_numpy(full[self.start : self.end].copy()), self.group
        )

    def _counts(self, row: QRow) -> npt.NDArray[np.float64]:
        """This shard's counts of a row as binary64, one per ID of the range."""
        assert row.q32 is not None
        if row.ids is None:
            return row.q32.astype(np.float64) * M
        dense = np.zeros(self.end - self.start, dtype=np.float64)
        dense[row.ids.astype(np.int64) - self.start] = row.q32.astype(np.float64) * M
        return dense

    def _count_at(self, row: QRow, x: int) -> int:
        """This shard's count of ``x``, which it owns (0 outside a sparse support)."""
        assert row.q32 is not None
        if row.ids is None:
            return int(float(row.q32[x - self.start]) * M)
        at = int(np.searchsorted(row.ids, x))
        hit = at < row.ids.size and int(row.ids[at]) == x
        return int(float(row.q32[at]) * M) if hit else 0

    def _draw(self, p: torch.Tensor, counts: npt.NDArray[np.float64] | None, u53: int) -> int:
        zeros = np.zeros(self.end - self.start, dtype=np.float64)
        c = torch.from_numpy(counts if counts is not None else zeros)
        return dist_ops.residual_sample(p, c, u53, self.group)

    def verify(
        self,
        *,
        seed: int,
        committed: Sequence[int],
        eos: int | None,
        proposal: Proposal,
        target: TargetFn,
    ) -> Decided:
        """The round's tokens from this rank's shard of ``proposal`` (checked by :meth:`check`).

        Raises:
            VerifyError: a target failure (every rank alike) or ``EMPTY_RESIDUAL``.
        """
        streams = RoundStreams(Role.SPARK, seed, proposal.generation, proposal.round_id)
        context = ExtendedPrefix(committed)
        start = len(committed)
        new: list[int] = []
        rid = proposal.round_id
        for i, row in enumerate(proposal.rows):
            p = self._p(target, context)
            x = row.token
            u = u53_int_from_block(streams.block(Domain.ACCEPTANCE, start + i))
            owned = 0  # 1 + the test's result on the rank that owns x, 0 elsewhere
            if self.start <= x < self.end:
                count = self._count_at(row, x)
                owned = 1 + int(accept_exact(u, count, float(p[x - self.start])))
            if self._max(owned) == 2:
                new.append(x)
                context.append(x)
                if x == eos:
                    return Decided(rid, len(new), tuple(new), None, Outcome.EOS)
                continue
            y = self._draw(p, self._counts(row), streams.u53_int(Domain.CORRECTION, start + i))
            return Decided(rid, len(new), (*new, y), y, Outcome.CORRECTION)
        p = self._p(target, context)
        b = self._draw(p, None, streams.u53_int(Domain.CORRECTION, start + len(proposal.rows)))
        return Decided(rid, len(new), (*new, b), b, Outcome.BONUS)

    def target_only(
        self,
        *,
        seed: int,
        generation: int,
        round_id: int,
        committed: Sequence[int],
        target: TargetFn,
    ) -> Decided:
        """One token from the target alone (the fallback), drawn by the group.

        Raises:
            VerifyError: a target failure, on every rank alike.
        """
        streams = RoundStreams(Role.SPARK, seed, generation, round_id)
        p = self._p(target, committed)
        token = self._draw(p, None, streams.u53_int(Domain.TARGET, len(committed)))
        return Decided(round_id, 0, (token,), token, Outcome.TARGET)


__all__ = ["Decided", "ShardReport", "ShardedVerifyGroup"]
