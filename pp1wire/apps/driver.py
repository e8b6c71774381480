"""The Spark side's round driver, for every mode of ``pp1-spark``: like an engine's scheduler it
hands each step's rounds to a :class:`Strategy` that decides them together, applies the
verdicts and sends the next STEPs; a fault cuts a block, a failed proposal is a fallback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from pp1wire.aio.client import AsyncClient
from pp1wire.apps import metrics
from pp1wire.apps.link import Link
from pp1wire.apps.metrics import SparkMetrics
from pp1wire.errors import ErrorCode, Pp1Error, VerifyError
from pp1wire.q.proposal import Proposal
from pp1wire.q.rng import derive_seed
from pp1wire.q.stoprules import FIXED, AcceptanceHistory, DepthController, StopRule
from pp1wire.q.verify import (
    TARGET_FAILURES,
    BatchTargetFn,
    Outcome,
    RequestVerifier,
    RoundResult,
    TargetFn,
    verify_batch,
)

log = logging.getLogger("pp1wire.apps.spark")

GROUP_FAILED_EXIT = 3
"""Exit status when the group failed (every request stopped, results written)."""
TARGET_FAILED_EXIT = 4
"""Exit status when a target failure stopped at least one request (results written)."""

# A proposal later than this share of a typical STEP→proposal time after the first of its
# step joins the next step; under the floor (seconds), waiting costs less than a step.
_STRAGGLER_FRACTION = 0.5
_STRAGGLER_FLOOR = 0.002


@dataclass
class RequestRecord:
    """What one request produced: the ``--output`` record."""

    request: int
    seed: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallbacks: int = 0
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    cuts: int = 0  # rounds whose block a fault ended early (the rows before it verified)
    cut_reasons: Counter[str] = field(default_factory=Counter)
    finished: bool = False
    stopped: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The JSONL record: every field, in order (the reasons as plain dicts)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: dict(v) if isinstance(v, Counter) else v for k, v in out.items()}


@dataclass
class Plan:
    """What a run does, from the settings (the same on every rank): ``depth`` is every STEP's
    maximum, or with ``controller`` the most it may choose (``--depth auto``, runner §4)."""

    requests: int
    concurrency: int
    max_tokens: int
    depth: int
    support: int  # 0 = dense
    temperature: float
    seed: int
    eos: int | None
    audit: bool
    vocab_size: int
    prompts: list[list[int]]
    stop: StopRule = FIXED
    controller: DepthController | None = None

    def verifier(
        self, index: int, target: TargetFn, *, session: int = 0, generation: int = 0
    ) -> RequestVerifier:
        """Request ``index``'s verifier: its seed, its prompt (line ``index`` mod lines)."""
        return RequestVerifier(
            session=session,
            seed=derive_seed(self.seed, index),
            vocab_size=self.vocab_size,
            prefix=list(self.prompts[index % len(self.prompts)]),
            target=target,
            eos=self.eos,
            audit=self.audit,
            generation=generation,
        )


@dataclass
class RequestState:
    """A running request: its verifier (prefix, generation, round counter) and record."""

    slot: int
    verifier: RequestVerifier
    record: RequestRecord
    prompt_length: int
    opened: AsyncClient | None = None  # the connection the slot is open on
    fallback: str | None = None  # the reason the next round must be target-only
    flight: asyncio.Task[Proposal] | None = None
    round_id: int = -1  # the round in motion (a STEP's, or a target-only one)
    sent: float = 0.0
    # Where this rank just opened the slot, taken up only once the group agrees to STEP.
    opening: int | None = None
    #: The request's verified rounds, the depth controller's only history.
    history: AcceptanceHistory = field(default_factory=AcceptanceHistory)

    @property
    def index(self) -> int:
        """The request's index."""
        return self.record.request

    @property
    def new_tokens(self) -> int:
        """Tokens committed after the prompt."""
        return len(self.verifier.committed) - self.prompt_length


@dataclass
class Round:
    """One round of a step: a validated proposal, or None for target-only."""

    state: RequestState
    round_id: int
    proposal: Proposal | None
    failure: ErrorCode | None = None  # a STEP round whose proposal this rank did not get


@dataclass(frozen=True)
class Verdict:
    """How a strategy decided one round: ``result`` committed (applied to the verifier), or
    ``code`` says why not (``stop``: the target failed, the request stops; else the next
    round is target-only); ``block``: a shorter block than the round's, if one was verified.
    """

    result: RoundResult | None = None
    code: ErrorCode | None = None
    stop: bool = False
    block: Proposal | None = None


def verdict_of(outcome: RoundResult | VerifyError) -> Verdict:
    """The verdict for :func:`verify_batch`'s outcome of one round."""
    if isinstance(outcome, RoundResult):
        return Verdict(outcome)
    return Verdict(None, outcome.code, stop=outcome.code in TARGET_FAILURES)


def decide_scored(
    rounds: list[Round], score: Callable[[list[Round]], Iterable[Verdict]]
) -> list[Verdict]:
    """``score``'s verdicts on the rounds that have a proposal or are target-only, in order; a
    STEP round without its proposal is discarded (its failure the verdict's code)."""
    decided = iter(score([r for r in rounds if r.failure is None]))
    return [Verdict(None, r.failure) if r.failure is not None else next(decided) for r in rounds]


class Strategy(Protocol):
    """How a mode decides a step's rounds (and, for a group, agrees on link state)."""

    collective: bool  # whether agree runs a collective (then off the event loop)

    def agree(self, local: list[int]) -> list[int]:
        """Per entry, the first nonzero value over the group's ranks (0 if none).

        Raises:
            GroupFailedError: the group failed.
        """

    def decide(self, rounds: list[Round]) -> list[Verdict]:
        """Decide a step's rounds (distinct requests), one verdict each, off the event loop.

        Raises:
            GroupFailedError: the group failed (nothing of the step committed).
        """

    def summary(self) -> dict[str, Any]:
        """Mode-specific keys of the run's summary (after the run)."""


class LocalStrategy:
    """One rank: every round of a step scored by one call of the target's batched form."""

    collective = False  # agree returns its argument: no hop off the event loop

    def __init__(self, target: BatchTargetFn) -> None:
        """Decide with ``target`` (:func:`pp1wire.q.verify.batched` of the plugin)."""
        self.target = target

    def agree(self, local: list[int]) -> list[int]:
        """A single rank agrees with itself."""
        return local

    def decide(self, rounds: list[Round]) -> list[Verdict]:
        """:func:`verify_batch` over the step's rounds (:func:`decide_scored`). Never raises."""
        return decide_scored(rounds, self._verify)

    def _verify(self, scored: list[Round]) -> list[Verdict]:
        items = [(r.state.verifier, r.proposal, r.round_id) for r in scored]
        return [verdict_of(outcome) for outcome in verify_batch(items, self.target)]

    def summary(self) -> dict[str, Any]:
        """No keys of its own."""
        return {}


@dataclass(eq=False)
class RoundDriver:
    """Runs every request of a :class:`Plan` through steps decided by a :class:`Strategy`
    (``link``: None when no worker is used, ``--depth 0``)."""

    plan: Plan
    strategy: Strategy
    target: TargetFn
    link: Link | None
    metrics: SparkMetrics
    # A signal requests a stop; the step's agreement makes it every rank's, at one step.
    stop_requested: bool = field(default=False, init=False)
    stopping: bool = field(default=False, init=False)
    group_failure: Pp1Error | None = field(default=None, init=False)
    round_trips: list[float] = field(default_factory=list, init=False)  # the first 100,000
    recent_trips: deque[float] = field(default_factory=lambda: deque(maxlen=64), init=False)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    records: dict[int, RequestRecord] = field(default_factory=dict, init=False)
    seconds: float = field(default=0.0, init=False)
    stepped: int = field(default=0, init=False)  # STEPs sent, and their maximum depths summed
    stepped_depth: int = field(default=0, init=False)
    cpu_seconds: float = field(default=0.0, init=False)
    _generations: dict[int, int] = field(default_factory=dict, init=False)  # slot -> last used
    _thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, "pp1-step"), init=False
    )

    def request_stop(self) -> None:
        """Stop as soon as possible (a signal handler's call, on the loop's thread): every wait
        ends, the proposals in flight are cut at the rows that arrived (``docs/adaptive.md``
        §7), the step under way is decided, and :meth:`run` returns every record.
        """
        self.stop_requested = True
        self._stopped.set()

    async def until_stopped(self, waiting: Any) -> tuple[bool, Any]:
        """``(True, None)`` if a stop came before ``waiting`` finished (it is cancelled), else
        ``(False, its result)``; its exception propagates."""
        if self._stopped.is_set():
            if asyncio.iscoroutine(waiting):
                waiting.close()
            return True, None
        task = asyncio.ensure_future(waiting)
        stop = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return False, task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return True, None

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        # Collectives and target calls block: the loop keeps serving the link meanwhile.
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _agree(self, local: list[int]) -> list[int]:
        """The strategy's :meth:`Strategy.agree`, off the loop only if it is a collective."""
        if not self.strategy.collective:
            return self.strategy.agree(local)
        agreed: list[int] = await self._off_loop(self.strategy.agree, local)
        return agreed

    def _new_request(self, index: int) -> RequestState:
        verifier = self.plan.verifier(index, self.target)
        prompt = list(verifier.committed)
        record = RequestRecord(request=index, seed=verifier.seed, prompt=prompt)
        self.records[index] = record
        return RequestState(index % self.plan.concurrency, verifier, record, len(prompt))

    def _done(self, st: RequestState) -> bool:
        v = st.verifier
        return v.finished or v.poisoned or st.new_tokens >= self.plan.max_tokens

    async def run(self) -> list[RequestRecord]:
        """Run every request (or until stopped); returns the records in request order (a group
        failure stops every running request: ``group_failed``, :attr:`group_failure`)."""
        p = self.plan
        queues = [deque(range(s, p.requests, p.concurrency)) for s in range(p.concurrency)]
        active: dict[int, RequestState] = {}
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            while True:
                if not self.stopping:
                    for slot, queue in enumerate(queues):
                        if slot not in active and queue:
                            st = self._new_request(queue.popleft())
                            if self._done(st):  # max-tokens 0, or a prompt ending in eos
                                self._finish(st)
                            else:
                                active[slot] = st
                if not active:
                    break
                await self._launch(list(active.values()))
                if not any(st.round_id >= 0 for st in active.values()):
                    break  # stopping, and nothing is in motion
                ready = await self._ready(list(active.values()))
                if ready:
                    await self._step(ready, len(active))
                for slot, st in list(active.items()):
                    if self._done(st) or st.record.stopped is not None:
                        await self._end(st)
                        del active[slot]
            for st in active.values():  # stopped by a signal: cut after their last round
                await self._end(st)
        except Pp1Error as exc:
            if exc.code is not ErrorCode.GROUP_FAILED:
                raise
            self.group_failure = exc
            for st in active.values():
                self._stop(st, "group_failed")
                await self._end(st)
        finally:
            self.seconds = time.perf_counter() - started
            self.cpu_seconds = time.process_time() - cpu_started
            self._thread.shutdown(wait=False)
        return [self.records[i] for i in sorted(self.records)]

    async def _launch(self, states: list[RequestState]) -> None:
        """Set every request without a round in motion going: a STEP, or target-only (whether
        it can STEP depends on this rank's link, so the group agrees on it)."""
        todo = [st for st in states if st.round_id < 0]
        if not todo or self.stopping:
            return
        # The load --depth auto assumes: a function of the flags, not of the requests running
        # (that is timing, and tokens must not depend on it: docs/runner.md section 4.1).
        load = max(1, min(self.plan.concurrency, self.plan.requests))
        controller = self.plan.controller
        local = await asyncio.gather(*(self._prepare(st) for st in todo))
        agreed = await self._agree(local)
        for st, mine, code in zip(todo, local, agreed, strict=True):
            if not code and st.opening is not None and st.opened is not None:
                st.verifier.rebuild(st.verifier.committed, st.opening)
                st.verifier.session = st.opened.session
            st.opening = None
            st.round_id = st.verifier.take_round()
            if code == _TARGET_ONLY:
                continue
            if code:
                if code != _FALLBACK:
                    st.fallback = ErrorCode(code).name.lower()
                if not mine and st.opened is not None:
                    # Another rank cannot STEP it: close here too, to reopen together.
                    await self._close(st)
                continue
            client = st.opened
            assert client is not None
            # --depth, or the controller's choice from the request's verified rounds and the
            # load alone (nothing of the round it is for).
            depth = self.plan.depth if controller is None else controller.choose(st.history, load)
            self.stepped += 1
            self.stepped_depth += depth
            st.sent = time.perf_counter()
            st.flight = asyncio.ensure_future(
                client.propose(
                    st.slot,
                    round_id=st.round_id,
                    depth=depth,
                    temperature=self.plan.temperature,
                    support=self.plan.support,
                    stop=self.plan.stop,
                )
            )

    async def _prepare(self, st: RequestState) -> int:
        """0 if this rank can STEP ``st`` now (its slot open on a live link), else why not:
        :data:`_TARGET_ONLY`, :data:`_FALLBACK` or an :class:`ErrorCode`."""
        if self.plan.depth == 0 or self.link is None:
            return _TARGET_ONLY
        if st.fallback is not None:
            return _FALLBACK
        client = self.link.current()  # up: no wait, and nothing else runs meanwhile
        if client is None:
            # A reconnect in progress is abandoned at a stop, as request_stop promises.
            stopped, reconnected = await self.until_stopped(self.link.live())
            if stopped:
                return int(ErrorCode.CANCELLED)
            client = cast("AsyncClient | None", reconnected)
        if client is None:
            return int(ErrorCode.CONNECTION_LOST)
        if st.opened is client and client.slot_usable(st.slot):
            return 0
        # Out of sync, on another connection, or new: (re)opened above every generation.
        st.opened = None
        generation = self._generations.get(st.slot, -1) + 1
        self._generations[st.slot] = generation  # used, even if refused
        try:
            stopped, _ = await self.until_stopped(
                client.reopen_slot(st.slot, st.verifier, generation=generation)
            )
        except Pp1Error as exc:
            log.warning("open failed", extra={"slot": st.slot, "error": repr(exc)})
            return int(exc.code)
        if stopped:
            return int(ErrorCode.CANCELLED)
        st.opening = generation  # the verifier moves to it in _launch, once agreed
        st.opened = client
        return 0

    def straggler_wait(self, first: float) -> float:
        """How long a step waits for its other proposals once one arrived (docs/runner.md §8);
        ``first`` is the STEP→proposal time of its first, used until one was measured."""
        recent = self.recent_trips
        return max(_STRAGGLER_FLOOR, _STRAGGLER_FRACTION * (statistics.median(recent or [first])))

    async def _ready(self, states: list[RequestState]) -> list[RequestState]:
        """The requests whose round can be decided in this step (the same on every rank): it
        waits for the proposals in flight, up to a straggler's allowance after the first,
        and agrees on stopping."""
        moving = [st for st in states if st.round_id >= 0]
        pending = [st.flight for st in moving if st.flight is not None and not st.flight.done()]
        # No rank waits for drafts once stopping: the drafts do not choose the cut (§7).
        stop = self.stop_requested or self.stopping
        if pending and not stop:
            if len(pending) == len(moving):  # nothing to decide yet: wait for the first
                await self.until_stopped(asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))
            sent = [st.sent for st in moving if st.flight is not None]
            first = time.perf_counter() - min(sent) if sent else 0.0
            await self.until_stopped(asyncio.wait(pending, timeout=self.straggler_wait(first)))
        if stop or self.stop_requested:  # or a signal during the waits
            await self._cut_flights(moving)
        local = [
            0 if st.round_id >= 0 and (st.flight is None or st.flight.done()) else 1
            for st in states
        ]
        agreed = await self._agree([*local, int(self.stop_requested)])
        self.stopping = self.stopping or bool(agreed[-1])
        return [st for st, flag in zip(states, agreed, strict=False) if not flag]

    async def _cut_flights(self, moving: list[RequestState]) -> None:
        """A stop was requested: each proposal in flight is cut (``SHUTTING_DOWN``) at its rows."""
        cut: dict[AsyncClient, list[int]] = {}
        waiting = []
        for st in moving:
            if st.flight is not None and not st.flight.done() and st.opened is not None:
                cut.setdefault(st.opened, []).append(st.slot)
                waiting.append(st.flight)
        for client, slots in cut.items():
            client.cut(slots, ErrorCode.SHUTTING_DOWN)
        if waiting:  # settled by the cut on this loop; a dead link's already are
            await asyncio.wait(waiting, timeout=1.0)

    async def _step(self, ready: list[RequestState], running: int) -> None:
        rounds = [self._round(st) for st in ready]
        verdicts: list[Verdict] = await self._off_loop(self.strategy.decide, rounds)
        m = self.metrics
        m.steps.inc()
        m.step_rounds.inc(len(rounds))
        m.step_slots.inc(running)
        for r, verdict in zip(rounds, verdicts, strict=True):
            self._apply(r, verdict)

    def _round(self, st: RequestState) -> Round:
        flight, st.flight = st.flight, None
        if flight is None:
            return Round(st, st.round_id, None)
        try:
            proposal = flight.result()
        except Pp1Error as exc:  # unavailable, refused locally, or connection gone
            return Round(st, st.round_id, None, exc.code)
        self.record_trip(time.perf_counter() - st.sent)
        return Round(st, st.round_id, proposal)

    def record_trip(self, rtt: float) -> None:
        """One STEP→proposal time: the metric, the summary's, the straggler wait's window."""
        self.metrics.rtt.observe(rtt)
        if len(self.round_trips) < 100_000:
            self.round_trips.append(rtt)
        self.recent_trips.append(rtt)

    def _apply(self, r: Round, verdict: Verdict) -> None:
        st, m = r.state, self.metrics
        st.round_id = -1
        if r.proposal is not None and st.opened is not None:
            r.proposal.release()
        res = verdict.result
        if res is None:
            if verdict.stop:
                self._stop(st, "target_failed", verdict.code)
            elif verdict.code is ErrorCode.CANCELLED:
                pass  # this side closed or reset the slot: not a fallback
            else:
                if verdict.code is ErrorCode.AUDIT_MISMATCH:
                    m.audit_failures.inc()
                # No row verified: the next round is target-only.
                st.fallback = verdict.code.name.lower() if verdict.code else "discarded"
                m.faults.labels(row="0", reason=st.fallback).inc()  # no row verified
            return
        rec = st.record
        rec.rounds += 1
        m.tokens.inc(len(res.tokens))
        if r.proposal is None:
            if st.fallback is not None:
                self._fallback(st, st.fallback)
                st.fallback = None
        else:
            block = verdict.block or r.proposal
            drafted = len(block.rows)
            if block.cut is not None:
                # A fault ended the block early; its rows were verified (not a fallback).
                reason = block.cut.name.lower()
                rec.cuts += 1
                rec.cut_reasons[reason] += 1
                m.cuts.labels(reason=reason).inc()
                m.faults.labels(row=str(drafted), reason=reason).inc()  # struck row `drafted`
            if self.plan.controller is not None:
                st.history = self.plan.controller.record(
                    st.history, res.accepted, res.outcome is Outcome.CORRECTION
                )
            rec.draft_tokens += drafted
            rec.accepted_tokens += res.accepted
            m.num_drafts.inc()
            m.drafts.inc(drafted)
            m.accepted.inc(res.accepted)
            for child in m.per_position[: res.accepted]:
                child.inc()
        client = st.opened
        if client is not None and not client.closed:
            try:
                client.commit(
                    st.slot, round_id=res.round_id, tokens=res.tokens, accepted=res.accepted
                )
            except Pp1Error as exc:
                # The worker is out of step (or gone): reopen before the next STEP.
                log.info("commit not sent", extra={"slot": st.slot, "error": repr(exc)})
                st.opened = None

    def _fallback(self, st: RequestState, reason: str) -> None:
        st.record.fallbacks += 1
        st.record.fallback_reasons[reason] += 1
        self.metrics.fallbacks.labels(reason=reason).inc()

    def _stop(self, st: RequestState, reason: str, code: ErrorCode | None = None) -> None:
        st.record.stopped = reason
        self.metrics.stopped.labels(reason=reason).inc()
        log.warning(
            "request stopped",
            extra={"request": st.index, "reason": reason, "code": code.name if code else None},
        )

    def _finish(self, st: RequestState) -> None:
        rec, v = st.record, st.verifier
        rec.tokens = list(v.committed[st.prompt_length :])
        rec.finished = rec.stopped is None and (v.finished or st.new_tokens >= self.plan.max_tokens)
        if rec.finished:
            self.metrics.requests.inc()

    async def _end(self, st: RequestState) -> None:
        if st.flight is not None:
            st.flight.cancel()
            st.flight = None
        self._finish(st)
        await self._close(st)

    async def _close(self, st: RequestState) -> None:
        client, st.opened = st.opened, None
        if client is not None and not client.closed:
            with contextlib.suppress(Pp1Error):
                await client.close_slot(st.slot)

    def summary(self, records: Sequence[RequestRecord]) -> dict[str, Any]:
        """The run's summary object (``--json``)."""
        m = self.metrics
        drafts = sum(r.draft_tokens for r in records)
        accepted = sum(r.accepted_tokens for r in records)
        tokens = sum(len(r.tokens) for r in records)
        rounds = int(metrics.total(m.num_drafts))
        steps = int(metrics.total(m.steps))
        slots = metrics.total(m.step_slots)
        out: dict[str, Any] = {
            "requests": len(records),
            "finished": sum(r.finished for r in records),
            "tokens": tokens,
            "rounds": sum(r.rounds for r in records),
            "draft_tokens": drafts,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "mean_accepted_length": accepted / rounds if rounds else 0.0,
            "fallbacks": sum(r.fallbacks for r in records),
            "fallbacks_by_reason": metrics.by_label(m.fallbacks),
            "cuts": sum(r.cuts for r in records),
            "cuts_by_reason": metrics.by_label(m.cuts),
            "stopped_by_reason": dict(Counter(r.stopped for r in records if r.stopped)),
            "frames_rejected": metrics.by_label(m.rejected),
            "frames_dropped": metrics.by_label(m.dropped),
            "reconnects": int(metrics.total(m.reconnects)),
            "round_trip_ms_median": (
                statistics.median(self.round_trips) * 1e3 if self.round_trips else None
            ),
            "steps": steps,
            "step_fill": metrics.total(m.step_rounds) / slots if slots else 0.0,
            "stop_rule": str(self.plan.stop),
            "mean_step_depth": self.stepped_depth / self.stepped if self.stepped else None,
            "seconds": self.seconds,
            "tokens_per_second": tokens / self.seconds if self.seconds else 0.0,
            "cpu_seconds": self.cpu_seconds,
        }
        out.update(self.strategy.summary())
        return out


# Codes of RoundDriver._prepare beside the ErrorCodes: target-only by the plan, or after a
# discarded proposal (the reason is already the request's).
_TARGET_ONLY = 1_000
_FALLBACK = 1_001
