"""The Spark side as a tensor-parallel group on ``torch.distributed`` (``docs/tp.md`` §2).

Rank 0 publishes validated proposals in attempts; every rank evaluates what it owns and
votes, and a round commits on every rank or on none (the group fails closed, §6).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from pp1wire.errors import ErrorCode, Pp1Error, VerifyError
from pp1wire.q.proposal import Proposal
from pp1wire.q.verify import TARGET_FAILURES, RequestVerifier, RoundResult, batched, verify_batch
from pp1wire.tp import fanout
from pp1wire.tp.coordinator import GroupCoordinator, GroupFailedError
from pp1wire.tp.fanout import Header, Item, Kind


class Faults(Protocol):
    """Fault injection for tests (:mod:`pp1wire.testing.tp_faults`); production passes None."""

    def corrupt_copy(self, rank: int, attempt: int) -> bool:
        """Flip a byte of this rank's received payload before its digest check."""

    def fail_target(self, rank: int, attempt: int) -> bool:
        """Make this rank's evaluations in this attempt fail (asked only when it owns one)."""

    def before_vote(self, rank: int, attempt: int) -> None:
        """Run just before the vote (may sleep past the group timeout, or kill the process)."""


@dataclass
class Decision:
    """How one entry of an attempt ended, the same on every rank: the committed round
    (applied on every rank), or None and ``(rank, reason)`` for every no-vote."""

    header: Header
    result: RoundResult | None
    failures: list[tuple[int, ErrorCode]]

    @property
    def target_failed(self) -> bool:
        """Whether every no-vote was a target failure: the request stops, no fallback."""
        return bool(self.failures) and all(code in TARGET_FAILURES for _, code in self.failures)

    @property
    def reason(self) -> str:
        """The first no-vote's reason, lower-case (``""`` when committed)."""
        return self.failures[0][1].name.lower() if self.failures else ""


@dataclass
class RankReport:
    """One rank's totals, gathered to every rank when the group stops."""

    rank: int
    collectives: int
    attempts: int
    fanout_bytes: int
    fanout_seconds: float
    prefixes_digest: int
    bulk: int


@dataclass
class GroupStats:
    """This rank's counters."""

    attempts: int = 0
    fanout_bytes: int = 0
    fanout_seconds: float = 0.0
    bulk: int = 0  # attempts that broadcast a payload (the others skip it)
    entries: int = 0  # rounds decided (proposals and target-only)
    votes_failed: Counter[str] = field(default_factory=Counter)


VerifierFor = Callable[[Header], RequestVerifier]


class SparkGroup:
    """One rank's side of the Spark TP group, over its :class:`GroupCoordinator` (headers
    and votes on its control group, rows on its device group)."""

    def __init__(
        self,
        coord: GroupCoordinator,
        vocab_size: int,
        *,
        max_batch: int = 8,
        faults: Faults | None = None,
    ) -> None:
        """Join the group (no collective runs here); every rank must pass the same ``max_batch``."""
        self.coord = coord
        self.rank = coord.rank
        self.world = coord.world
        self.device = coord.device
        self.max_payload = fanout.max_payload(vocab_size)
        self.max_batch = max_batch
        self.faults = faults
        self.stats = GroupStats()
        self.held: dict[int, RequestVerifier] = {}

    # -- one attempt, the same on every rank -------------------------------------

    def _attempt(
        self,
        entries: list[Header] | None,
        payload: npt.NDArray[np.uint8] | None,
        verifier_for: VerifierFor,
    ) -> tuple[list[Header], list[Decision]]:
        """One attempt; rank 0 passes its entries and payload, the others None."""
        self.stats.attempts += 1
        attempt = self.stats.attempts
        head = (1 + self.max_batch) * fanout.WORDS
        words = torch.zeros(head + fanout.INLINE // 8, dtype=torch.int64)
        started = time.perf_counter()
        if entries is not None:
            words[:head] = torch.from_numpy(fanout.batch_words(attempt, entries, self.max_batch))
            if payload is not None and payload.size <= fanout.INLINE:
                words.numpy()[head:].view(np.uint8)[: payload.size] = payload
        self.coord.broadcast(words, 0)
        try:
            _, entries = fanout.read_batch(words[:head].numpy(), self.max_batch, self.max_payload)
        except Pp1Error as exc:
            raise self.coord.fail(f"unreadable attempt header: {exc}") from exc
        if not entries:
            return entries, []
        self.stats.entries += len(entries)
        total = sum(h.nbytes for h in entries)
        if total <= fanout.INLINE:  # every rank read the same total: all skip the bulk broadcast
            local = words.numpy()[head:].view(np.uint8)[:total]
            self._account(total, started)
        else:
            local = self._bulk(total, payload, started)
        if total and self.faults is not None and self.faults.corrupt_copy(self.rank, attempt):
            local[len(local) // 2] ^= 0x01

        verifiers = [verifier_for(h) for h in entries]
        self.held.update((h.request, v) for h, v in zip(entries, verifiers, strict=True))
        offsets = np.cumsum([0] + [h.nbytes for h in entries])
        chunks = [local[offsets[i] : offsets[i + 1]] for i in range(len(entries))]
        copies: list[ErrorCode | None] = [
            None if fanout.digest(c) == h.payload_digest else ErrorCode.GROUP_COPY_MISMATCH
            for c, h in zip(chunks, entries, strict=True)
        ]
        mine = np.full((self.max_batch, fanout.WORDS), -1, dtype=np.int64)
        owned = [fanout.owner_of(h.request, self.world) == self.rank for h in entries]
        fail = (
            any(owned) and self.faults is not None and self.faults.fail_target(self.rank, attempt)
        )
        for i, outcome in self._evaluate(entries, chunks, verifiers, owned, copies, fail).items():
            mine[i] = outcome
        outcomes = self.coord.all_gather(torch.from_numpy(mine))

        votes = np.zeros((self.max_batch, fanout.VOTE_WORDS), dtype=np.int64)
        results: list[RoundResult | None] = []
        for i, h in enumerate(entries):
            theirs = outcomes[fanout.owner_of(h.request, self.world)][i].numpy()
            result, owner_reason = fanout.decode_outcome(theirs)
            reason = copies[i] or owner_reason
            if reason is None and result is not None:
                reason = _inapplicable(verifiers[i], result)
            results.append(result)
            votes[i] = [int(reason is None), int(reason or 0), fanout.digest(theirs)]
        if self.faults is not None:
            self.faults.before_vote(self.rank, attempt)
        gathered = self.coord.all_gather(torch.from_numpy(votes))

        decisions = []
        for i, h in enumerate(entries):
            ballots = [[int(v) for v in g[i].tolist()] for g in gathered]
            failures = [
                (r, fanout.code_of(b[1]) or ErrorCode.GROUP_OUTCOME_MISMATCH)
                for r, b in enumerate(ballots)
                if b[0] != 1
            ]
            if not failures and len({b[2] for b in ballots}) != 1:
                failures = [(0, ErrorCode.GROUP_OUTCOME_MISMATCH)]
            decisions.append(Decision(h, None if failures else results[i], failures))
        # A target-only round voted down for anything but its target's failure means
        # the ranks no longer hold the same state: the group cannot go on.
        lost = [
            d
            for d in decisions
            if d.failures and d.header.kind is Kind.TARGET_ONLY and not d.target_failed
        ]
        if lost:
            d = lost[0]
            ranks = ", ".join(f"rank {r}: {c.name}" for r, c in d.failures)
            raise self.coord.fail(
                f"request {d.header.request} round {d.header.round_id}: the target-only "
                f"attempt was voted down ({ranks}); nothing of attempt {attempt} was committed"
            )
        for d, v in zip(decisions, verifiers, strict=True):
            if d.result is None:
                v.discard()
                self.stats.votes_failed[d.reason] += 1
            else:
                v.apply(d.result)
        return entries, decisions

    def _bulk(
        self, total: int, payload: npt.NDArray[np.uint8] | None, started: float
    ) -> npt.NDArray[np.uint8]:
        if payload is not None:
            buf = torch.from_numpy(payload)  # rank 0's packed rows, not copied again
        else:
            buf = torch.empty(total, dtype=torch.uint8)
        buf = buf.to(self.device)
        self.stats.bulk += 1
        self.coord.broadcast(buf, 0, device=True)
        local: npt.NDArray[np.uint8] = buf.cpu().numpy()
        self._account(total, started)
        return local

    def _account(self, total: int, started: float) -> None:
        self.stats.fanout_seconds += time.perf_counter() - started
        self.stats.fanout_bytes += total * (self.world - 1 if self.rank == 0 else 1)

    def _evaluate(
        self,
        entries: list[Header],
        chunks: list[npt.NDArray[np.uint8]],
        verifiers: list[RequestVerifier],
        owned: list[bool],
        copies: list[ErrorCode | None],
        fail: bool,
    ) -> dict[int, fanout.Words]:
        """This rank's outcomes for the entries it owns (one batched target call per
        target plugin), committing nothing."""
        out: dict[int, fanout.Words] = {}
        batches: dict[int, list[tuple[int, Proposal | None]]] = {}
        for i, h in enumerate(entries):
            if not owned[i]:
                continue
            reason = copies[i]
            if reason is None and fail:
                reason = ErrorCode.TARGET_FAILED  # injected (tests only)
            proposal = None
            if reason is None and h.kind is Kind.PROPOSAL:
                try:
                    rows = fanout.unpack_rows(chunks[i], h.rows, h.sparse)
                except Pp1Error as exc:
                    reason = exc.code
                else:
                    proposal = fanout.proposal_of(h, rows)
            if reason is not None:
                out[i] = fanout.encode_outcome(None, reason)
                continue
            batches.setdefault(id(verifiers[i].target), []).append((i, proposal))
        for members in batches.values():
            target = batched(verifiers[members[0][0]].target)
            rounds = [(verifiers[i], p, entries[i].round_id) for i, p in members]
            decided = verify_batch(rounds, target, commit=False)
            for (i, _), d in zip(members, decided, strict=True):
                if isinstance(d, VerifyError):
                    out[i] = fanout.encode_outcome(None, d.code)
                else:
                    out[i] = fanout.encode_outcome(d, None)
        return out

    # -- rank 0 --------------------------------------------------------------------

    def lead(self, items: Sequence[Item]) -> list[Decision]:
        """Publish up to ``max_batch`` rounds of distinct requests as one attempt: one
        decision per item, in order (a committed round already applied on every rank).

        Raises:
            GroupFailedError: a collective failed or a target-only round was
                voted down (nothing of this attempt committed anywhere).
            ValueError: no items or more than ``max_batch``, a request twice, or rows
                mixing dense and sparse.
        """
        # Refused before the attempt is counted: every rank must count the same attempts.
        if not 1 <= len(items) <= self.max_batch:
            raise ValueError(f"{len(items)} rounds: an attempt takes 1..{self.max_batch}")
        if len({i.request for i in items}) != len(items):
            raise ValueError("one round per request per attempt")
        # Every entry's rows packed once, straight into the attempt's payload.
        sizes = [0 if i.proposal is None else fanout.rows_nbytes(i.proposal.rows) for i in items]
        payload = np.empty(sum(sizes), dtype=np.uint8)
        entries, at = [], 0
        for item, size in zip(items, sizes, strict=True):
            if item.proposal is not None:
                chunk, sparse = fanout.pack_rows(item.proposal.rows, payload[at : at + size])
                entries.append(fanout.header_of(item.request, item.proposal, chunk, sparse))
            else:
                entries.append(
                    fanout.target_only_header(item.request, item.verifier, item.round_id)
                )
            at += size
        by_request = {item.request: item.verifier for item in items}
        _, decisions = self._attempt(entries, payload, lambda h: by_request[h.request])
        return decisions

    def lead_stop(self) -> list[RankReport]:
        """End the group's rounds; returns every rank's report (rank order).

        Raises:
            GroupFailedError: a collective failed.
        """
        self._attempt([], None, self._no_verifier)
        return self._reports()

    # -- ranks 1.. -----------------------------------------------------------------

    def follow(self, verifier_for: VerifierFor) -> list[RankReport]:
        """Run rank 0's attempts until it stops the group; ``verifier_for(header)`` gives
        this rank's verifier for the entry, rebuilt to its session and generation.

        Raises:
            GroupFailedError: a collective failed or a target-only round was voted down.
        """
        while self._attempt(None, None, verifier_for)[0]:
            pass
        return self._reports()

    def _no_verifier(self, header: Header) -> RequestVerifier:
        raise GroupFailedError(f"rank {self.rank}: no verifier for request {header.request}")

    def _reports(self) -> list[RankReport]:
        held = [[r, self.held[r].digest & ((1 << 63) - 1)] for r in sorted(self.held)]
        prefixes = fanout.digest(np.array(held, dtype=np.int64))
        mine = torch.tensor(
            [
                self.coord.collectives + 1,  # the gather below included
                self.stats.attempts,
                self.stats.fanout_bytes,
                int(self.stats.fanout_seconds * 1e9),
                prefixes,
                self.stats.bulk,
            ],
            dtype=torch.int64,
        )
        gathered = self.coord.all_gather(mine).tolist()
        return [
            RankReport(r, g[0], g[1], g[2], g[3] / 1e9, g[4], g[5]) for r, g in enumerate(gathered)
        ]


def _inapplicable(verifier: RequestVerifier, result: RoundResult) -> ErrorCode | None:
    """Why this rank could not apply ``result`` to its state (None: it can)."""
    if verifier.poisoned or verifier.finished or result.round_id <= verifier.last_round:
        return ErrorCode.GROUP_OUTCOME_MISMATCH
    if any(not 0 <= t < verifier.vocab_size for t in result.tokens):
        return ErrorCode.GROUP_OUTCOME_MISMATCH
    return None
