"""A rank of a vocabulary-sharded Spark group: group checks, sharded verification, the vote.

Every rank decides each step with :meth:`ShardedVerifyGroup.decide`: the same collectives
in the same order on every rank, failure paths included (``docs/tp.md`` §11).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ErrorCode, VerifyError
from pp1wire.q.dyadic import M
from pp1wire.q.layout import ShardSummary, as_int64, check_group
from pp1wire.q.proposal import MAX_DEPTH, Proposal, QRow
from pp1wire.q.stoprules import StopKind, stop_after
from pp1wire.q.verify import BatchTargetFn, FailedRow, RequestVerifier, RoundResult
from pp1wire.q.walk import Draw, RoundRows, walk
from pp1wire.tp import dist_ops
from pp1wire.tp.coordinator import GroupCoordinator
from pp1wire.tp.fanout import encode_outcome

_KEY = 6  # generation, round, position, prefix digest, depth, context
_REPORT = 4 + _KEY + 3 * MAX_DEPTH  # ok, code, cut, rows, key, tokens, masses, counts
_COUNTS = 4 + _KEY + 2 * MAX_DEPTH  # where the counts at the tokens start


def _report(r: ShardRound) -> list[int]:
    """This rank's words of a round for every rank, as ``_REPORT`` lists them (padded)."""
    p = r.proposal
    if p is None:
        return [int(r.failure is None), int(r.failure or 0)] + [0] * (_REPORT - 2)
    pad = MAX_DEPTH - len(p.rows)
    key = (p.generation, p.round_id, p.position, as_int64(p.digest), p.depth, as_int64(p.context))
    out = [1, 0, int(p.cut or 0), len(p.rows), *key, *p.tokens, *[-1] * pad]
    out += [*(_mass(row) for row in p.rows), *[-1] * pad]
    # Each row's count at its token if this shard holds the token, else 0.
    out += [*(_count_at(row, row.token, p.shard or (0, 0)) for row in p.rows), *[0] * pad]
    return out


def _mass(row: QRow) -> int:
    """The shard's count sum (exact in binary64: multiples of 2**-24 summing to at most 1)."""
    assert row.q32 is not None
    return int(row.q32.sum(dtype=np.float64) * M)


def _count_at(row: QRow, x: int, span: tuple[int, int]) -> int:
    """A shard row's count of the global ID ``x`` (0 outside ``span`` and its support)."""
    assert row.q32 is not None
    start, end = span
    if not start <= x < end:
        return 0
    if row.ids is None:
        return int(float(row.q32[x - start]) * M)
    at = int(np.searchsorted(row.ids, x))
    hit = at < row.ids.size and int(row.ids[at]) == x
    return int(float(row.q32[at]) * M) if hit else 0


def _summary(words: Sequence[int], rows: int) -> ShardSummary:
    """A rank's report read back, cut to its first ``rows`` rows."""
    key = tuple(words[4 : 4 + _KEY])
    tokens = tuple(words[4 + _KEY : 4 + _KEY + rows])
    masses = tuple(words[4 + _KEY + MAX_DEPTH : 4 + _KEY + MAX_DEPTH + rows])
    return ShardSummary(key, tokens, masses)


def _agreed_block(reports: Sequence[Sequence[int]]) -> tuple[int, ErrorCode | None] | None:
    """The rows every rank holds and the fault that cut them (the lowest such rank's), or
    None if the ranks' blocks cannot be one (uncut ones differ, or one holds more)."""
    rows = [int(w[3]) for w in reports]
    whole = [n for w, n in zip(reports, rows, strict=True) if not w[2]]
    if whole and (min(whole) != max(whole) or max(rows) > whole[0]):
        return None
    n = min(rows)
    ended = (ErrorCode(w[2]) for w, k in zip(reports, rows, strict=True) if w[2] and k == n)
    return n, next(ended, None)


def _stop_of(proposal: Proposal, counts: list[int], eos: int | None) -> int | None:
    """After how many rows the proposal's stop rule ends its block, from the counts at
    its tokens; None if none does, or the block is malformed (the key check refuses it)."""
    if not counts:
        return None
    try:
        tokens = proposal.tokens[: len(counts)]
        return stop_after(proposal.stop, proposal.depth, counts, tokens, eos)
    except ValueError:
        return None


@dataclass
class ShardRound:
    """One round of a step on this rank: its shard of a proposal, the code its link gave
    instead, or a target-only round (``proposal`` and ``failure`` None)."""

    verifier: RequestVerifier
    round_id: int
    proposal: Proposal | None = None
    failure: ErrorCode | None = None
    #: Each row's count at its token, from the rank that owns it (set by the group check).
    counts: tuple[int, ...] = ()


class ShardedVerifyGroup:
    """This rank's part in deciding the steps of a vocabulary-sharded Spark group."""

    def __init__(self, coord: GroupCoordinator) -> None:
        """Decide over ``coord`` (its layout gives this rank's range).

        Raises:
            ValueError: if the coordinator has no vocabulary layout.
        """
        if coord.layout is None:
            raise ValueError("a sharded Spark group needs a vocabulary layout")
        self.coord = coord
        self.rank = coord.rank
        self.world = coord.world
        self.start, self.end = coord.layout.range(self.rank)
        self.vocab = coord.layout.vocab_size

    # -- a step ------------------------------------------------------------------------

    def decide(
        self, rounds: Sequence[ShardRound], target: BatchTargetFn
    ) -> list[RoundResult | VerifyError]:
        """Decide and apply a step's rounds (distinct requests, the same on every rank):
        one outcome per round, in order: the lowest rank's refusal or the group check's
        code, ``TARGET_FAILED`` (the verifier poisoned), or the round committed.

        Raises:
            GroupFailedError: a collective failed, or the ranks' outcomes differ
                (nothing of the step was applied on any rank).
        """
        out: list[RoundResult | VerifyError | None] = [None] * len(rounds)
        self._check(rounds, out)
        scores, lost = self._score(rounds, out, target)
        self._verify(rounds, scores, lost, out)
        decided = [o if o is not None else VerifyError(ErrorCode.INTERNAL) for o in out]
        self._vote(decided)
        for r, o in zip(rounds, decided, strict=True):
            if isinstance(o, RoundResult):
                r.verifier.apply(o)
        return decided

    def _check(
        self, rounds: Sequence[ShardRound], out: list[RoundResult | VerifyError | None]
    ) -> None:
        """Step 1: one gather of every rank's reports; a round failing anywhere falls back."""
        if not rounds:
            return
        mine = np.array([_report(r) for r in rounds], dtype=np.int64)
        gathered = dist_ops.gather(mine, self.coord)  # [world, rounds, words]
        for i, r in enumerate(rounds):
            if r.proposal is None and r.failure is None:  # target-only on every rank
                continue
            reports = [[int(v) for v in gathered[k, i].tolist()] for k in range(self.world)]
            refused = next((ErrorCode(w[1]) for w in reports if not w[0]), None)
            block = None if refused else _agreed_block(reports)
            reason = refused or (
                ErrorCode.GROUP_SHARD_MISMATCH
                if block is None
                else check_group([_summary(w, block[0]) for w in reports])
            )
            if reason is not None:
                out[i] = VerifyError(reason, "the group cannot use this proposal")
                continue
            assert r.proposal is not None
            assert block is not None
            rows, cut = block
            # Row j's count at its token: its owner's word (the others sent 0).
            counts = [max(w[_COUNTS + j] for w in reports) for j in range(rows)]
            if r.proposal.stop.kind is not StopKind.FIXED:
                end = _stop_of(r.proposal, counts, r.verifier.eos)
                if end is not None and end < rows:
                    # One rank refuses a row past the rule's stop on arrival: cut there.
                    rows, cut, counts = end, ErrorCode.STOP_RULE_VIOLATED, counts[:end]
            if rows < len(r.proposal.rows) or cut is not r.proposal.cut:
                r.proposal = dataclasses.replace(r.proposal, rows=r.proposal.rows[:rows], cut=cut)
            r.counts = tuple(counts)
            try:
                r.verifier.check_key(r.proposal, counts)
            except VerifyError as exc:  # the same on every rank: same state, same key
                out[i] = exc

    def _score(
        self,
        rounds: Sequence[ShardRound],
        out: list[RoundResult | VerifyError | None],
        target: BatchTargetFn,
    ) -> tuple[list[list[npt.NDArray[np.float64]]], list[bool]]:
        """Step 2: this rank's range of the target per prefix (one call), and lost rounds."""
        wanted: list[tuple[int, int]] = []  # (round, prefixes)
        prefixes: list[Sequence[int]] = []
        for i, r in enumerate(rounds):
            if out[i] is not None:
                continue
            v = r.verifier
            own = v.prefixes(r.proposal) if r.proposal is not None else [v.committed]
            wanted.append((i, len(own)))
            prefixes.extend(own)
        scores: list[list[npt.NDArray[np.float64]]] = [[] for _ in rounds]
        lost = [False] * len(rounds)
        if not prefixes:
            return scores, lost
        empty = np.zeros(0)
        try:
            rows = cast(Sequence[object], target(prefixes))
            if len(rows) != len(prefixes):
                raise ValueError(f"{len(rows)} rows for {len(prefixes)} prefixes")
        except Exception:  # one batched call: every round it scored fails
            for i, count in wanted:
                lost[i] = True
                scores[i] = [empty] * count
            return scores, lost
        at = 0
        for i, count in wanted:
            for row in rows[at : at + count]:
                full = None if isinstance(row, FailedRow) else _as_row(row)
                if full is None or full.shape != (self.vocab,):
                    lost[i] = True  # a per-prefix plugin failed for this round
                    scores[i] = [empty] * count
                    break
                scores[i].append(full[self.start : self.end])
            at += count
        return scores, lost

    def _vote(self, decided: Sequence[RoundResult | VerifyError]) -> None:
        """Step 4: every rank decided exactly this, or the group fails closed."""
        if not decided:
            return
        pairs = [(None, d.code) if isinstance(d, VerifyError) else (d, None) for d in decided]
        gathered = dist_ops.gather(np.stack([encode_outcome(*p) for p in pairs]), self.coord)
        if not (gathered == gathered[0]).all():
            raise self.coord.fail("the ranks' outcomes differ; nothing of the step was committed")

    # -- the step's verification, every round at once ---------------------------------------

    def _verify(
        self,
        rounds: Sequence[ShardRound],
        scores: list[list[npt.NDArray[np.float64]]],
        lost: list[bool],
        out: list[RoundResult | VerifyError | None],
    ) -> None:
        """Step 3 for every round still open: the walk over this rank's range of the rows."""
        todo = [i for i, o in enumerate(out) if o is None]
        jobs: list[RoundRows] = []
        rows: list[npt.NDArray[np.float64]] = []
        failed: list[bool] = []
        for i in todo:
            r = rounds[i]
            v = r.verifier
            if r.proposal is None:
                jobs.append(v.round_rows(r.round_id, first=len(rows)))
            else:
                p = r.proposal
                jobs.append(v.round_rows(p.round_id, p.rows, first=len(rows), counts=r.counts))
            rows.extend(scores[i])
            failed += [lost[i]] * len(scores[i])
        if not jobs:
            return
        ops = ShardRows(self, jobs, rows, failed)
        for i, job, decision in zip(todo, jobs, walk(jobs, ops), strict=True):
            out[i] = rounds[i].verifier.settle(job, decision, ops.failure, commit=False)


class ShardRows:
    """The walk's row operations (:class:`pp1wire.q.walk.RowOps`) over this rank's range:
    each kind batches the whole step into its first call, the same on every rank."""

    eager_draws = False

    def __init__(
        self,
        group: ShardedVerifyGroup,
        jobs: Sequence[RoundRows],
        rows: list[npt.NDArray[np.float64]],
        failed: list[bool],
    ) -> None:
        """The step's rounds over ``rows`` (``failed``: those this rank could not score)."""
        self._group = group
        self._jobs = jobs
        self._rows = rows
        self._failed = failed
        self._p: dist_ops.TargetRows | None = None
        self._values: dict[tuple[int, int], float] | None = None

    def _normalized(self) -> dist_ops.TargetRows:
        if self._p is None:
            self._p = dist_ops.normalize_targets(self._rows, self._group.coord, self._failed)
        return self._p

    def check(self, rows: Sequence[tuple[int, int]]) -> list[bool]:
        """Whether each row is a distribution on every rank (the same answer everywhere)."""
        p = self._normalized()
        return [p.codes[r] is None for r, _ in rows]

    def failure(self, row: int) -> VerifyError:
        """The error of a row the walk refused."""
        code = self._normalized().codes[row]
        assert code is not None
        if code is ErrorCode.TARGET_FAILED:
            return VerifyError(code, "the target failed on a rank")
        return VerifyError(code, "the target is not a distribution")

    def p_at(self, asks: Sequence[tuple[int, int]]) -> list[float]:
        """p(x) of each (row, x), from the rank whose range holds x."""
        if self._values is None:
            p, g = self._normalized(), self._group
            keys = [(job.rows[i], x) for job in self._jobs for i, x in enumerate(job.tokens)]
            # The owner's p(x) where its row is a distribution; -1 elsewhere (MAX).
            local = [
                p.at(r, x) if p.codes[r] is None and g.start <= x < g.end else -1.0 for r, x in keys
            ]
            found = dist_ops.reduce_max(np.asarray(local, dtype=np.float64), g.coord)
            self._values = dict(zip(keys, found.tolist(), strict=True))
        return [self._values[a] for a in asks]

    def draw(self, draws: Sequence[Draw]) -> list[int]:
        """Every draw of the step in one sharded descent (two collectives)."""
        p, g = self._normalized(), self._group
        weights = [p.normalized(d.row) for d in draws]
        for j, d in enumerate(draws):
            if d.q is not None:
                weights[j] = dist_ops.residual_rows(weights[j], self._q(d.q))
        picks = dist_ops.sample_weights_rows(np.stack(weights), [d.u53 for d in draws], g.coord)
        return [-1 if isinstance(pick, ErrorCode) else pick for pick in picks]

    def _q(self, row: QRow) -> npt.NDArray[np.float64]:
        """This shard's q of a row as binary64 (exact), one per ID of the range."""
        assert row.q32 is not None
        if row.ids is None:
            return row.q32.astype(np.float64)
        start, end = self._group.start, self._group.end
        dense = np.zeros(end - start, dtype=np.float64)
        dense[row.ids.astype(np.int64) - start] = row.q32
        return dense


def _as_row(row: object) -> npt.NDArray[np.float64] | None:
    """A target row as binary64 (None if it is not numeric at all)."""
    try:
        return np.asarray(row, dtype=np.float64)
    except (TypeError, ValueError):
        return None


__all__ = ["ShardRound", "ShardRows", "ShardedVerifyGroup"]
