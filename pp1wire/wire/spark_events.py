"""Events the Spark side's sans-IO core hands to its shell (one class per kind)."""

from __future__ import annotations

from dataclasses import dataclass

from pp1wire.errors import ErrorCode
from pp1wire.q.proposal import Proposal
from pp1wire.wire.messages import Hello


@dataclass(frozen=True)
class HandshakeDone:
    """The worker accepted our HELLO; ``session`` is on every later message."""

    session: int
    peer: Hello


@dataclass(frozen=True)
class SlotOpened:
    """OPEN was acknowledged."""

    slot: int
    generation: int
    position: int


@dataclass(frozen=True)
class ProposalReady:
    """A whole proposal passed validation and may be verified."""

    slot: int
    proposal: Proposal


@dataclass(frozen=True)
class ProposalFailed:
    """The in-flight proposal was discarded; decode this round target-only."""

    slot: int
    generation: int
    round: int
    code: ErrorCode


@dataclass(frozen=True)
class CommitAcked:
    """The worker applied a COMMIT."""

    slot: int
    generation: int
    round: int
    position: int


@dataclass(frozen=True)
class ResetAcked:
    """The worker applied (or re-acknowledged) a RESET."""

    slot: int
    generation: int
    position: int


@dataclass(frozen=True)
class SlotClosed:
    """CLOSE was acknowledged."""

    slot: int


@dataclass(frozen=True)
class SlotDesynced:
    """The worker refused a slot-level request; the slot must be reopened."""

    slot: int
    code: ErrorCode


@dataclass(frozen=True)
class FrameDropped:
    """A late, stale or duplicate frame was dropped (nothing consumed)."""

    slot: int | None
    code: ErrorCode


@dataclass(frozen=True)
class FrameRejected:
    """A frame failed validation (counted by code)."""

    slot: int | None
    code: ErrorCode


@dataclass(frozen=True)
class PongReceived:
    """Answer to our PING."""

    nonce: int


@dataclass(frozen=True)
class ConnectionFailed:
    """The connection is dead; every slot and in-flight proposal with it."""

    code: ErrorCode


SparkEvent = (
    HandshakeDone
    | SlotOpened
    | ProposalReady
    | ProposalFailed
    | CommitAcked
    | ResetAcked
    | SlotClosed
    | SlotDesynced
    | FrameDropped
    | FrameRejected
    | PongReceived
    | ConnectionFailed
)
