"""Events the Spark side's sans-IO core hands to its shell (one class per kind)."""

from __future__ import annotations

from pp1wire.errors import ErrorCode
from pp1wire.q.proposal import Proposal
from pp1wire.wire.events import Event, HandshakeDone


class SlotOpened(Event):
    """OPEN was acknowledged."""

    slot: int
    generation: int
    position: int


class ProposalReady(Event):
    """A proposal passed validation and may be verified: every row, or those before the
    fault that cut it (``proposal.cut``)."""

    slot: int
    proposal: Proposal


class ProposalFailed(Event):
    """The in-flight proposal was discarded; decode this round target-only."""

    slot: int
    generation: int
    round: int
    code: ErrorCode


class CommitAcked(Event):
    """The worker applied a COMMIT."""

    slot: int
    generation: int
    round: int
    position: int


class ResetAcked(Event):
    """The worker applied (or re-acknowledged) a RESET."""

    slot: int
    generation: int
    position: int


class SlotClosed(Event):
    """CLOSE was acknowledged."""

    slot: int


class SlotDesynced(Event):
    """The worker refused a slot-level request; the slot must be reopened."""

    slot: int
    code: ErrorCode


class FrameDropped(Event):
    """A late, stale or duplicate frame was dropped (nothing consumed)."""

    slot: int | None
    code: ErrorCode


class FrameRejected(Event):
    """A frame failed validation (counted by code)."""

    slot: int | None
    code: ErrorCode


class PongReceived(Event):
    """Answer to our PING."""

    nonce: int


class ConnectionFailed(Event):
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
