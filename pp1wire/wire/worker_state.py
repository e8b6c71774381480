"""The worker's configuration and per-slot state (re-exported by
:mod:`pp1wire.wire.worker_core`)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from pp1wire.q.proposal import PrefixDigest
from pp1wire.q.stoprules import STOP_RULES
from pp1wire.wire.budgets import DRAW_BURST
from pp1wire.wire.fencing import WorkerSlotFence
from pp1wire.wire.handshake import PeerConfig
from pp1wire.wire.messages import Committed, Open
from pp1wire.wire.replies import FrameParts


@dataclass(frozen=True)
class WorkerConfig(PeerConfig):
    """What this worker serves and the most it allows a peer to ask for."""

    draft_identity: str = "pp1-toy-drafter"
    draft_native: bool = True
    idle_timeout: float = 300.0
    #: Fresh draws per second per slot (None: any), and ahead of it (§4.4, DRAW_RATE_LIMITED).
    max_draw_rate: float | None = None
    draw_burst: int = DRAW_BURST
    #: Draws one principal may leave uncommitted per second (None: any), and at once.
    abandon_rate: float | None = 1.0
    abandon_burst: int = 8
    stop_rules: str = STOP_RULES  #: the stop rules applied (docs/adaptive.md)


@dataclass
class WorkerSlot:
    """One open session slot: committed prefix, RNG seed and fencing state."""

    open_msg: Open
    seed: int
    context: int
    eos: int | None
    prefix: array[int]
    hasher: PrefixDigest  # the prefix's digest, extended as it grows
    fence: WorkerSlotFence
    drafts: tuple[int, ...] = ()
    reply: tuple[FrameParts, ...] | None = None
    committed_msg: Committed | None = None

    @property
    def digest(self) -> int:
        """The committed prefix's digest."""
        return self.hasher.value
