"""The Spark side's verifier: a request's state, the checks before any draw, and what a
round commits, one request at a time or an engine's step of many (:func:`verify_step`); the
block itself is decided by the one walk of :mod:`pp1wire.q.walk`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy.typing as npt

from pp1wire.errors import ErrorCode, UsageError, VerifyError
from pp1wire.q import targetrows
from pp1wire.q.draw_audit import audit_mismatch
from pp1wire.q.outcomes import TARGET_FAILURES, Outcome, RoundResult
from pp1wire.q.proposal import MAX_DEPTH, ExtendedPrefix, PrefixDigest, Proposal, QRow
from pp1wire.q.stoprules import StopKind, audit, stopped_by_rule
from pp1wire.q.targetrows import (
    BatchTargetFn,
    FailedRow,
    PrefixRows,
    Processor,
    StepRows,
    TargetFn,
    batched,
    check_target,
    checked_target,
    residual,
    residual_sample,
    sample_weights,
)
from pp1wire.q.walk import Decision, RoundRows, Stop, accept_exact, walk

__all__ = [
    "TARGET_FAILURES", "BatchTargetFn", "FailedRow", "Outcome", "Processor", "RequestVerifier",
    "RoundResult", "StepRound", "TargetFn", "accept_exact", "audit_mismatch", "batched",
    "check_target", "checked_target", "proposal_from_rows", "residual", "residual_sample",
    "sample_weights", "step_prefixes", "verify_batch", "verify_step",
]  # fmt: skip


class RequestVerifier:
    """Verification state of one request (one session slot) on the Spark side: its committed
    prefix, generation, round IDs (:meth:`take_round`) and seed. A target or processor
    failure poisons it until :meth:`rebuild`."""

    def __init__(
        self,
        *,
        session: int,
        seed: int,
        vocab_size: int,
        prefix: Sequence[int],
        target: TargetFn,
        processors: Sequence[Processor] = (),
        eos: int | None = None,
        generation: int = 0,
        context: int = 0,
        audit: bool = False,
    ) -> None:
        """Start a request after ``prefix``; with ``audit``, each drafted token must be the
        one the worker's PROPOSAL draw selects from its shipped q (``docs/protocol.md`` §6.5).

        Raises:
            VerifyError: ``MALFORMED_PROPOSAL`` if a prefix token is outside the vocabulary.
        """
        self.session = session
        self.seed = seed
        self.audit = audit
        self.vocab_size = vocab_size
        self.target = target
        self.processors = tuple(processors)
        self.eos = eos
        self.context = context
        self.rebuild(prefix, generation)

    @property
    def position(self) -> int:
        """Absolute position of the next token (length of the committed prefix)."""
        return len(self.committed)

    @property
    def digest(self) -> int:
        """:func:`prefix_digest` of the committed prefix (kept up to date)."""
        return self._digest.value

    def rebuild(self, prefix: Sequence[int], generation: int) -> None:
        """Reset to ``prefix`` under a new generation; clears poisoning.

        Raises:
            VerifyError: ``MALFORMED_PROPOSAL`` for tokens outside the vocabulary.
        """
        tokens = [int(t) for t in prefix]
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, "prefix token outside the vocabulary")
        self.committed = tokens
        self._digest = PrefixDigest(tokens)
        self.generation = generation
        self.last_round = -1
        self._next_round = 0
        self.poisoned = False
        self.finished = bool(tokens) and self.eos is not None and tokens[-1] == self.eos

    def take_round(self) -> int:
        """The next round ID of this generation for a STEP or a target-only round, never
        one at or below a round already consumed."""
        round_id = max(self._next_round, self.last_round + 1)
        self._next_round = round_id + 1
        return round_id

    def _require_live(self) -> None:
        if self.poisoned:
            raise VerifyError(
                ErrorCode.SESSION_POISONED, "request must be rebuilt after a target failure"
            )
        if self.finished:
            raise VerifyError(ErrorCode.REQUEST_FINISHED, "request already ended")

    def _claim_round(self, round_id: int) -> None:
        if round_id <= self.last_round:
            raise VerifyError(
                ErrorCode.ROUND_REUSED, f"round {round_id} is not after {self.last_round}"
            )

    def check_key(self, proposal: Proposal, counts: Sequence[int] | None = None) -> None:
        """:meth:`check_proposal` without the q rows (one shard's, for its group): the block
        must end where its stop rule ends it, or earlier if a fault cut it
        (``docs/adaptive.md`` §2, §7); ``counts``: each row's count at its token, if given.

        Raises:
            VerifyError: ``SESSION_POISONED``, ``REQUEST_FINISHED``, ``WRONG_SESSION``,
                ``STALE_GENERATION``, ``CONTEXT_MISMATCH``, ``STALE_PREFIX``, ``ROUND_REUSED``,
                ``MALFORMED_PROPOSAL`` or ``STOP_RULE_VIOLATED``.
        """
        self._require_live()
        if proposal.session != self.session:
            raise VerifyError(ErrorCode.WRONG_SESSION, "proposal belongs to another session")
        if proposal.generation != self.generation:
            raise VerifyError(ErrorCode.STALE_GENERATION, "proposal from another generation")
        if proposal.context != self.context:
            raise VerifyError(ErrorCode.CONTEXT_MISMATCH, "proposal for another target context")
        if proposal.position != self.position or proposal.digest != self.digest:
            raise VerifyError(ErrorCode.STALE_PREFIX, "proposal drawn after another prefix")
        self._claim_round(proposal.round_id)
        rows = proposal.rows
        if not 1 <= proposal.depth <= MAX_DEPTH or not 1 <= len(rows) <= proposal.depth:
            raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, "depth or row count out of range")
        for i, row in enumerate(rows):
            if not 0 <= row.token < self.vocab_size:
                raise VerifyError(
                    ErrorCode.MALFORMED_PROPOSAL, f"draft {row.token} outside the vocabulary"
                )
            if self.eos is not None and row.token == self.eos and i != len(rows) - 1:
                raise VerifyError(
                    ErrorCode.MALFORMED_PROPOSAL, "draft continues after a terminal token"
                )
        if proposal.stop.kind is not StopKind.FIXED:
            self._audit_stop(proposal, counts)
        elif proposal.cut is None and stopped_by_rule(
            proposal.depth, [row.token for row in rows], self.eos
        ):
            raise VerifyError(
                ErrorCode.MALFORMED_PROPOSAL,
                "block shorter than its depth without a terminal token",
            )

    def _audit_stop(self, proposal: Proposal, counts: Sequence[int] | None = None) -> None:
        """Each row's count at its token (``counts``, or its row's) through the stop rule."""
        rows = proposal.rows
        if counts is None:
            if proposal.shard is not None:
                # One shard holds the drafted token's q on one rank only: its group
                # gathers the counts (docs/tp.md section 11).
                raise VerifyError(
                    ErrorCode.MALFORMED_PROPOSAL, "a shard's stop needs its group's counts"
                )
            counts = [row.count_at(row.token) for row in rows]
        elif len(counts) != len(rows):
            raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, "a count for every row")
        try:
            code = audit(
                proposal.stop,
                proposal.depth,
                counts,
                [r.token for r in rows],
                self.eos,
                cut=proposal.cut is not None,
            )
        except ValueError as exc:  # a count outside 0..2**24: rows never validated
            raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, str(exc)) from None
        if code is not None:
            raise VerifyError(code, f"the block of {len(rows)} rows breaks {proposal.stop}")

    def check_proposal(self, proposal: Proposal) -> None:
        """Refuse a proposal that this request must not consume; draws nothing.

        Raises:
            VerifyError: as :meth:`check_key`; ``MALFORMED_PROPOSAL`` for one shard, a draft
                with zero q, or a dense row shorter than the vocabulary.
        """
        if proposal.shard is not None:
            raise VerifyError(
                ErrorCode.MALFORMED_PROPOSAL, "one shard of a proposal is verified by its group"
            )
        self.check_key(proposal)
        for row in proposal.rows:
            if row.count_at(row.token) <= 0:
                raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, "draft has zero q")
            if row.ids is None and row.length < self.vocab_size:
                raise VerifyError(
                    ErrorCode.MALFORMED_PROPOSAL, "dense q shorter than the vocabulary"
                )

    def verify(
        self, proposal: Proposal, scores: Sequence[npt.ArrayLike] | None = None
    ) -> RoundResult:
        """Verify one proposal block and commit its outcome atomically (``scores``: the
        target's rows for :meth:`prefixes`, if already computed).

        Raises:
            VerifyError: as :meth:`check_proposal` (nothing changed); ``TARGET_*`` (poisoned)
                or ``EMPTY_RESIDUAL`` (the round is spent), nothing committed.
        """
        self.check_proposal(proposal)
        self.last_round = proposal.round_id
        return self._verify(proposal, commit=True, scores=scores)

    def evaluate(
        self, proposal: Proposal, scores: Sequence[npt.ArrayLike] | None = None
    ) -> RoundResult:
        """What :meth:`verify` would commit, committing nothing (the round is not spent):
        a group votes on it before every rank :meth:`apply`-s it.

        Raises:
            VerifyError: as :meth:`verify` (a ``TARGET_*`` failure poisons: :meth:`discard`).
        """
        self.check_proposal(proposal)
        return self._verify(proposal, commit=False, scores=scores)

    def prefixes(self, proposal: Proposal) -> list[Sequence[int]]:
        """The prefixes :meth:`verify` scores: the committed prefix then the first 0..d drafts."""
        out: list[Sequence[int]] = []
        for i in range(len(proposal.rows) + 1):
            context = ExtendedPrefix(self.committed)
            for row in proposal.rows[:i]:
                context.append(row.token)
            out.append(context)
        return out

    def _audit(self, proposal: Proposal) -> None:
        wrong = audit_mismatch(proposal, self.seed, self.vocab_size)
        if wrong is not None:
            raise VerifyError(
                ErrorCode.AUDIT_MISMATCH,
                f"draft {wrong} is not the token its q and the proposal draw select",
            )

    def _verify(
        self, proposal: Proposal, *, commit: bool, scores: Sequence[npt.ArrayLike] | None = None
    ) -> RoundResult:
        if self.audit:
            self._audit(proposal)
        if scores is not None and len(scores) != len(proposal.rows) + 1:
            raise VerifyError(ErrorCode.BAD_ARGUMENT, "scores do not match the proposal")
        job = self.round_rows(proposal.round_id, proposal.rows)
        rows = PrefixRows(
            self.committed, job.tokens, self.target, self.processors, self.vocab_size, scores
        )
        return self._walked(job, rows, commit)

    def _walked(self, job: RoundRows, rows: PrefixRows, commit: bool) -> RoundResult:
        """One round through the walk with its rows scored per prefix; raises its error."""
        (decision,) = walk([job], rows)
        result = self.settle(job, decision, rows.failures.__getitem__, commit=commit)
        if isinstance(result, VerifyError):
            raise result
        return result

    def round_rows(
        self,
        round_id: int,
        drafts: Sequence[QRow] = (),
        *,
        first: int = 0,
        counts: Sequence[int] | None = None,
    ) -> RoundRows:
        """The walk's description of a round of this request: its rows ``first, first + 1,
        …`` of a layout (one per draft and the bonus), each draft's count at its token
        (``counts``, or read from its row when reached)."""
        rows = tuple(drafts)
        return RoundRows(
            rows=tuple(range(first, first + len(rows) + 1)),
            drafts=rows,
            tokens=tuple(r.token for r in rows),
            counts=None if counts is None else tuple(counts),
            seed=self.seed,
            generation=self.generation,
            round_id=round_id,
            start=self.position,
            eos=self.eos,
            vocab=self.vocab_size,
        )

    def settle(
        self,
        job: RoundRows,
        decision: Decision,
        failure: Callable[[int], VerifyError],
        *,
        commit: bool,
    ) -> RoundResult | VerifyError:
        """What the walk's ``decision`` on ``job`` commits (with ``commit``), or its error: a
        bad row poisons the request (its error ``failure(row)``), a draw without mass is
        ``EMPTY_RESIDUAL``."""
        if decision.stop is Stop.BAD_ROW:
            self.poisoned = True
            return failure(job.rows[decision.row])
        if decision.stop is Stop.EMPTY:
            return VerifyError(ErrorCode.EMPTY_RESIDUAL, "distribution has no mass")
        tokens = list(job.tokens[: decision.accepted])
        if decision.stop is Stop.EOS:
            return self._commit(job.round_id, tokens, decision.accepted, None, Outcome.EOS, commit)
        token = decision.token
        outcome = _OUTCOMES[decision.stop]
        return self._commit(
            job.round_id, [*tokens, token], decision.accepted, token, outcome, commit
        )

    def decode_target_only(self, round_id: int, score: npt.ArrayLike | None = None) -> RoundResult:
        """Sample one token from the target alone (``score``: its row, if already computed).

        Raises:
            VerifyError: ``SESSION_POISONED``, ``REQUEST_FINISHED``,
                ``ROUND_REUSED`` or a ``TARGET_*`` failure (poisons).
        """
        self._require_live()
        self._claim_round(round_id)
        self.last_round = round_id
        return self._target_only(round_id, commit=True, score=score)

    def evaluate_target_only(
        self, round_id: int, score: npt.ArrayLike | None = None
    ) -> RoundResult:
        """What :meth:`decode_target_only` would commit, committing nothing.

        Raises:
            VerifyError: as :meth:`decode_target_only`.
        """
        self._require_live()
        self._claim_round(round_id)
        return self._target_only(round_id, commit=False, score=score)

    def _target_only(
        self, round_id: int, *, commit: bool, score: npt.ArrayLike | None = None
    ) -> RoundResult:
        scores = None if score is None else [score]
        rows = PrefixRows(self.committed, (), self.target, self.processors, self.vocab_size, scores)
        return self._walked(self.round_rows(round_id), rows, commit)

    def apply(self, result: RoundResult) -> None:
        """Commit a result :meth:`evaluate` or :meth:`evaluate_target_only` produced for
        this state (here or on another rank).

        Raises:
            VerifyError: ``SESSION_POISONED``, ``REQUEST_FINISHED``, ``ROUND_REUSED``, or
                ``MALFORMED_PROPOSAL`` for a result that cannot follow this prefix.
        """
        self._require_live()
        self._claim_round(result.round_id)
        tokens = list(result.tokens)
        if not tokens or any(not 0 <= t < self.vocab_size for t in tokens):
            raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, "result tokens out of range")
        if not 0 <= result.accepted <= len(tokens):
            raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, "accepted count out of range")
        self.last_round = result.round_id
        self._commit(
            result.round_id, tokens, result.accepted, result.extra, result.outcome, commit=True
        )

    def result(
        self, round_id: int, tokens: list[int], accepted: int, extra: int | None, outcome: Outcome
    ) -> RoundResult:
        """The result of a round decided elsewhere (a sharded group), committing nothing."""
        return self._commit(round_id, tokens, accepted, extra, outcome, commit=False)

    def discard(self) -> None:
        """Forget a failed evaluation a group voted away: clear poisoning, keep the rest."""
        self.poisoned = False

    def _commit(
        self,
        round_id: int,
        tokens: list[int],
        accepted: int,
        extra: int | None,
        outcome: Outcome,
        commit: bool,
    ) -> RoundResult:
        finished = self.eos is not None and tokens[-1] == self.eos
        if commit:
            self.committed.extend(tokens)
            self._digest.extend(tokens)
            self.finished = finished
        return RoundResult(
            round_id=round_id,
            accepted=accepted,
            tokens=tuple(tokens),
            extra=extra,
            outcome=outcome,
            finished=finished,
            new_position=len(self.committed) + (0 if commit else len(tokens)),
        )


def proposal_from_rows(
    verifier: RequestVerifier, rows: Sequence[QRow], round_id: int, depth: int
) -> Proposal:
    """A :class:`Proposal` keyed to ``verifier``'s current state (in-process use)."""
    return Proposal(
        session=verifier.session,
        generation=verifier.generation,
        round_id=round_id,
        position=verifier.position,
        digest=verifier.digest,
        depth=depth,
        rows=tuple(rows),
        context=verifier.context,
    )


StepRound = tuple[RequestVerifier, Proposal | None, int]
"""(verifier, proposal or None, round ID): the ID is a target-only round's (None)."""


@dataclass(frozen=True, slots=True)
class _Planned:
    """A round that passed its checks, and where its rows are in the step's layout."""

    index: int
    verifier: RequestVerifier
    proposal: Proposal | None
    round_id: int
    first: int
    count: int


_Out = list[RoundResult | VerifyError | None]


def _plan(
    rounds: Sequence[StepRound], *, every: bool
) -> tuple[_Out, list[_Planned], list[Sequence[int]]]:
    """Every check before any row is read: refusals in place, the others' row spans (with
    ``every`` a refused round keeps its rows in the layout); raises as :func:`step_prefixes`."""
    if len({id(v) for v, _, _ in rounds}) != len(rounds):
        raise UsageError(ErrorCode.BAD_ARGUMENT, "a step takes one round per request")
    out: _Out = [None] * len(rounds)
    planned: list[_Planned] = []
    prefixes: list[Sequence[int]] = []
    for k, (v, proposal, given) in enumerate(rounds):
        round_id = given if proposal is None else proposal.round_id
        first = len(prefixes)
        try:
            if proposal is not None:
                wanted = v.prefixes(proposal)  # views of the committed prefix: nothing copied
                if every:
                    prefixes.extend(wanted)
                v.check_proposal(proposal)
            else:
                if every:
                    prefixes.append(v.committed)
                v._require_live()
                v._claim_round(round_id)
                wanted = [v.committed]
        except VerifyError as exc:
            out[k] = exc
            continue
        if not every:
            prefixes.extend(wanted)
        planned.append(_Planned(k, v, proposal, round_id, first, len(wanted)))
    return out, planned, prefixes


def step_prefixes(rounds: Sequence[StepRound]) -> list[Sequence[int]]:
    """The prefixes whose target rows :func:`verify_step` takes, in its flat layout.

    Per round in order: d + 1 for d drafts (the committed prefix then the first 0..d
    drafts), one for a target-only round; a round its checks refuse keeps its rows.
    They view the committed tokens: score them before anything commits.

    Raises:
        UsageError: ``BAD_ARGUMENT`` for two rounds of one request.
    """
    return _plan(rounds, every=True)[2]


def verify_step(
    rounds: Sequence[StepRound], probs: Any, *, commit: bool = True, threads: int | None = None
) -> list[RoundResult | VerifyError]:
    """Decide a step's rounds from the target's rows for :func:`step_prefixes`, as an engine does.

    ``probs``: those rows as one ``(N, V)`` array (numpy, DLPack, or a torch tensor on
    any device, where only totals, ``p(x)`` and drawn IDs leave it). Each round gets
    the tokens :meth:`RequestVerifier.verify` would give it; with ``commit`` False
    nothing commits. ``threads``: the compiled row operations' threads
    (:func:`pp1wire.q.targetrows.decide`). Returns per round its :class:`RoundResult`
    or the :class:`VerifyError` that refused it, poisoned it or found no mass.

    Raises:
        UsageError: ``BAD_ARGUMENT`` (nothing decided, nothing changed) if ``probs`` is not 2-D with
            one row per prefix, or for two rounds of one request.
    """
    out, planned, prefixes = _plan(rounds, every=True)
    shape = tuple(getattr(probs, "shape", ()))
    if len(shape) != 2 or shape[0] != len(prefixes):
        raise UsageError(
            ErrorCode.BAD_ARGUMENT,
            f"target rows of shape {shape}: the step needs ({len(prefixes)}, V)",
        )
    if planned:
        rows = StepRows.of_matrix(probs)
        _decide(planned, rows, out, commit=commit, threads=threads)
    return _finished(out)


def verify_batch(
    rounds: Sequence[StepRound], target: BatchTargetFn, *, commit: bool = True
) -> list[RoundResult | VerifyError]:
    """:func:`verify_step` with the rows of the rounds that pass their checks scored by
    **one** call of ``target``: a failing call fails (and poisons) every scored round
    with ``TARGET_FAILED``, a :class:`FailedRow` only the rounds that needed it.

    Raises:
        UsageError: ``BAD_ARGUMENT`` for two rounds of one request (nothing changed).
    """
    out, planned, prefixes = _plan(rounds, every=False)
    if not planned:
        return _finished(out)
    try:
        scored = cast(Sequence[Any], target(prefixes))
        if len(scored) != len(prefixes):
            raise ValueError(f"{len(scored)} rows for {len(prefixes)} prefixes")
        if getattr(scored, "ndim", None) == 2:
            rows = StepRows.of_matrix(scored)
        else:
            rows = StepRows.of_rows(scored)
    except Exception as exc:  # a plugin failure must not leave a half round
        failure = VerifyError(ErrorCode.TARGET_FAILED, f"target evaluation failed: {exc!r}")
        for pl in planned:
            pl.verifier.poisoned = True
            out[pl.index] = failure
        return _finished(out)
    whole = []
    for pl in planned:
        span = (rows.raw(i) for i in range(pl.first, pl.first + pl.count))
        failed = next((r for r in span if isinstance(r, FailedRow)), None)
        if failed is None:
            whole.append(pl)
            continue
        pl.verifier.poisoned = True
        out[pl.index] = VerifyError(
            ErrorCode.TARGET_FAILED, f"target evaluation failed: {failed.error!r}"
        )
    _decide(whole, rows, out, commit=commit)
    return _finished(out)


def _finished(out: _Out) -> list[RoundResult | VerifyError]:
    return [r if r is not None else VerifyError(ErrorCode.INTERNAL, "not decided") for r in out]


def _decide(
    planned: list[_Planned], rows: StepRows, out: _Out, *, commit: bool, threads: int | None = None
) -> None:
    """The checked rounds' outcomes into ``out``, each round spent (when committing)
    before anything is drawn."""
    fast: list[tuple[_Planned, RoundRows]] = []
    for pl in planned:
        v = pl.verifier
        if commit:
            v.last_round = pl.round_id
        drafts = () if pl.proposal is None else pl.proposal.rows
        job = v.round_rows(pl.round_id, drafts, first=pl.first)
        if v.processors or not job.in_rng_range():
            # A processor sees all of p at each position: the request's own rows.
            out[pl.index] = _per_round(pl, rows, commit)
            continue
        if pl.proposal is not None and v.audit:
            try:
                v._audit(pl.proposal)
            except VerifyError as exc:
                out[pl.index] = exc
                continue
        fast.append((pl, job))
    decided = targetrows.decide([job for _, job in fast], rows, threads)
    for (pl, job), d in zip(fast, decided, strict=True):
        v = pl.verifier
        failure = functools.partial(_row_failure, rows, v.vocab_size)
        out[pl.index] = v.settle(job, d, failure, commit=commit)


def _per_round(pl: _Planned, rows: StepRows, commit: bool) -> RoundResult | VerifyError:
    v = pl.verifier
    scores = [rows.raw(i) for i in range(pl.first, pl.first + pl.count)]
    try:
        if pl.proposal is not None:
            return v._verify(pl.proposal, commit=commit, scores=scores)
        return v._target_only(pl.round_id, commit=commit, score=scores[0])
    except VerifyError as exc:
        return exc


_OUTCOMES = {
    Stop.CORRECTION: Outcome.CORRECTION,
    Stop.BONUS: Outcome.BONUS,
    Stop.TARGET: Outcome.TARGET,
}


def _row_failure(rows: StepRows, vocab: int, row: int) -> VerifyError:
    """The error the per-request verifier raises for a row the step refused."""
    try:
        checked_target(rows.raw(row), vocab)
    except VerifyError as exc:
        return exc
    except Exception as exc:  # as PrefixRows reports a failing row
        return VerifyError(ErrorCode.TARGET_FAILED, f"target evaluation failed: {exc!r}")
    return VerifyError(ErrorCode.INTERNAL, "a row the step refused passes its checks")
