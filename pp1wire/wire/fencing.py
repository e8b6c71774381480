"""The fencing rules of the protocol, in one place (``docs/protocol.md`` §7): from a slot's
state and a message's (session, slot, generation, round), whether it is accepted, replayed,
dropped, rejected or refused, and with which code; the cores never re-derive them."""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from pp1wire.errors import ErrorCode
from pp1wire.q.stoprules import step_rule
from pp1wire.wire.messages import Commit, Hello, Reset, Step


class Action(Enum):
    """What to do with a message."""

    ACCEPT = "accept"
    REPLAY = "replay"
    DROP = "drop"  # ignore it; count it as dropped
    REJECT = "reject"  # ignore it; count it as rejected (a frame that should not exist)
    REFUSE = "refuse"  # answer ERROR scope 0
    FAIL = "fail"  # discard the in-flight proposal (its round decodes target-only)


@dataclass(frozen=True)
class Decision:
    """An action and, for REFUSE / FAIL / DROP, the code it is reported or counted under."""

    action: Action
    code: ErrorCode | None = None


ACCEPT = Decision(Action.ACCEPT)
REPLAY = Decision(Action.REPLAY)


@dataclass
class WorkerSlotFence:
    """The fencing part of a worker slot's state."""

    generation: int
    last_step_round: int = -1
    last_step: Step | None = None
    committed_round: int = -1
    last_commit: Commit | None = None

    def invalidate(self, generation: int) -> None:
        """A new generation: every round, replay entry and commit record is gone."""
        self.generation = generation
        self.last_step_round = -1
        self.last_step = None
        self.committed_round = -1
        self.last_commit = None


def worker_slot(session: int, received_session: int, slot_open: bool) -> Decision:
    """The first rule for every slot message a worker receives: session, then slot."""
    if received_session != session:
        return Decision(Action.REFUSE, ErrorCode.WRONG_SESSION)
    if not slot_open:
        return Decision(Action.REFUSE, ErrorCode.UNKNOWN_SLOT)
    return ACCEPT


def worker_open(previous_generation: int | None, generation: int) -> Decision:
    """OPEN of a slot that is not open: a slot reopened in the same session must move to a
    higher generation, so that no frame of its earlier instance matches the new one."""
    if previous_generation is not None and generation <= previous_generation:
        return Decision(Action.REFUSE, ErrorCode.STALE_GENERATION)
    return ACCEPT


def _generation(current: int, received: int) -> Decision | None:
    if received < current:
        return Decision(Action.REFUSE, ErrorCode.STALE_GENERATION)
    if received > current:
        return Decision(Action.REFUSE, ErrorCode.FUTURE_GENERATION)
    return None


def worker_step(fence: WorkerSlotFence, step: Step) -> Decision:
    """Fencing decision for a STEP on an open slot of the right session."""
    if refused := _generation(fence.generation, step.generation):
        return refused
    if step.round > max(fence.committed_round, fence.last_step_round):
        return ACCEPT
    # Only a retry of the last STEP, the same message, while it is uncommitted.
    if step.round == fence.last_step_round > fence.committed_round and step == fence.last_step:
        return REPLAY
    return Decision(Action.REFUSE, ErrorCode.ROUND_REUSED)


def worker_commit(fence: WorkerSlotFence, commit: Commit) -> Decision:
    """Fencing decision for a COMMIT on an open slot of the right session."""
    if refused := _generation(fence.generation, commit.generation):
        return refused
    if commit == fence.last_commit:
        return REPLAY
    # Round IDs only grow: a round below the last STEP's was passed over when that
    # STEP was sent. Accepting it would move the prefix under the STEP still waiting
    # to be committed, and drop the reply its retry must replay (§7).
    if commit.round <= fence.committed_round or commit.round < fence.last_step_round:
        return Decision(Action.REFUSE, ErrorCode.ROUND_REUSED)
    if commit.accepted and commit.round != fence.last_step_round:
        return Decision(Action.REFUSE, ErrorCode.COMMIT_INVALID)
    return ACCEPT


def worker_reset(fence: WorkerSlotFence, reset: Reset) -> Decision:
    """Fencing decision for a RESET on an open slot of the right session."""
    if reset.generation < fence.generation:
        return Decision(Action.REFUSE, ErrorCode.STALE_GENERATION)
    if reset.generation == fence.generation:
        return REPLAY
    return ACCEPT


class SparkInFlight(Protocol):
    """What the Spark-side rules read of a slot's outstanding STEP (a ``ReplyAssembly``)."""

    @property
    def step(self) -> Step:
        """The STEP (its generation and round are the ones its reply must name)."""

    settled: bool  # completed or discarded: later frames are late
    discarded: bool


@dataclass
class SparkSlotFence:
    """The fencing part of a Spark-side slot's state."""

    generation: int
    last_round: int = -1
    in_flight: SparkInFlight | None = None


def spark_slot(session: int, received_session: int, slot_open: bool) -> Decision:
    """The first rule for every slot message the Spark side receives: another session's
    frame is rejected, then a frame for a slot that is not open is dropped."""
    if received_session != session:
        return Decision(Action.REJECT, ErrorCode.WRONG_SESSION)
    if not slot_open:
        return Decision(Action.DROP, ErrorCode.UNKNOWN_SLOT)
    return ACCEPT


def spark_reply(fence: SparkSlotFence, generation: int, round_id: int) -> Decision:
    """Fencing decision for a REPLY or COMPLETION on an open slot of the right session."""
    if generation > fence.generation:
        return Decision(Action.FAIL, ErrorCode.FUTURE_GENERATION)
    flight = fence.in_flight
    if generation < fence.generation:
        return Decision(Action.DROP, ErrorCode.STALE_GENERATION)
    if flight is None:
        if round_id <= fence.last_round:
            return Decision(Action.DROP, ErrorCode.ROUND_REUSED)
        return Decision(Action.FAIL, ErrorCode.ROW_OUT_OF_ORDER)
    if round_id < flight.step.round:
        return Decision(Action.DROP, ErrorCode.ROUND_REUSED)
    if round_id > flight.step.round:
        return Decision(Action.FAIL, ErrorCode.ROW_OUT_OF_ORDER)
    if flight.discarded:
        return Decision(Action.DROP, ErrorCode.LATE_FRAME)
    if flight.settled:
        return Decision(Action.DROP, ErrorCode.COMPLETION_DUPLICATE)
    return ACCEPT


def worker_step_fields(
    limits: Hello, prefix: Sized, digest: int, context: int, fence: WorkerSlotFence, step: Step
) -> ErrorCode | None:
    """A fresh STEP's fields against the negotiated ``limits`` (the accepted HELLO) and its
    slot's committed prefix, digest and context (§4.4), and the one-fresh-proposal-per-slot
    rule: None if it may be drawn."""
    if not 1 <= step.depth <= limits.max_depth:
        return ErrorCode.DEPTH_OUT_OF_RANGE
    if isinstance(rule := step_rule(step.stop, step.threshold, limits.stop_rules), ErrorCode):
        return rule
    if step.support > limits.max_support:
        return ErrorCode.SUPPORT_OUT_OF_RANGE
    if not (math.isfinite(step.temperature) and step.temperature >= 0.0):
        return ErrorCode.BAD_TEMPERATURE
    if step.position != len(prefix):
        return ErrorCode.WRONG_POSITION
    if step.digest != digest:
        return ErrorCode.PREFIX_DIGEST_MISMATCH
    if step.context != context:
        return ErrorCode.CONTEXT_MISMATCH
    if fence.last_step_round > fence.committed_round:
        # One fresh proposal per slot until it is committed (or the slot reset), so a
        # peer that never commits cannot make the worker draw without bound.
        return ErrorCode.STEP_UNCOMMITTED
    return None
