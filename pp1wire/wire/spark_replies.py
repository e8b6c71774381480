"""The Spark side's handling of replies (``docs/protocol.md`` §4.5, §4.6, §6.5, §7): each
REPLY or COMPLETION fenced to its slot's STEP and checked as it arrives, and the block published
whole, cut by a fault, or discarded; a base class of the Spark protocol core."""

from __future__ import annotations

from collections.abc import Callable

from pp1wire.errors import ErrorCode
from pp1wire.q import validate
from pp1wire.q.proposal import Lease
from pp1wire.wire import fencing, framing, messages
from pp1wire.wire.assembly import ReplyAssembly, status_code
from pp1wire.wire.fencing import Action
from pp1wire.wire.messages import Message
from pp1wire.wire.spark_events import (
    FrameDropped,
    FrameRejected,
    ProposalFailed,
    ProposalReady,
    SparkEvent,
)
from pp1wire.wire.spark_state import SparkConfig, SparkSlot


class SparkReplies:
    """How a Spark protocol takes the replies to its STEPs (a base class of
    :class:`~pp1wire.wire.spark_core.SparkProtocol`, which provides what is declared here)."""

    config: SparkConfig
    session: int
    slots: dict[int, SparkSlot]
    _events: list[SparkEvent]
    _ready: dict[tuple[int, int], tuple[Lease, list[memoryview]]]
    _validator: validate.DenseRowValidator
    _retained: bool
    _take: Callable[[], list[SparkEvent]]
    _release: Callable[[memoryview], None]
    _known: Callable[[int, int], SparkSlot | None]
    _opened: Callable[[int], SparkSlot]

    def cut(self, slot: int, code: ErrorCode = ErrorCode.REPLY_TIMEOUT) -> list[SparkEvent]:
        """End ``slot``'s block in flight now, as its reply deadline would (§6.5): the rows
        that arrived are a proposal cut by ``code``, or with none it fails. An engine that
        stops waiting calls this: dropping the rows would select blocks by their draw time.

        Raises:
            ProtocolError: ``UNKNOWN_SLOT``.
            LocalStateError: ``NOT_READY`` before the handshake ends or after close.
        """
        state = self._opened(slot)
        if state.flight is not None:
            self._end_block(slot, state, code)
        return self._take()

    def _end_block(self, index: int, slot: SparkSlot, code: ErrorCode) -> None:
        """A fault at the next row of the block in flight: the rows before it are the block,
        cut by ``code`` (docs/adaptive.md §7); with none, the proposal is discarded."""
        flight = slot.flight
        assert flight is not None
        if flight.rows:
            self._publish(index, slot, cut=code)
        else:
            self._discard(index, slot, code)

    def _publish(self, index: int, slot: SparkSlot, *, cut: ErrorCode | None = None) -> None:
        """Hand out the flight's validated rows as its proposal (cut by ``cut``, if set)."""
        flight = slot.flight
        assert flight is not None
        step = flight.step
        slot.flight = None
        slot.fence.last_round = max(slot.fence.last_round, step.round)
        rows = tuple(flight.rows)
        slot.drafts[step.round] = tuple(r.token for r in rows)
        # A cut reply's later frames are late (LATE_FRAME), a completed one's duplicates.
        buffers = flight.settle(discarded=cut is not None)
        self._ready[(index, step.round)] = (flight.lease, buffers)
        self._events.append(
            ProposalReady(index, flight.proposal(self.session, rows, self._shard, cut))
        )

    def _discard(self, index: int, slot: SparkSlot, code: ErrorCode) -> None:
        flight = slot.flight
        assert flight is not None
        slot.flight = None
        slot.fence.last_round = max(slot.fence.last_round, flight.step.round)
        slot.drafts.pop(flight.step.round, None)
        for view in flight.settle(discarded=True):
            self._release(view)
        self._events.append(ProposalFailed(index, flight.step.generation, flight.step.round, code))

    def _fence(
        self, msg: messages.Reply | messages.Completion
    ) -> tuple[SparkSlot, ReplyAssembly] | None:
        """The slot and its in-flight reply a REPLY or COMPLETION belongs to, or None (§7)."""
        session, slot, generation, round_id = msg.session, msg.slot, msg.generation, msg.round
        state = self._known(session, slot)
        if state is None:
            return None
        decision = fencing.spark_reply(state.fence, generation, round_id)
        if decision.action is Action.ACCEPT:
            assert state.flight is not None  # accepted frames match the in-flight STEP
            return state, state.flight
        assert decision.code is not None
        if decision.action is Action.DROP:
            self._events.append(FrameDropped(slot, decision.code))
        else:
            self._events.append(FrameRejected(slot, decision.code))
            if state.flight is not None:
                self._discard(slot, state, decision.code)
        return None

    @property
    def _shard(self) -> tuple[int, int] | None:
        """The global ID range this link carries (None: unsharded)."""
        return self.config.shard_range if self.config.sharded else None

    def _on_reply(self, msg: Message, frame: framing.Frame) -> None:
        assert isinstance(msg, messages.Reply)
        if (fenced := self._fence(msg)) is None:
            return
        state, flight = fenced
        row = flight.check_row(
            msg, frame.payload, eos=state.eos, validator=self._validator, shard=self._shard
        )
        if isinstance(row, ErrorCode):  # the block ends before it; the rows before stand (§4.5)
            self._events.append(FrameRejected(msg.slot, row))
            self._end_block(msg.slot, state, row)
            return
        flight.add_row(row, frame.raw)
        self._retained = True

    def _on_completion(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, messages.Completion)
        if (fenced := self._fence(msg)) is None:
            return
        state, flight = fenced
        code = flight.check_completion(msg, eos=state.eos, shard=self._shard)
        if code is not None:
            if not (msg.status and not flight.rows and code is status_code(msg.status)):
                self._events.append(FrameRejected(msg.slot, code))  # not a reported failure
            self._discard(msg.slot, state, code)
            return
        # A nonzero status after rows: the worker failed drawing the next row, so
        # the rows it shipped are the block, cut there (§4.6).
        self._publish(msg.slot, state, cut=status_code(msg.status) if msg.status else None)
