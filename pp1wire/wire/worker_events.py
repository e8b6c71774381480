"""What the worker's sans-IO core reports to its shell: events for logs and metrics, and the
deferred draw a shell runs off its event loop (a job carries the callables that draw it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

from pp1wire.errors import ErrorCode, Pp1Error
from pp1wire.q.proposal import (
    DrafterFn,
    DraftingStoppedError,
    DraftJob,
    QRow,
    propose,
    stopped_by,
)
from pp1wire.q.rng import Role, RoundStreams
from pp1wire.q.stoprules import StopKind, StopRule, stopped_by_rule
from pp1wire.wire.events import Event, HandshakeDone
from pp1wire.wire.messages import MsgType, Scope, Step
from pp1wire.wire.replies import FrameParts, ReplyEncoder

Proposer = Callable[[int, Sequence[int], Step, "int | None"], tuple[QRow, ...]]
"""A STEP's rows from ``(seed, committed prefix, step, eos)`` in place of the local chain:
a sharded worker rank's, drawn with its group (§6.7). It may block, and raises
:class:`~pp1wire.errors.Pp1Error` for a COMPLETION status."""


class StepServed(Event):
    """A STEP was answered with a fresh proposal (or a failed completion)."""

    slot: int
    generation: int
    round: int
    rows: int
    status: int
    reply_bytes: int
    draw_seconds: float  # drafter, q construction and encoding of this STEP alone
    #: The bug (drafter or proposer) behind an ``INTERNAL`` status, for the shell's log.
    failure: BaseException | None = None


class DrawSlot(Protocol):
    """What a draw reads of the slot it is for."""

    @property
    def seed(self) -> int:
        """The request's seed."""

    @property
    def prefix(self) -> Sequence[int]:
        """The committed prefix."""

    @property
    def eos(self) -> int | None:
        """The terminal token, if any."""


class Streamer(Protocol):
    """Where a job's REPLY frames go as their rows are drawn (a shell's, to its core's
    :meth:`WorkerProtocol.stream_rows`); called on the drawing thread, it must not block."""

    def send(self, frames: list[tuple[DrawJob, FrameParts]]) -> None:
        """Send each job's frame (in order, per job)."""


@dataclass(eq=False, slots=True)
class DrawJob:
    """A STEP's proposal to draw, handed to the shell by :class:`DrawRequested`.

    It holds what a draw reads (the slot's seed, committed prefix and terminal token, the
    STEP, the drafter), which cannot change while the core holds the slot's later
    messages, so it may run on another thread. :meth:`run` draws it alone; a batch
    runner gives each :attr:`local` job its rows through :meth:`complete`. Each row is
    framed as it is drawn (:meth:`row_frame`) and, with a :attr:`streamer`, sent at once
    (``docs/adaptive.md`` §7); the COMPLETION follows when the draw is done.

    ``slot`` is the core's (compared by identity); the rows come from ``proposer`` when
    given (a sharded group), else the local chain over ``drafter``, whose rows must have
    ``vocab_size`` entries when given; ``encoder`` frames the rows and the COMPLETION.
    """

    slot: DrawSlot
    step: Step
    _: KW_ONLY
    drafter: DrafterFn
    proposer: Proposer | None
    encoder: ReplyEncoder
    vocab_size: int | None = None
    #: Where the job's rows go as they are drawn (None: with the COMPLETION).
    streamer: Streamer | None = field(default=None, init=False)
    #: The shell's handle on the job's connection (its streamer's business).
    owner: object = field(default=None, init=False)
    _frames: list[FrameParts] = field(default_factory=list, init=False)
    _framed: list[QRow] = field(default_factory=list, init=False)  # may be on the wire

    @property
    def seed(self) -> int:
        """The request's seed."""
        return self.slot.seed

    @property
    def prefix(self) -> Sequence[int]:
        """The committed prefix the STEP follows."""
        return self.slot.prefix

    @property
    def eos(self) -> int | None:
        """The terminal token, if any."""
        return self.slot.eos

    @property
    def stop(self) -> StopRule:
        """The STEP's stop rule (checked when the STEP was accepted)."""
        return StopRule(StopKind(self.step.stop), self.step.threshold)

    @property
    def local(self) -> bool:
        """Whether the rows come from the local chain (else only :meth:`run` draws them)."""
        return self.proposer is None

    def draft_job(self) -> DraftJob:
        """What :func:`~pp1wire.q.batch.propose_batch` needs to draw this job's rows."""
        step = self.step
        return DraftJob(
            seed=self.seed,
            generation=step.generation,
            round_id=step.round,
            prefix=self.prefix,
            depth=step.depth,
            temperature=step.temperature,
            support=step.support,
            eos=self.eos,
            stop=self.stop,
        )

    def row_frame(self, index: int, row: QRow) -> FrameParts | None:
        """Frame row ``index`` as it is drawn; None if it was framed already (redrawn, the
        same row) or an earlier row could not be (the block ends there).

        Raises:
            Exception: whatever framing a row a drafter shaped wrongly raises.
        """
        if index != len(self._frames):
            return None
        frame = self.encoder.row(index, row)
        self._frames.append(frame)
        self._framed.append(row)
        return frame

    def _stream(self, index: int, row: QRow) -> None:
        frame = self.row_frame(index, row)
        if frame is not None and self.streamer is not None:
            self.streamer.send([(self, frame)])

    def draw(self) -> tuple[QRow, ...]:
        """The STEP's rows (the drafter or proposer may raise anything)."""
        step = self.step
        if self.proposer is not None:
            return self.proposer(self.seed, self.prefix, step, self.eos)
        return propose(
            self.prefix,
            step.depth,
            self.drafter,
            RoundStreams(Role.WORKER, self.seed, step.generation, step.round),
            temperature=step.temperature,
            support=step.support or None,
            eos=self.eos,
            stop=self.stop,
            on_row=self._stream,
            vocab_size=self.vocab_size,
        )

    def run(self) -> DrawResult:
        """Draw and encode the reply (the drafter, q construction, framing); never raises."""
        started = time.perf_counter()
        try:
            rows = self.draw()
        except Exception as exc:  # a plugin failure must not kill the connection
            return self.complete(exc, started=started)
        return self.complete(rows, started=started)

    def complete(
        self, rows: tuple[QRow, ...] | BaseException, *, started: float | None = None
    ) -> DrawResult:
        """The result of this job from rows drawn elsewhere, or the exception that stopped
        them: a :class:`~pp1wire.errors.Pp1Error`'s code is the COMPLETION status, anything
        else ``INTERNAL`` (kept in :attr:`DrawResult.failure` for the log). The rows framed
        before a failure (maybe streamed) are shipped with its status, never taken back.
        ``started`` (a :func:`time.perf_counter` reading) dates the draw. Never raises.
        """
        begun = time.perf_counter() if started is None else started
        if isinstance(rows, BaseException) and not isinstance(rows, DraftingStoppedError):
            # Rows framed before it may be on the wire already (streamed): the
            # failure comes after them, as a drafter's failure after i rows does.
            rows = stopped_by(rows, self._framed)
        failure: BaseException | None = None
        status = 0
        if isinstance(rows, DraftingStoppedError):
            # The rows drawn before the failure are shipped with its status: the
            # Spark side verifies them as a block that stopped there (§4.6).
            cut_by, rows = rows, rows.rows
            status = int(cut_by.code)
            cause: BaseException | None = cut_by.failure
            if isinstance(cause, Pp1Error):
                # A status on purpose is not logged; a plugin's bug behind INTERNAL is.
                cause = cause.__cause__ if cut_by.code is ErrorCode.INTERNAL else None
            failure = cause
        elif isinstance(rows, Pp1Error):  # a status on purpose (q construction, a group's code)
            cause = rows.__cause__
            if rows.code is ErrorCode.INTERNAL and not isinstance(cause, Pp1Error | None):
                failure = cause  # a plugin's bug a batch runner wrapped: logged by the shell
            status, rows = int(rows.code), ()
        elif isinstance(rows, BaseException):  # a bug in a plugin: logged by the shell
            status, failure, rows = int(ErrorCode.INTERNAL), rows, ()
        for index, row in enumerate(rows):
            try:
                self.row_frame(index, row)
            except Exception as exc:  # a row a drafter shaped wrongly: the block ends before it
                failure, rows, status = exc, rows[:index], int(ErrorCode.INTERNAL)
                break
        frames = tuple(self._frames[: len(rows)])
        tokens = [r.token for r in rows]
        # Only the stop rule ends a block early without a terminal token (§4.6).
        stopped = bool(rows) and not status and stopped_by_rule(self.step.depth, tokens, self.eos)
        reply = (*frames, self.encoder.completion(frames, status, stopped=stopped))
        return DrawResult(reply, rows, status, time.perf_counter() - begun, failure)


@dataclass(frozen=True)
class DrawResult:
    """What :meth:`DrawJob.run` (or :meth:`DrawJob.complete`) produced."""

    reply: tuple[FrameParts, ...]
    rows: tuple[QRow, ...]
    status: int
    seconds: float
    #: The unexpected exception (not a Pp1Error) that stopped the draw, for the shell's log.
    failure: BaseException | None = None


class GroupDraws(Protocol):
    """A rank of a vocabulary-sharded worker group (§6.7): it draws its links' STEPs with its
    group, matched per group session, streams each row as drawn, then calls ``done``."""

    def join(self, link: Hashable, group: bytes) -> bool:
        """A link's handshake named ``group``: False if another live link serves it here."""

    def submit(self, link: Hashable, job: DrawJob, done: Callable[[DrawResult], None]) -> None:
        """Draw ``job`` (never blocks; the result comes later, through ``done``)."""

    def leave(self, link: Hashable) -> None:
        """The link is gone: everything held for it is dropped."""


class DrawRequested(Event):
    """An accepted STEP's proposal must be drawn: run ``job`` (off the event loop)
    and give the result to :meth:`WorkerProtocol.finish_draw`."""

    job: DrawJob


class StepReplayed(Event):
    """A retried STEP got the cached, byte-identical reply."""

    slot: int
    round: int


class Refused(Event):
    """A message was refused with an ERROR."""

    code: ErrorCode
    answers: MsgType | None
    scope: Scope


class SlotEvent(Event):
    """OPEN, COMMIT, RESET or CLOSE took effect on a slot."""

    kind: MsgType
    slot: int
    generation: int
    position: int
    tokens: int = 0  # COMMIT: tokens appended
    proposed: bool = False  # COMMIT: the round is the slot's last drawn proposal (not target-only)


class ConnectionClosing(Event):
    """The core wants the connection closed after its pending bytes are sent."""

    code: ErrorCode | None


WorkerEvent = (
    HandshakeDone
    | StepServed
    | StepReplayed
    | Refused
    | SlotEvent
    | ConnectionClosing
    | DrawRequested
)
