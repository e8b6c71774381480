"""The Spark side as a tensor-parallel group on ``torch.distributed`` (``docs/tp.md``).

Rank 0 owns the worker connection and validates every proposal as a single
rank does; only a proposal that validated whole is published. Each *attempt*
is the same four collectives on every rank, whatever happens:

1. broadcast the header (``int64[16]``, from rank 0, control group);
2. broadcast the payload (``uint8[max(nbytes, 1)]``, from rank 0, device group);
3. broadcast the owner's outcome (``int64[16]``, from the request's owner);
4. all-gather the vote (``int64[3]`` per rank: ok, reason, outcome digest).

The round commits on every rank only if every rank voted ok with the same
outcome digest; otherwise every rank discards it, and rank 0 follows with a
target-only attempt for the same request. A target-only attempt that fails
its vote, and any collective that raises (timeout, dead peer), ends the group:
:class:`GroupFailedError` on every rank that can still run, nothing committed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from pp1wire.errors import ErrorCode, Pp1Error, VerifyError
from pp1wire.q.proposal import Proposal
from pp1wire.q.verify import RequestVerifier, RoundResult
from pp1wire.tp import fanout
from pp1wire.tp.fanout import Header, Kind


class GroupFailedError(Pp1Error):
    """The group cannot continue: a collective failed or a target-only round was voted down.

    Nothing of the attempt in progress was committed on any rank. A gloo
    group cannot be used after a timeout, so the process should stop (or the
    embedding engine rebuild its group).
    """

    def __init__(self, detail: str) -> None:
        """A ``GROUP_FAILED`` error with ``detail``."""
        super().__init__(ErrorCode.GROUP_FAILED, detail)


class Faults(Protocol):
    """Fault injection for tests (:mod:`pp1wire.testing.tp_faults`); production passes None."""

    def corrupt_copy(self, rank: int, attempt: int) -> bool:
        """Flip a byte of this rank's received payload before its digest check."""

    def fail_target(self, rank: int, attempt: int) -> bool:
        """Make this rank's target evaluation fail (when it owns the attempt's request)."""

    def before_vote(self, rank: int, attempt: int) -> None:
        """Run just before the vote (may sleep past the group timeout, or kill the process)."""


@dataclass
class Decision:
    """How one attempt ended, the same on every rank.

    ``result`` is the committed round (applied to the request's verifier on
    every rank), None when the group voted it away; ``failures`` lists
    ``(rank, reason)`` for every rank that voted no.
    """

    header: Header
    result: RoundResult | None
    failures: list[tuple[int, ErrorCode]]

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


@dataclass
class GroupStats:
    """This rank's counters."""

    collectives: int = 0
    attempts: int = 0
    fanout_bytes: int = 0
    fanout_seconds: float = 0.0
    votes_failed: Counter[str] = field(default_factory=Counter)


VerifierFor = Callable[[Header], RequestVerifier]


class SparkGroup:
    """One rank's side of the Spark TP group.

    ``group`` is the control group (gloo; None = the default group);
    ``device_group`` carries the payload (NCCL with ``device`` a CUDA device,
    else the control group). An engine that already has process groups passes
    them in; ``pp1-spark --tp N`` creates the default one.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        group: dist.ProcessGroup | None = None,
        device_group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        faults: Faults | None = None,
    ) -> None:
        """Join the group (no collective runs here).

        Raises:
            RuntimeError: if ``torch.distributed`` is not initialized.
        """
        self.group = group
        self.device_group = device_group if device_group is not None else group
        self.device = device or torch.device("cpu")
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.max_payload = fanout.max_payload(vocab_size)
        self.faults = faults
        self.stats = GroupStats()
        self.held: dict[int, RequestVerifier] = {}
        self.dead: str | None = None

    # -- collectives ----------------------------------------------------------

    def _global(self, group: dist.ProcessGroup | None, rank: int) -> int:
        return rank if group is None else dist.get_global_rank(group, rank)

    def _run(self, what: str, op: Callable[[], object]) -> None:
        if self.dead is not None:
            raise GroupFailedError(self.dead)
        self.stats.collectives += 1
        try:
            op()
        except (RuntimeError, ValueError) as exc:  # gloo timeouts and dead peers raise these
            self.dead = (
                f"rank {self.rank}: {what} (attempt {self.stats.attempts}) failed, "
                f"the process group is unusable: {str(exc).splitlines()[0][:200]}"
            )
            raise GroupFailedError(self.dead) from exc

    def _broadcast(self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
        g = self._global(group, src)
        self._run("broadcast", lambda: dist.broadcast(t, src=g, group=group))

    # -- one attempt, the same on every rank -------------------------------------

    def _attempt(
        self, header: Header | None, payload: bytes | None, verifier_for: VerifierFor | None
    ) -> Decision:
        self.stats.attempts += 1
        attempt = self.stats.attempts
        words = torch.zeros(fanout.WORDS, dtype=torch.int64)
        if header is not None:
            words.copy_(torch.from_numpy(header.words()))
        self._broadcast(words, 0, self.group)
        try:
            header = Header.from_words(words.numpy(), self.max_payload)
        except Pp1Error as exc:
            self.dead = f"rank {self.rank}: unreadable attempt header: {exc}"
            raise GroupFailedError(self.dead) from exc
        if header.kind is Kind.STOP:
            return Decision(header, None, [])

        started = time.perf_counter()
        size = max(header.nbytes, 1)
        if payload is not None:
            buf = torch.frombuffer(bytearray(payload) or bytearray(1), dtype=torch.uint8)
        else:
            buf = torch.empty(size, dtype=torch.uint8)
        buf = buf.to(self.device)
        self._broadcast(buf, 0, self.device_group)
        local = buf.cpu().numpy()[: header.nbytes]
        self.stats.fanout_seconds += time.perf_counter() - started
        self.stats.fanout_bytes += header.nbytes * (self.world - 1 if self.rank == 0 else 1)
        if (
            header.nbytes
            and self.faults is not None
            and self.faults.corrupt_copy(self.rank, attempt)
        ):
            local = local.copy()
            local[len(local) // 2] ^= 0x01
        reason: ErrorCode | None = None
        if fanout.digest(local) != header.payload_digest:
            reason = ErrorCode.GROUP_COPY_MISMATCH

        verifier = self._verifier(header, verifier_for)
        owner = fanout.owner_of(header.request, self.world)
        outcome = torch.from_numpy(fanout.encode_outcome(None, reason or ErrorCode.INTERNAL))
        if self.rank == owner:
            outcome = torch.from_numpy(self._evaluate(header, local, verifier, reason, attempt))
        self._broadcast(outcome, owner, self.group)
        result, owner_reason = fanout.decode_outcome(outcome.numpy())
        reason = reason or owner_reason
        if reason is None and result is not None:
            reason = _inapplicable(verifier, result)

        if self.faults is not None:
            self.faults.before_vote(self.rank, attempt)
        mine = torch.tensor(
            [int(reason is None), int(reason or 0), fanout.digest(outcome.numpy())],
            dtype=torch.int64,
        )
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        self._run("vote", lambda: dist.all_gather(gathered, mine, group=self.group))
        votes = [[int(v) for v in g.tolist()] for g in gathered]
        failures = [(r, ErrorCode(v[1])) for r, v in enumerate(votes) if v[0] != 1]
        if not failures and len({v[2] for v in votes}) != 1:
            failures = [(0, ErrorCode.GROUP_OUTCOME_MISMATCH)]
        if failures or result is None:
            verifier.discard()
            self.stats.votes_failed[failures[0][1].name.lower()] += 1
            if header.kind is Kind.TARGET_ONLY:
                ranks = ", ".join(f"rank {r}: {c.name}" for r, c in failures)
                self.dead = (
                    f"request {header.request} round {header.round_id}: the target-only "
                    f"attempt was voted down ({ranks}); nothing was committed"
                )
                raise GroupFailedError(self.dead)
            return Decision(header, None, failures)
        verifier.apply(result)
        return Decision(header, result, [])

    def _verifier(self, header: Header, verifier_for: VerifierFor | None) -> RequestVerifier:
        verifier = (verifier_for or self._no_verifier)(header)
        self.held[header.request] = verifier
        return verifier

    def _no_verifier(self, header: Header) -> RequestVerifier:
        held = self.held.get(header.request)
        if held is None:
            raise GroupFailedError(f"rank {self.rank} holds no request {header.request}")
        return held

    def _evaluate(
        self,
        header: Header,
        local: npt.NDArray[np.uint8],
        verifier: RequestVerifier,
        reason: ErrorCode | None,
        attempt: int,
    ) -> fanout.Words:
        if reason is not None:
            return fanout.encode_outcome(None, reason)
        try:
            if self.faults is not None and self.faults.fail_target(self.rank, attempt):
                raise VerifyError(ErrorCode.TARGET_FAILED, "injected target failure")
            if header.kind is Kind.PROPOSAL:
                rows = fanout.unpack_rows(local, header.rows, header.sparse)
                result = verifier.evaluate(fanout.proposal_of(header, rows))
            else:
                result = verifier.evaluate_target_only(header.round_id)
        except Pp1Error as exc:
            return fanout.encode_outcome(None, exc.code)
        return fanout.encode_outcome(result, None)

    # -- rank 0 --------------------------------------------------------------------

    def lead_proposal(
        self, request: int, verifier: RequestVerifier, proposal: Proposal
    ) -> Decision:
        """Publish a proposal that validated whole; returns the group's decision.

        Raises:
            GroupFailedError: a collective failed (nothing committed anywhere).
            ValueError: if the rows mix dense and sparse.
        """
        payload, sparse = fanout.pack_rows(proposal.rows)
        header = fanout.header_of(self.stats.attempts + 1, request, proposal, payload, sparse)
        return self._attempt(header, payload, lambda _h: verifier)

    def lead_target_only(self, request: int, verifier: RequestVerifier, round_id: int) -> Decision:
        """Decode ``round_id`` of ``request`` target-only on its owner and commit it everywhere.

        Raises:
            GroupFailedError: a collective failed or the attempt was voted down
                (nothing committed anywhere).
        """
        header = Header(
            kind=Kind.TARGET_ONLY,
            attempt=self.stats.attempts + 1,
            request=request,
            session=verifier.session,
            generation=verifier.generation,
            round_id=round_id,
            position=verifier.position,
            prefix_digest=verifier.digest,
            context=verifier.context,
            payload_digest=fanout.digest(b""),
        )
        return self._attempt(header, b"", lambda _h: verifier)

    def lead_stop(self) -> list[RankReport]:
        """End the group's rounds; returns every rank's report (rank order).

        Raises:
            GroupFailedError: a collective failed.
        """
        self._attempt(Header(kind=Kind.STOP), b"", None)
        return self._reports()

    # -- ranks 1.. -----------------------------------------------------------------

    def follow(self, verifier_for: VerifierFor) -> list[RankReport]:
        """Run attempts as rank 0 publishes them until it stops the group.

        ``verifier_for(header)`` returns this rank's verifier for the header's
        request, created or rebuilt to the header's session and generation.

        Raises:
            GroupFailedError: a collective failed or a target-only attempt was voted down.
        """
        while self._attempt(None, None, verifier_for).header.kind is not Kind.STOP:
            pass
        return self._reports()

    def _reports(self) -> list[RankReport]:
        prefixes = fanout.digest(
            np.array(
                [[r, self.held[r].digest & ((1 << 63) - 1)] for r in sorted(self.held)],
                dtype=np.int64,
            )
        )
        mine = torch.tensor(
            [
                self.stats.collectives + 1,  # the gather below included
                self.stats.attempts,
                self.stats.fanout_bytes,
                int(self.stats.fanout_seconds * 1e9),
                prefixes,
            ],
            dtype=torch.int64,
        )
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        self._run("report", lambda: dist.all_gather(gathered, mine, group=self.group))
        return [
            RankReport(
                rank=r,
                collectives=int(g[0]),
                attempts=int(g[1]),
                fanout_bytes=int(g[2]),
                fanout_seconds=int(g[3]) / 1e9,
                prefixes_digest=int(g[4]),
            )
            for r, g in enumerate(gathered)
        ]


def _inapplicable(verifier: RequestVerifier, result: RoundResult) -> ErrorCode | None:
    """Why this rank could not apply ``result`` to its state (None: it can)."""
    if verifier.poisoned or verifier.finished or result.round_id <= verifier.last_round:
        return ErrorCode.GROUP_OUTCOME_MISMATCH
    if any(not 0 <= t < verifier.vocab_size for t in result.tokens):
        return ErrorCode.GROUP_OUTCOME_MISMATCH
    return None
