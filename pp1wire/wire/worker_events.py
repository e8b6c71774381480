"""What the worker's sans-IO core reports to its shell (:mod:`pp1wire.wire.worker_core`).

Events for logs and metrics, and the deferred draw a shell runs off its event
loop (:class:`DrawRequested`, :class:`DrawJob`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pp1wire.errors import ErrorCode
from pp1wire.q.proposal import QRow
from pp1wire.wire.messages import Hello, MsgType, Scope, Step
from pp1wire.wire.replies import FrameParts

if TYPE_CHECKING:
    from pp1wire.wire.worker_core import WorkerProtocol, WorkerSlot


Proposer = Callable[[int, Sequence[int], Step, "int | None"], tuple[QRow, ...]]
"""A STEP's rows from ``(seed, committed prefix, step, eos)`` in place of the local
chain (:func:`pp1wire.q.proposal.propose`): a worker rank of a vocabulary-sharded
group draws with its group and returns its shard's rows (protocol §6.7). It may
block; it raises :class:`~pp1wire.errors.Pp1Error` for a COMPLETION status."""


@dataclass(frozen=True)
class HandshakeDone:
    """The peer passed HELLO (and authentication, if configured)."""

    session: int
    peer: Hello


@dataclass(frozen=True)
class StepServed:
    """A STEP was answered with a fresh proposal (or a failed completion)."""

    slot: int
    generation: int
    round: int
    rows: int
    status: int
    reply_bytes: int
    draw_seconds: float  # drafter, q construction and encoding of this STEP alone


class DrawJob:
    """A STEP's proposal to draw, handed to the shell by :class:`DrawRequested`.

    :meth:`run` reads only the slot's frozen state (its prefix cannot change
    while the draw is outstanding: the core holds every later message for that
    slot), so a shell may call it on another thread.
    """

    __slots__ = ("_core", "slot", "step")

    def __init__(self, core: WorkerProtocol, slot: WorkerSlot, step: Step) -> None:
        """A job for ``step`` on ``slot``."""
        self._core = core
        self.slot = slot
        self.step = step

    def run(self) -> DrawResult:
        """Draw and encode the reply (the drafter, q construction, framing); never raises."""
        started = time.perf_counter()
        reply, rows, status = self._core._propose(self.slot, self.step)
        return DrawResult(reply, rows, status, time.perf_counter() - started)


@dataclass(frozen=True)
class DrawResult:
    """What :meth:`DrawJob.run` produced."""

    reply: tuple[FrameParts, ...]
    rows: tuple[QRow, ...]
    status: int
    seconds: float


@dataclass(frozen=True)
class DrawRequested:
    """An accepted STEP's proposal must be drawn: run ``job`` (off the event loop)
    and give the result to :meth:`WorkerProtocol.finish_draw`."""

    job: DrawJob


@dataclass(frozen=True)
class StepReplayed:
    """A retried STEP got the cached, byte-identical reply."""

    slot: int
    round: int


@dataclass(frozen=True)
class Refused:
    """A message was refused with an ERROR."""

    code: ErrorCode
    answers: MsgType | None
    scope: Scope


@dataclass(frozen=True)
class SlotEvent:
    """OPEN, COMMIT, RESET or CLOSE took effect on a slot."""

    kind: MsgType
    slot: int
    generation: int
    position: int
    tokens: int = 0  # COMMIT: tokens appended
    proposed: bool = False  # COMMIT: the round is the slot's last drawn proposal (not target-only)


@dataclass(frozen=True)
class ConnectionClosing:
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
