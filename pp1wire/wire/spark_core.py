"""Sans-IO protocol core of the Spark (verifier) role: everything the worker sends is validated
before use; a proposal is published when its COMPLETION checks, or cut by a fault after the rows
that arrived valid (``docs/adaptive.md`` §7); one with none is discarded (target-only)."""

from __future__ import annotations

import hmac
import secrets
from array import array
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from pp1wire.errors import ErrorCode, LocalStateError, ProtocolError
from pp1wire.q import validate
from pp1wire.q.proposal import Lease, PrefixDigest
from pp1wire.q.rng import Role
from pp1wire.q.stoprules import FIXED, STOP_RULES, StopKind, StopRule
from pp1wire.wire import fencing, framing, integrity, messages, transitions
from pp1wire.wire.assembly import ReplyAssembly, status_code
from pp1wire.wire.events import HandshakeDone
from pp1wire.wire.fencing import Action, SparkSlotFence
from pp1wire.wire.handshake import (
    ECHOED_LIMITS,
    build_hello,
    first_failure,
    spark_proof,
    worker_proof,
)
from pp1wire.wire.messages import Message, MsgType, Scope, Step
from pp1wire.wire.spark_events import (
    CommitAcked,
    ConnectionFailed,
    FrameDropped,
    FrameRejected,
    PongReceived,
    ResetAcked,
    SlotClosed,
    SlotDesynced,
    SlotOpened,
    SparkEvent,
)
from pp1wire.wire.spark_replies import SparkReplies
from pp1wire.wire.spark_state import OwedAnswers, SparkConfig, SparkSlot
from pp1wire.wire.transitions import Act, State

_T = TypeVar("_T")


class SparkProtocol(SparkReplies):
    """The Spark side's connection state machine (one instance per connection)."""

    def __init__(
        self,
        config: SparkConfig,
        now: float,
        *,
        allocator: framing.Allocator | None = None,
        release: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Prepare a connection; call :meth:`start` to queue HELLO. ``allocator`` gives large
        frames their receive buffers and ``release`` takes each back (a buffer pool)."""
        self.config = config
        self.state = State.IDLE
        self.session = 0
        self.lineage = b""  # issued by the worker's HELLO (§4.4), presented on a reconnect
        self.decoder = framing.FrameDecoder(0, allocator=allocator)
        self.slots: dict[int, SparkSlot] = {}
        self._out: list[bytes] = []
        self._events: list[SparkEvent] = []
        self._nonce = secrets.token_bytes(32)
        self._hello_header = b""
        self._hello: messages.Hello | None = None
        self.handshake_deadline: float | None = None
        self._validator = validate.DenseRowValidator(config.vocab_size, config.entries)
        self._worker_proved = False
        # Frame integrity (§5.1): keys once AUTH is sent, tags from the worker's HELLO on.
        self._sealer: integrity.Sealer | None = None
        self._receive_rule = integrity.ReceiveRule(integrity.SPARK_UNTAGGED_BEFORE_HELLO)
        self._handlers = transitions.handlers(transitions.SPARK, self)
        self._retained = False
        # Per slot, CLOSEs not yet acknowledged: frames of the closed instance are ignored.
        self._closing: dict[int, int] = {}
        self._slot_generations: dict[int, int] = {}
        self._owed = OwedAnswers()
        # Ready proposals not released yet: their rows' lease and buffers.
        self._ready: dict[tuple[int, int], tuple[Lease, list[memoryview]]] = {}
        self._release_buffer = release
        self.closed = False

    @property
    def has_output(self) -> bool:
        """True if :meth:`data_to_send` has bytes waiting."""
        return bool(self._out)

    def data_to_send(self) -> list[bytes]:
        """Bytes queued for the worker, in order (the queue is emptied)."""
        out, self._out = self._out, []
        return out

    def _request(self, slot: int, msg: Message, now: float | None, payload: bytes = b"") -> None:
        """Queue a request on ``slot``, owed an answer within the answer timeout (default:
        the reply timeout); none without a clock reading."""
        self._send(msg, payload)
        if now is not None:
            wait = self.config.answer_timeout
            self._owed.owe(slot, now + (self.config.reply_timeout if wait is None else wait))

    def _send(self, msg: Message, payload: bytes = b"") -> None:
        frame = framing.encode_frame(msg, payload, tagged=self._sealer is not None)
        self._out.append(frame)
        if self._sealer is not None:
            self._out.append(self._sealer.tag_next(frame))

    def _take(self) -> list[SparkEvent]:
        events, self._events = self._events, []
        return events

    def next_deadline(self) -> float | None:
        """The earliest handshake, reply or answer deadline, if any."""
        times = [s.flight.deadline for s in self.slots.values() if s.flight is not None]
        if (owed := self._owed.next_deadline()) is not None:
            times.append(owed)
        if self.handshake_deadline is not None:
            times.append(self.handshake_deadline)
        return min(times) if times and not self.closed else None

    def handle_timer(self, now: float) -> list[SparkEvent]:
        """Cut or fail proposals past their reply deadline; fail a stalled handshake;
        end the connection when a request went unanswered past its deadline."""
        if self.closed:
            return []
        if self.handshake_deadline is not None and now >= self.handshake_deadline:
            self._fatal(ErrorCode.HANDSHAKE_TIMEOUT)
            return self._take()
        if self._owed.overdue(now):
            # A mute worker: as a lost connection, every slot is reopened on a new one.
            self._fatal(ErrorCode.ANSWER_TIMEOUT)
            return self._take()
        for index, slot in self.slots.items():
            if slot.flight is not None and now >= slot.flight.deadline:
                # The rows that arrived are a block the deadline stopped (§6.5).
                self._end_block(index, slot, ErrorCode.REPLY_TIMEOUT)
        return self._take()

    def receive_data(self, data: bytes | memoryview, now: float) -> list[SparkEvent]:
        """Feed bytes from the worker; returns the events they caused."""
        return self._receive(self.decoder.feed, data)

    def get_buffer(self) -> memoryview:
        """Where a buffered transport should write received bytes next.

        Raises:
            ProtocolError: if the decoder has already failed.
        """
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int, now: float) -> list[SparkEvent]:
        """``nbytes`` were written into :meth:`get_buffer`; returns the events caused."""
        return self._receive(self.decoder.buffer_updated, nbytes)

    def _receive(self, decode: Callable[[_T], list[framing.Frame]], arg: _T) -> list[SparkEvent]:
        if self.closed:
            return []
        try:
            frames = decode(arg)
        except ProtocolError as exc:
            return self._framing_failed(exc.code)
        if not frames and self.decoder.error is None:
            return []  # the common case mid-frame: nothing to do
        for frame in frames:
            if self.closed:
                self._release(frame.raw)
                continue
            self._retained = False
            if not self._receive_rule.accepts(frame):
                self._reject_fatal(ErrorCode.INTEGRITY_FAILED, frame.type)
                self._release(frame.raw)
                continue
            self._dispatch(frame)
            if not self._retained:
                self._release(frame.raw)
        # Valid frames ahead of a framing error are handled first, then the error.
        error = self.decoder.error
        if error is not None and not self.closed:
            return self._framing_failed(error.code)
        return self._take()

    def _framing_failed(self, code: ErrorCode) -> list[SparkEvent]:
        self._reject_fatal(code)
        return self._take()

    def _release(self, view: memoryview) -> None:
        if self._release_buffer is not None:
            self._release_buffer(view)

    def release_proposal(self, slot: int, round_id: int) -> None:
        """The caller is done with a ready proposal's rows: recycle their buffers."""
        lease, buffers = self._ready.pop((slot, round_id), (None, []))
        if lease is not None:
            lease.released = True  # the rows' views are about to be overwritten
        for view in buffers:
            self._release(view)

    def connection_lost(self) -> list[SparkEvent]:
        """The transport is gone: every in-flight proposal fails, every slot is dropped."""
        if not self.closed:
            self._close_all(ErrorCode.CONNECTION_LOST)
        return self._take()

    def start(self, now: float) -> None:
        """Queue HELLO and arm the handshake timeout."""
        cfg = self.config
        hello = build_hello(
            Role.SPARK,
            cfg,
            draft_identity=cfg.draft_identity,
            draft_native=True,
            limits=None,
            nonce=self._nonce,
        )
        frame = framing.encode_frame(hello)
        self._hello = hello
        self._hello_header = frame[framing.PREAMBLE_SIZE :]
        self._out.append(frame)
        self.state = State.AWAIT_HELLO
        self.handshake_deadline = now + cfg.handshake_timeout

    @property
    def stop_rules(self) -> str:
        """The stop-rule set the handshake agreed on (``""`` before it, or none)."""
        hello = self._hello
        return hello.stop_rules if hello is not None and self.state is State.READY else ""

    def _require_ready(self) -> None:
        if self.closed or self.state is not State.READY:
            raise LocalStateError(ErrorCode.NOT_READY, "connection not ready")

    def open_slot(
        self,
        slot: int,
        *,
        seed: int,
        prefix: Sequence[int],
        context: int = 0,
        eos: int | None = None,
        generation: int | None = None,
        at_least: int = 0,
        now: float | None = None,
    ) -> int:
        """Queue OPEN for ``slot`` with its committed prefix and request seed; returns its
        generation: above any the slot had on this connection (``None``: the next one, at
        least ``at_least``, so that no RNG key of an earlier connection is reused). With
        ``now``, OPENED is owed within the answer timeout (else ``ANSWER_TIMEOUT``).

        Raises:
            ProtocolError: ``SLOT_LIMIT``, ``SLOT_IN_USE``, ``STALE_GENERATION``,
                ``TOKEN_OUT_OF_RANGE`` or ``LIMIT_EXCEEDED``; nothing is sent then.
            LocalStateError: ``NOT_READY`` before the handshake ends or after close.
        """
        self._require_ready()
        floor = self._slot_generations.get(slot)
        if generation is None:
            generation = max(at_least, 0 if floor is None else floor + 1)
        elif floor is not None and generation <= floor:
            raise ProtocolError(
                ErrorCode.STALE_GENERATION, f"slot {slot} already had generation {floor}"
            )
        if not 0 <= slot < self.config.max_slots:
            raise ProtocolError(ErrorCode.SLOT_LIMIT, f"slot {slot}")
        if slot in self.slots:
            raise ProtocolError(ErrorCode.SLOT_IN_USE, f"slot {slot}")
        tokens = array("i", [int(t) for t in prefix])
        if any(not 0 <= t < self.config.vocab_size for t in tokens):
            raise ProtocolError(ErrorCode.TOKEN_OUT_OF_RANGE, "prefix token outside the vocabulary")
        if len(tokens) > self.config.max_prefix:
            raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, "prefix longer than negotiated")
        hasher = PrefixDigest(tokens)
        digest = hasher.value
        self.slots[slot] = SparkSlot(
            context=context,
            eos=eos,
            prefix=tokens,
            hasher=hasher,
            fence=SparkSlotFence(generation=generation),
        )
        msg = messages.Open(
            session=self.session,
            slot=slot,
            generation=generation,
            seed=seed,
            context=context,
            eos=eos,
            prefix_len=len(tokens),
            digest=digest,
        )
        self._request(slot, msg, now, np.asarray(tokens, dtype="<i4").tobytes())
        self._slot_generations[slot] = generation
        return generation

    def _opened(self, slot: int) -> SparkSlot:
        """Open slot ``slot``'s state, desynced or not (``UNKNOWN_SLOT``, ``NOT_READY``)."""
        self._require_ready()
        state = self.slots.get(slot)
        if state is None:
            raise ProtocolError(ErrorCode.UNKNOWN_SLOT, f"slot {slot}")
        return state

    def _slot(self, slot: int) -> SparkSlot:
        state = self._opened(slot)
        if state.desynced:
            raise LocalStateError(ErrorCode.SLOT_DESYNCED, f"slot {slot} must be reopened")
        return state

    def next_round(self, slot: int) -> int:
        """One above every round ``slot`` used in its generation (raises as :meth:`step`)."""
        return self._slot(slot).fence.last_round + 1

    def check_step(self, *, depth: int, support: int, stop: StopRule = FIXED) -> None:
        """Raise ``ProtocolError`` as :meth:`step` does for a bad block, whichever the slot:
        ``DEPTH_OUT_OF_RANGE``, ``SUPPORT_OUT_OF_RANGE``, or ``BAD_STOP_RULE`` (a rule other
        than FIXED needs the stop-rule set negotiated at HELLO)."""
        if not 1 <= depth <= self.config.max_depth:
            raise ProtocolError(ErrorCode.DEPTH_OUT_OF_RANGE, f"depth {depth}")
        if stop.kind is not StopKind.FIXED and self.stop_rules != STOP_RULES:
            raise ProtocolError(ErrorCode.BAD_STOP_RULE, f"{stop}: no stop rules negotiated")
        if not 0 <= support <= min(self.config.max_support, self.config.vocab_size):
            raise ProtocolError(ErrorCode.SUPPORT_OUT_OF_RANGE, f"support {support}")

    def step(
        self,
        slot: int,
        *,
        round_id: int,
        depth: int,
        temperature: float,
        support: int,
        now: float,
        stop: StopRule = FIXED,
    ) -> None:
        """Queue STEP for ``slot`` under ``round_id``, above every round the slot used in its
        generation (the caller numbers rounds: ``RequestVerifier.take_round``); ``depth`` is
        the block's maximum, ``stop`` its stop rule. Nothing is queued if it raises.

        Raises:
            ProtocolError: ``UNKNOWN_SLOT``, ``ROUND_REUSED``, or as :meth:`check_step`.
            LocalStateError: ``NOT_READY``, ``SLOT_DESYNCED``, or ``SLOT_BUSY`` when
                a proposal is already in flight on the slot.
        """
        state = self._slot(slot)
        if state.flight is not None:
            raise LocalStateError(ErrorCode.SLOT_BUSY, f"slot {slot} has a proposal in flight")
        if round_id <= (last := state.fence.last_round):
            raise ProtocolError(ErrorCode.ROUND_REUSED, f"round {round_id} is not after {last}")
        self.check_step(depth=depth, support=support, stop=stop)
        msg = Step(
            session=self.session,
            slot=slot,
            generation=state.fence.generation,
            round=round_id,
            position=len(state.prefix),
            digest=state.digest,
            depth=depth,
            temperature=float(temperature),
            support=support,
            context=state.context,
            stop=int(stop.kind),
            threshold=stop.threshold,
        )
        state.flight = state.fence.in_flight = ReplyAssembly(
            step=msg, deadline=now + self.config.reply_timeout
        )
        self._send(msg)

    def commit(
        self,
        slot: int,
        *,
        round_id: int,
        tokens: Sequence[int],
        accepted: int,
        now: float | None = None,
    ) -> None:
        """Queue COMMIT of ``tokens`` (accepted drafts, then the correction or bonus if any);
        the prefix advances at once, so the next STEP may follow. With ``now``, COMMITTED is
        owed as for :meth:`open_slot`.

        Raises:
            ProtocolError: ``UNKNOWN_SLOT``; ``COMMIT_INVALID`` if ``accepted``
                exceeds ``len(tokens)`` or the drafts of that round.
            LocalStateError: ``NOT_READY``, or ``SLOT_DESYNCED`` until the slot is reopened.
        """
        state = self._slot(slot)
        if not 0 <= accepted <= len(tokens) or not tokens:
            raise ProtocolError(ErrorCode.COMMIT_INVALID, "accepted outside the committed tokens")
        # Checked before anything changes: a refused COMMIT keeps the round's drafts.
        drafts = state.drafts.get(round_id, ())
        if tuple(tokens[:accepted]) != drafts[:accepted]:
            raise ProtocolError(ErrorCode.COMMIT_INVALID, "accepted tokens are not the drafts")
        state.drafts.clear()
        extra = int(tokens[-1]) if len(tokens) > accepted else None
        new = [int(t) for t in tokens]
        state.prefix.extend(new)
        state.hasher.extend(new)  # O(new tokens), not a pass over the prefix
        state.fence.last_round = max(state.fence.last_round, round_id)
        msg = messages.Commit(
            session=self.session,
            slot=slot,
            generation=state.fence.generation,
            round=round_id,
            accepted=accepted,
            extra=extra,
            position=len(state.prefix),
            digest=state.digest,
        )
        self._request(slot, msg, now)

    def reset(self, slot: int, now: float | None = None) -> int:
        """Queue RESET: a new generation, returned; what is in flight on the slot is discarded.
        With ``now``, RESET_DONE is owed as for :meth:`open_slot`.

        Raises:
            ProtocolError: ``UNKNOWN_SLOT``.
            LocalStateError: ``NOT_READY`` before the handshake ends or after close.
        """
        state = self._opened(slot)
        if state.flight is not None:
            self._discard(slot, state, ErrorCode.CANCELLED)  # our own reset: not a fallback
        generation = state.fence.generation + 1
        state.fence = SparkSlotFence(generation=generation)
        self._slot_generations[slot] = generation
        state.drafts.clear()
        msg = messages.Reset(session=self.session, slot=slot, generation=generation)
        self._request(slot, msg, now)
        return generation

    def close_slot(self, slot: int, now: float | None = None) -> None:
        """Queue CLOSE; the slot's state is dropped at once. With ``now``, CLOSED is owed.

        Raises:
            ProtocolError: ``UNKNOWN_SLOT``.
            LocalStateError: ``NOT_READY`` before the handshake ends or after close.
        """
        state = self._opened(slot)
        del self.slots[slot]
        if state.flight is not None:
            self._discard(slot, state, ErrorCode.CANCELLED)  # our own close: not a fallback
        for key in [k for k in self._ready if k[0] == slot]:
            self.release_proposal(*key)
        self._closing[slot] = self._closing.get(slot, 0) + 1
        self._request(slot, messages.Close(session=self.session, slot=slot), now)

    def ping(self, nonce: int) -> None:
        """Queue PING."""
        self._send(messages.Ping(nonce=nonce))

    def _fatal(self, code: ErrorCode, answers: MsgType | None = None) -> None:
        """Send a fatal ERROR (naming the message type it answers, if one) and close."""
        error = messages.Error(
            code=int(code), answers=int(answers or 0), scope=int(Scope.CONNECTION)
        )
        self._send(error)
        self._close_all(code)

    def _close_all(self, code: ErrorCode) -> None:
        """The connection is dead: every in-flight proposal fails, every slot is dropped."""
        for index, slot in list(self.slots.items()):
            if slot.flight is not None:
                self._end_block(index, slot, code)
        self.slots.clear()
        self.closed = True
        self._events.append(ConnectionFailed(code))

    def _dispatch(self, frame: framing.Frame) -> None:
        msg = frame.message
        kind = frame.type
        rule = transitions.SPARK[(self.state, kind)]
        if rule.act is Act.FATAL:
            assert rule.code is not None
            self._reject_fatal(rule.code, kind)
            return
        if rule.act is Act.IGNORE:
            return
        self._owed.settle(kind, msg)
        slot_of = getattr(msg, "slot", None)
        if slot_of is not None and self._closing.get(slot_of, 0) and kind is not MsgType.CLOSED:
            if kind is MsgType.ERROR and getattr(msg, "answers", None) == MsgType.CLOSE:
                # The worker held no such slot (its OPEN was refused): still an answer.
                self._close_acked(slot_of)
            return  # belongs to the slot's closed instance
        self._handlers[kind](msg, frame)

    def _on_pong(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, messages.Pong)
        self._events.append(PongReceived(msg.nonce))

    def _on_ping(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, messages.Ping)
        self._send(messages.Pong(nonce=msg.nonce))

    def _reject_fatal(self, code: ErrorCode, answers: MsgType | None = None) -> None:
        self._events.append(FrameRejected(None, code))
        self._fatal(code, answers)

    def _on_error(self, err: Message, _frame: framing.Frame) -> None:
        assert isinstance(err, messages.Error)
        code = status_code(err.code)
        if err.scope == Scope.CONNECTION:
            self._close_all(code)
            return
        if err.slot is None or err.slot not in self.slots:
            self._events.append(FrameRejected(None, code))
            return
        slot = self.slots[err.slot]
        flight = slot.flight
        if (
            err.answers == MsgType.STEP
            and flight is not None
            and err.round == flight.step.round
            and err.generation == flight.step.generation
        ):
            self._discard(err.slot, slot, code)
            return
        if err.scope == Scope.SLOT or err.answers in (MsgType.COMMIT, MsgType.OPEN, MsgType.RESET):
            slot.desynced = True
            if flight is not None:
                self._discard(err.slot, slot, code)
            self._events.append(SlotDesynced(err.slot, code))
            return
        self._events.append(FrameDropped(err.slot, code))

    def _on_challenge(self, msg: Message, frame: framing.Frame) -> None:
        assert isinstance(msg, messages.Challenge)
        psk = self.config.psk
        if psk is None:
            self._reject_fatal(ErrorCode.AUTH_REQUIRED, MsgType.CHALLENGE)
            return
        if not hmac.compare_digest(worker_proof(psk, self._nonce, msg.nonce), msg.proof):
            self._reject_fatal(ErrorCode.AUTH_FAILED, MsgType.CHALLENGE)
            return
        proof = spark_proof(psk, msg.nonce, self._nonce, self._hello_header)
        self._send(messages.Auth(proof=proof))
        self._worker_proved = True
        # Every later frame, both ways, is tagged under keys bound to both HELLO
        # nonces, this side's HELLO and the CHALLENGE (§5.1).
        challenge = bytes(frame.raw[framing.PREAMBLE_SIZE :])
        k_sw, k_ws = integrity.frame_keys(psk, self._hello_header, challenge)
        self._sealer = integrity.Sealer(k_sw)
        self._receive_rule.start(k_ws)

    def _on_hello(self, peer: Message, _frame: framing.Frame) -> None:
        assert isinstance(peer, messages.Hello)
        ours = self._hello
        assert ours is not None
        cfg = self.config
        problem: ErrorCode | None = None
        # A worker that skipped the CHALLENGE never proved it knows the key.
        if self.config.psk is not None and not self._worker_proved:
            problem = ErrorCode.AUTH_REQUIRED
        if problem is None:
            problem = first_failure(
                peer,
                Role.WORKER,
                cfg,
                [
                    (cfg.draft_identity in ("", peer.draft_identity), ErrorCode.IDENTITY_MISMATCH),
                    (
                        all(getattr(peer, n) == getattr(ours, n) for n in ECHOED_LIMITS),
                        ErrorCode.LIMIT_EXCEEDED,
                    ),
                    (peer.stop_rules == ours.stop_rules, ErrorCode.STOP_RULES_MISMATCH),
                ],
            )
        if problem is not None:
            self._reject_fatal(problem, MsgType.HELLO)
            return
        self.session, self.lineage = peer.session, peer.lineage
        self.state = State.READY
        self.handshake_deadline = None
        payload = max(4 * cfg.entries, 8 * peer.max_support)
        self.decoder.set_max_payload(min(payload, cfg.max_frame))
        self._events.append(HandshakeDone(peer.session, peer))

    def _known(self, session: int, slot: int) -> SparkSlot | None:
        state = self.slots.get(slot)
        decision = fencing.spark_slot(self.session, session, state is not None)
        if decision.action is Action.REJECT:
            assert decision.code is not None
            self._events.append(FrameRejected(slot, decision.code))
            return None
        if decision.action is Action.DROP:
            assert decision.code is not None
            self._events.append(FrameDropped(slot, decision.code))
            return None
        return state

    def _on_opened(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, messages.Opened)
        state = self._known(msg.session, msg.slot)
        if state is None:
            return
        if self._desynced(msg.slot, state, msg.position, msg.digest):
            return
        self._events.append(SlotOpened(msg.slot, msg.generation, msg.position))

    def _on_closed(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, messages.Closed)
        self._close_acked(msg.slot)

    def _close_acked(self, slot: int) -> None:
        pending = self._closing.get(slot, 0)
        if pending <= 1:
            self._closing.pop(slot, None)
        else:
            self._closing[slot] = pending - 1
        self._events.append(SlotClosed(slot))

    def _current(self, msg: messages.Committed | messages.ResetDone) -> SparkSlot | None:
        """The slot an acknowledgement is for, if of its generation (an older one is dropped:
        the slot was reset since, which ended the caller's wait)."""
        state = self._known(msg.session, msg.slot)
        if state is not None and msg.generation != state.fence.generation:
            self._events.append(FrameDropped(msg.slot, ErrorCode.STALE_GENERATION))
            return None
        return state

    def _on_committed(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, messages.Committed)
        if self._current(msg) is not None:
            self._events.append(CommitAcked(msg.slot, msg.generation, msg.round, msg.position))

    def _on_reset_done(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, messages.ResetDone)
        if (state := self._current(msg)) is None:
            return
        if self._desynced(msg.slot, state, msg.position, msg.digest):
            return
        self._events.append(ResetAcked(msg.slot, msg.generation, msg.position))

    def _desynced(self, index: int, state: SparkSlot, position: int, digest: int) -> bool:
        """True (and the slot marked) if the worker's prefix state differs from ours."""
        if (position, digest) == (len(state.prefix), state.digest):
            return False
        state.desynced = True
        self._events.append(SlotDesynced(index, ErrorCode.PREFIX_DIGEST_MISMATCH))
        return True


__all__ = ["SparkConfig", "SparkProtocol", "SparkSlot"]
