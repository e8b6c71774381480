"""The Spark side's configuration, per-slot state, and the answers it is owed (re-exported by
:mod:`pp1wire.wire.spark_core`)."""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

from pp1wire.q.proposal import PrefixDigest
from pp1wire.wire.assembly import ReplyAssembly
from pp1wire.wire.fencing import SparkSlotFence
from pp1wire.wire.handshake import PeerConfig
from pp1wire.wire.messages import GROUP_NONCE_SIZE, Message, MsgType


@dataclass(frozen=True)
class SparkConfig(PeerConfig):
    """What the Spark side needs from a worker; sent in its HELLO (``draft_identity`` pins a
    drafter, "" accepts any)."""

    draft_identity: str = ""
    reply_timeout: float = 5.0
    # Seconds an OPEN, CLOSE, COMMIT or RESET may wait for its answer (§7); None: reply_timeout.
    answer_timeout: float | None = None

    def __post_init__(self) -> None:
        """Check the configuration.

        Raises:
            ValueError: as :class:`PeerConfig`, or a sharded link without its 16-byte group nonce.
        """
        super().__post_init__()
        if self.sharded and len(self.group) != GROUP_NONCE_SIZE:
            raise ValueError(
                f"a sharded Spark link needs its group's {GROUP_NONCE_SIZE}-byte nonce"
            )


@dataclass
class SparkSlot:
    """The Spark side's state for one slot."""

    context: int
    eos: int | None
    prefix: array[int]
    hasher: PrefixDigest  # the prefix's digest, extended as it grows
    fence: SparkSlotFence
    desynced: bool = False
    flight: ReplyAssembly | None = None
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def digest(self) -> int:
        """The committed prefix's digest."""
        return self.hasher.value


# The answers a worker owes this side's slot requests (§4.3, §4.7, §4.8), and the
# requests an ERROR may answer in their place (§4.9).
_ANSWERS = frozenset({MsgType.OPENED, MsgType.CLOSED, MsgType.COMMITTED, MsgType.RESET_DONE})
_ANSWERED = frozenset({MsgType.OPEN, MsgType.CLOSE, MsgType.COMMIT, MsgType.RESET})


class OwedAnswers:
    """Per slot, the deadlines of OPEN, CLOSE, COMMIT and RESET still owed an answer, oldest
    first: a worker answers each slot in order (§4.4), so an answer settles the oldest."""

    def __init__(self) -> None:
        """Nothing owed."""
        self._owed: dict[int, deque[float]] = {}

    def owe(self, slot: int, deadline: float) -> None:
        """The request just sent on ``slot`` is owed an answer by ``deadline``."""
        self._owed.setdefault(slot, deque()).append(deadline)

    def settle(self, kind: MsgType, msg: Message) -> None:
        """``msg`` of type ``kind`` arrived: if it answers a slot request, settle the oldest."""
        slot = getattr(msg, "slot", None)
        answers = kind in _ANSWERS or (
            kind is MsgType.ERROR and getattr(msg, "answers", None) in _ANSWERED
        )
        owed = self._owed.get(slot) if slot is not None and answers else None
        if owed:
            owed.popleft()
            if not owed:
                del self._owed[slot]  # type: ignore[arg-type]

    def next_deadline(self) -> float | None:
        """The earliest deadline owed, if any."""
        return min((owed[0] for owed in self._owed.values()), default=None)

    def overdue(self, now: float) -> bool:
        """Whether an answer is owed past its deadline at ``now``."""
        deadline = self.next_deadline()
        return deadline is not None and now >= deadline
