"""Sans-IO protocol core of the worker (proposer) role: bytes and a clock in, bytes and
events out. It alone owns proposal randomness, and answers a retried STEP from its replay
cache with the byte-identical reply, never redrawn."""

from __future__ import annotations

import hmac
import secrets
from array import array
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import numpy as np

from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q.proposal import DrafterFn, PrefixDigest
from pp1wire.q.rng import Role
from pp1wire.wire import fencing, framing, integrity, transitions
from pp1wire.wire.budgets import Account, Binder, DrawGate
from pp1wire.wire.events import HandshakeDone
from pp1wire.wire.fencing import Action, WorkerSlotFence
from pp1wire.wire.handshake import (
    build_hello,
    first_failure,
    spark_proof,
    worker_proof,
)
from pp1wire.wire.messages import (
    Auth,
    Challenge,
    Close,
    Closed,
    Commit,
    Committed,
    Error,
    Hello,
    Message,
    MsgType,
    Open,
    Opened,
    Ping,
    Pong,
    Reset,
    ResetDone,
    Scope,
    Step,
    type_of,
)
from pp1wire.wire.replies import FrameParts, ReplyEncoder
from pp1wire.wire.transitions import Act, State
from pp1wire.wire.worker_events import (
    ConnectionClosing,
    DrawJob,
    DrawRequested,
    DrawResult,
    Proposer,
    Refused,
    SlotEvent,
    StepReplayed,
    StepServed,
    WorkerEvent,
)
from pp1wire.wire.worker_state import WorkerConfig, WorkerSlot

__all__ = [
    "ConnectionClosing",
    "DrawJob",
    "DrawRequested",
    "DrawResult",
    "HandshakeDone",
    "Refused",
    "SlotEvent",
    "StepReplayed",
    "StepServed",
    "WorkerConfig",
    "WorkerEvent",
    "WorkerProtocol",
    "WorkerSlot",
]

_M = TypeVar("_M", Step, Commit, Reset)  # the slot messages a fencing rule decides
_A = TypeVar("_A", Opened, ResetDone)


_NOT_ACTIVITY: Final = (MsgType.PING, MsgType.PONG)


class WorkerProtocol:
    """The worker's connection state machine (one instance per connection)."""

    def __init__(
        self,
        config: WorkerConfig,
        drafter: DrafterFn,
        *,
        session: int,
        now: float,
        defer_draws: bool = False,
        proposer: Proposer | None = None,
        account: Account | None = None,
        binder: Binder | None = None,
    ) -> None:
        """Start a connection at time ``now``; ``session`` is assigned to the peer.

        ``proposer`` draws each STEP's rows instead of the local chain; ``account`` holds
        the draw budgets until ``binder`` names the peer's principal (§2, §4.4). With
        ``defer_draws`` an accepted STEP emits :class:`DrawRequested`, and the first later
        message naming its slot waits, with all after it, until :meth:`finish_draw`.
        """
        self.config = config
        self.drafter = drafter
        self.session = session
        self.defer_draws = defer_draws
        self.proposer = proposer
        self._drawing: dict[int, DrawJob] = {}
        self._streamed: dict[int, int] = {}  # per slot: frames queued by stream_rows
        self._held: framing.Frame | None = None  # waits, with all after it (_waits)
        self.state = State.AWAIT_HELLO
        self.decoder = framing.FrameDecoder(0)
        self.slots: dict[int, WorkerSlot] = {}
        self._slot_generations: dict[int, int] = {}  # the highest of each slot
        self._out: list[bytes | memoryview] = []
        self._out_bytes = 0
        #: True when :meth:`pump` stopped at a budget with frames possibly left.
        self.more = False
        self._events: list[WorkerEvent] = []
        self._spark_nonce = b""
        self._worker_nonce = b""
        self._hello_header = b""
        self._challenge_header = b""
        self._sealer: integrity.Sealer | None = None  # once a keyed handshake ends (§5.1)
        self._receive_rule = integrity.ReceiveRule()
        self._peer: Hello | None = None
        handle = self._handlers = transitions.handlers(transitions.WORKER, self)
        handle[MsgType.STEP] = self._fenced(Step, fencing.worker_step, self._on_step)
        handle[MsgType.COMMIT] = self._fenced(Commit, fencing.worker_commit, self._on_commit)
        handle[MsgType.RESET] = self._fenced(Reset, fencing.worker_reset, self._on_reset)
        self.handshake_deadline: float | None = now + config.handshake_timeout
        self.last_activity = now
        self._now = now  # the time of the frames being handled (pump's ``now``)
        self.gate = DrawGate(account if account is not None else Account(config, now))
        self.binder = binder
        self._psk: bytes | None = None  # the key of the ID the peer named (§5), if known
        self._proof_key = b""  # what the CHALLENGE proved: that key, or a random one
        self.closed = False

    def data_to_send(self) -> list[bytes | memoryview]:
        """Bytes queued for the peer, in order (the queue is emptied)."""
        out, self._out = self._out, []
        self._out_bytes = 0
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timer` must next be called."""
        if self.closed:
            return None
        if self.handshake_deadline is not None:
            return self.handshake_deadline
        return self.last_activity + self.config.idle_timeout

    def handle_timer(self, now: float) -> list[WorkerEvent]:
        """Enforce the handshake and idle timeouts."""
        if self.closed:
            return []
        if self.handshake_deadline is not None and now >= self.handshake_deadline:
            self._fatal(ErrorCode.HANDSHAKE_TIMEOUT, None)
        elif (
            self.handshake_deadline is None and now >= self.last_activity + self.config.idle_timeout
        ):
            self._fatal(ErrorCode.IDLE_TIMEOUT, None)
        return self._take_events()

    def receive_data(self, data: bytes | memoryview, now: float) -> list[WorkerEvent]:
        """Feed received bytes (copied into the decoder); returns the events they caused."""
        src = memoryview(data).cast("B")
        events: list[WorkerEvent] = []
        while src and not self.closed:
            dst = self.get_buffer()
            n = min(len(dst), len(src))
            dst[:n] = src[:n]
            src = src[n:]
            events += self.buffer_updated(n, now)
        return events

    def get_buffer(self) -> memoryview:
        """Where a buffered transport should write received bytes next.

        Raises:
            ProtocolError: if the decoder has already failed.
        """
        return self.decoder.get_buffer()

    def buffer_updated(
        self,
        nbytes: int,
        now: float,
        *,
        max_frames: int | None = None,
        out_budget: int | None = None,
    ) -> list[WorkerEvent]:
        """``nbytes`` were written into :meth:`get_buffer`; returns the events caused.

        ``max_frames`` and ``out_budget`` bound the work done now, as in :meth:`pump`.
        """
        if self.closed:
            return []
        try:
            self.decoder.account(nbytes)
        except ProtocolError as exc:
            self._fatal(exc.code, None)
            return self._take_events()
        return self.pump(now, max_frames=max_frames, out_budget=out_budget)

    def pump(
        self,
        now: float,
        *,
        max_frames: int | None = None,
        out_budget: int | None = None,
        hold_after_refusal: bool = False,
    ) -> list[WorkerEvent]:
        """Handle frames already received, in order; returns the events caused. Stops after
        ``max_frames``, once ``out_budget`` bytes are queued, or (``hold_after_refusal``) at
        a STEP its budget holds (:meth:`DrawGate.holds`), leaving the rest buffered."""
        self.more = False
        self._now = now
        handled = 0
        if self._held is not None and not self.closed:
            if self._waits(self._held, now, hold_after_refusal):
                return self._take_events()
            held, self._held = self._held, None
            self.gate.hold_until = 0.0
            self._dispatch(held)
            handled += 1
        while not self.closed:
            if (max_frames is not None and handled >= max_frames) or (
                out_budget is not None and self._out_bytes >= out_budget
            ):
                self.more = True
                break
            try:
                frame = self.decoder.next_frame()
            except ProtocolError as exc:
                self._fatal(exc.code, None)
                break
            if frame is None:
                break
            if not self._receive_rule.accepts(frame):
                self._fatal(ErrorCode.INTEGRITY_FAILED, frame.type)
                break
            # Only whole frames of real work are activity: a peer that only pings, or
            # trickles the bytes of one frame, is idle and cannot hold a connection slot.
            if frame.type not in _NOT_ACTIVITY:
                self.last_activity = now
            if self._waits(frame, now, hold_after_refusal):
                self._held = framing.detached(frame)
                break
            self._dispatch(frame)
            handled += 1
        return self._take_events()

    def _waits(self, frame: framing.Frame, now: float, budget: bool) -> bool:
        """Whether ``frame`` waits: its slot is drawn, or (``budget``) its budget holds it."""
        msg = frame.message
        if self._drawing and _slot_of(frame) in self._drawing:
            return True
        binder = self.binder if budget and self.state is State.AWAIT_HELLO else None
        if binder is not None and isinstance(msg, Hello) and not self.config.keyed:
            self.gate.hold_until = binder.ready_at(msg, now)  # §4.4: a new lineage's turn
            return self.gate.hold_until > now
        if not budget or not isinstance(msg, Step) or msg.slot not in self.slots:
            return False
        return msg.session == self.session and self.gate.holds(msg, self.slots[msg.slot].fence, now)

    @property
    def drawing(self) -> bool:
        """True while a deferred draw is outstanding (:meth:`finish_draw` not yet called)."""
        return bool(self._drawing)

    @property
    def waiting(self) -> bool:
        """True while a received message waits for its slot's draw (a shell stops reading)."""
        return self._held is not None and not self.closed

    def stream_rows(self, job: DrawJob, frames: Sequence[FrameParts]) -> None:
        """Queue REPLY frames of a deferred draw as their rows are drawn, so that rows before
        a slow or failing one arrive in time (``docs/adaptive.md`` §7); frames of a draw
        that is not its slot's current one are dropped."""
        slot = job.step.slot
        current = self._drawing.get(slot) is job and self.slots.get(slot) is job.slot
        if self.closed or not current:
            return
        self._queue_frames(tuple(frames))
        self._streamed[slot] = self._streamed.get(slot, 0) + len(frames)

    def finish_draw(self, job: DrawJob, result: DrawResult) -> list[WorkerEvent]:
        """A deferred draw is done: queue the rest of its reply (a result for a closed
        connection or a slot gone is dropped); returns the events. Call :meth:`pump` next."""
        if self._drawing.get(job.step.slot) is not job:
            return self._take_events()
        del self._drawing[job.step.slot]
        sent = self._streamed.pop(job.step.slot, 0)
        slot = self.slots.get(job.step.slot)
        if not self.closed and slot is not None and slot is job.slot:
            self._served(slot, job.step, result, sent)
        return self._take_events()

    def close_with(self, code: ErrorCode) -> list[WorkerEvent]:
        """End the connection with a fatal ERROR ``code`` (a shell's decision: an eviction)."""
        if not self.closed:
            self._fatal(code, None)
        return self._take_events()

    def connection_lost(self) -> None:
        """The transport is gone: drop every slot (its generation dies with it)."""
        self._lose()
        self._drawing.clear()
        self._streamed.clear()
        self._held = None

    def _lose(self) -> None:
        """Close: every slot is dropped, a draw left uncommitted abandoned (§4.4)."""
        self.closed = True
        self.gate.lost(self.slots, self._now, self._drawing.keys())
        self.slots.clear()

    def _take_events(self) -> list[WorkerEvent]:
        events, self._events = self._events, []
        return events

    def _send(self, msg: Message, payload: bytes = b"") -> None:
        frame = framing.encode_frame(msg, payload, tagged=self._sealer is not None)
        self._queue_frames(((frame,),))

    def _queue_frames(self, frames: tuple[FrameParts, ...]) -> None:
        """Queue whole frames, each given as its parts, sealed in turn once the keys exist."""
        sealer = self._sealer
        out = self._out
        for parts in frames:
            out.extend(parts)
            self._out_bytes += sum(memoryview(p).nbytes for p in parts)
            if sealer is not None:
                t = sealer.tag_next(*parts)
                out.append(t)
                self._out_bytes += len(t)

    def _refuse(
        self,
        code: ErrorCode,
        answers: MsgType | None,
        *,
        scope: Scope = Scope.MESSAGE,
        slot: int | None = None,
        generation: int | None = None,
        round_id: int | None = None,
    ) -> None:
        self._send(
            Error(
                code=int(code),
                answers=int(answers or 0),
                scope=int(scope),
                slot=slot,
                generation=generation,
                round=round_id,
            )
        )
        self._events.append(Refused(code, answers, scope))

    def _refuse_msg(self, code: ErrorCode, kind: MsgType, msg: Message) -> None:
        """Refuse one slot message: the ERROR names the slot, generation and round it carried."""
        self._refuse(
            code,
            kind,
            slot=getattr(msg, "slot", None),
            generation=getattr(msg, "generation", None),
            round_id=getattr(msg, "round", None),
        )

    def _fatal(self, code: ErrorCode, answers: MsgType | None) -> None:
        self._refuse(code, answers, scope=Scope.CONNECTION)
        self._lose()
        self._events.append(ConnectionClosing(code))

    def _dispatch(self, frame: framing.Frame) -> None:
        kind = frame.type
        rule = transitions.WORKER[(self.state, kind)]
        if rule.act is Act.HANDLE:
            self._handlers[kind](frame.message, frame)
        elif rule.act is Act.FATAL:
            assert rule.code is not None
            self._fatal(rule.code, kind)

    def _on_ping(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, Ping)
        self._send(Pong(nonce=msg.nonce))

    def _on_error(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, Error)
        if msg.scope == Scope.CONNECTION:
            self._lose()
            self._events.append(ConnectionClosing(None))

    def _on_hello(self, msg: Message, frame: framing.Frame) -> None:
        assert isinstance(msg, Hello)
        hello = msg
        header = bytes(frame.raw[framing.PREAMBLE_SIZE : len(frame.raw)])
        self._peer = hello
        self._spark_nonce = hello.nonce
        self._hello_header = header
        if self.config.keyed:
            # An unknown key ID gets a CHALLENGE proved by a random key and fails at AUTH,
            # as a wrong proof does: the peer learns nothing of which IDs exist (§5).
            self._psk = self.config.key(hello.key_id)
            self._proof_key = self._psk or secrets.token_bytes(32)
            self._worker_nonce = secrets.token_bytes(32)
            proof = worker_proof(self._proof_key, hello.nonce, self._worker_nonce)
            challenge = framing.encode_frame(Challenge(nonce=self._worker_nonce, proof=proof))
            self._challenge_header = challenge[framing.PREAMBLE_SIZE :]
            self._queue_frames(((challenge,),))
            self.state = State.AWAIT_AUTH
            return
        self._finish_handshake(hello)

    def _on_auth(self, auth: Message, _frame: framing.Frame) -> None:
        assert isinstance(auth, Auth)
        assert self._peer is not None
        key, nonces = self._proof_key, (self._worker_nonce, self._spark_nonce)
        want = spark_proof(key, *nonces, self._hello_header)
        if not hmac.compare_digest(want, auth.proof) or self._psk is None:
            self._fatal(ErrorCode.AUTH_FAILED, MsgType.AUTH)
            return
        self._finish_handshake(self._peer)

    def check_hello(self, hello: Hello) -> ErrorCode | None:
        """The first compatibility failure of a Spark HELLO, or None (protocol §4.1)."""
        cfg = self.config
        return first_failure(
            hello,
            Role.SPARK,
            cfg,
            [
                (hello.draft_identity in ("", cfg.draft_identity), ErrorCode.IDENTITY_MISMATCH),
                (hello.max_slots <= cfg.max_slots, ErrorCode.LIMIT_EXCEEDED),
                (hello.max_depth <= cfg.max_depth, ErrorCode.LIMIT_EXCEEDED),
                (
                    hello.max_support <= min(cfg.max_support, cfg.vocab_size),
                    ErrorCode.LIMIT_EXCEEDED,
                ),
                (hello.row_entries == cfg.entries, ErrorCode.LIMIT_EXCEEDED),
                (hello.max_frame <= cfg.max_frame, ErrorCode.LIMIT_EXCEEDED),
                # A dense row must fit (section 4.1): refused here, not at every STEP.
                (hello.max_frame >= 4 * cfg.entries, ErrorCode.LIMIT_EXCEEDED),
                (hello.max_prefix <= cfg.max_prefix, ErrorCode.LIMIT_EXCEEDED),
                (hello.stop_rules in ("", cfg.stop_rules), ErrorCode.STOP_RULES_MISMATCH),
            ],
        )

    def _finish_handshake(self, hello: Hello) -> None:
        problem = self.check_hello(hello)
        if problem is not None:
            self._fatal(problem, MsgType.HELLO)
            return
        cfg = self.config
        if self._psk is not None:
            # From here every frame, this HELLO first, is tagged both ways (§5.1).
            k_sw, k_ws = integrity.frame_keys(self._psk, self._hello_header, self._challenge_header)
            self._sealer = integrity.Sealer(k_ws)
            self._receive_rule.start(k_sw)
        lineage = b""
        if self.binder is not None:  # the peer's principal: its key ID, or its lineage
            key_id = hello.key_id if cfg.keyed else None
            account, lineage = self.binder.bind(hello, key_id, self._now)
            self.gate = DrawGate(account)
        # The reply echoes the Spark side's limits: no silent downgrade.
        reply = build_hello(
            Role.WORKER,
            cfg,
            draft_identity=cfg.draft_identity,
            draft_native=cfg.draft_native,
            limits=hello,
            nonce=secrets.token_bytes(16),
            session=self.session,
            lineage=lineage,
        )
        self._peer = hello
        self._send(reply)
        self.state = State.READY
        self.handshake_deadline = None
        # The only payload a worker receives is an OPEN's prefix.
        self.decoder.set_max_payload(min(4 * hello.max_prefix, hello.max_frame))
        self._events.append(HandshakeDone(self.session, hello))

    @property
    def limits(self) -> Hello:
        """The negotiated limits (the accepted Spark HELLO)."""
        assert self._peer is not None
        return self._peer

    def _slot_for(
        self, msg: Open | Close | Step | Commit | Reset, kind: MsgType
    ) -> WorkerSlot | None:
        slot = self.slots.get(msg.slot)
        decision = fencing.worker_slot(self.session, msg.session, slot is not None)
        if decision.code is not None:
            self._refuse_msg(decision.code, kind, msg)
            return None
        return slot

    def _fenced(
        self,
        cls: type[_M],
        rule: Callable[[WorkerSlotFence, _M], fencing.Decision],
        then: Callable[[_M, WorkerSlot, fencing.Decision], None],
    ) -> Callable[[Message, framing.Frame], None]:
        """The handler of a slot message that ``rule`` fences: one for no open slot of this
        session, or refused, is answered here; ``then`` gets the others with their slot."""

        def handle(msg: Message, _frame: framing.Frame) -> None:
            assert isinstance(msg, cls)
            kind = type_of(msg)
            slot = self._slot_for(msg, kind)
            if slot is None:
                return
            decision = rule(slot.fence, msg)
            if decision.action is Action.REFUSE:
                assert decision.code is not None
                self._refuse_msg(decision.code, kind, msg)
                return
            then(msg, slot, decision)

        return handle

    def _on_open(self, msg: Message, frame: framing.Frame) -> None:
        assert isinstance(msg, Open)
        kind = MsgType.OPEN
        if msg.session != self.session:  # §7: session first; the slot need not be open
            self._refuse_msg(ErrorCode.WRONG_SESSION, kind, msg)
            return
        if msg.slot >= self.limits.max_slots:
            self._refuse_msg(ErrorCode.SLOT_LIMIT, kind, msg)
            return
        existing = self.slots.get(msg.slot)
        if existing is not None:
            if existing.open_msg == msg and existing.fence.committed_round < 0:
                self._send(self._state(Opened, msg.slot, existing))
                return
            self._refuse_msg(ErrorCode.SLOT_IN_USE, kind, msg)
            return
        decision = fencing.worker_open(self._slot_generations.get(msg.slot), msg.generation)
        if decision.code is not None:
            self._refuse_msg(decision.code, kind, msg)
            return
        if frame.payload.nbytes != 4 * msg.prefix_len or msg.prefix_len > self.limits.max_prefix:
            self._refuse_msg(ErrorCode.PAYLOAD_LENGTH, kind, msg)
            return
        tokens = np.frombuffer(frame.payload, dtype="<i4")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            self._refuse_msg(ErrorCode.TOKEN_OUT_OF_RANGE, kind, msg)
            return
        if msg.eos is not None and msg.eos >= self.config.vocab_size:
            self._refuse_msg(ErrorCode.TOKEN_OUT_OF_RANGE, kind, msg)
            return
        prefix = array("i", tokens.astype(np.int32).tobytes())
        hasher = PrefixDigest(prefix)
        digest = hasher.value
        if digest != msg.digest:
            self._refuse_msg(ErrorCode.PREFIX_DIGEST_MISMATCH, kind, msg)
            return
        slot = WorkerSlot(
            open_msg=msg,
            seed=msg.seed,
            context=msg.context,
            eos=msg.eos,
            prefix=prefix,
            hasher=hasher,
            fence=WorkerSlotFence(generation=msg.generation),
        )
        self.gate.opened(msg.slot, self._now)
        self.slots[msg.slot] = slot
        self._slot_generations[msg.slot] = msg.generation
        self._send(self._state(Opened, msg.slot, slot))
        self._events.append(SlotEvent(kind, msg.slot, msg.generation, len(prefix)))

    def _state(self, kind: type[_A], index: int, slot: WorkerSlot) -> _A:
        """An OPENED or RESET_DONE: the slot's generation and prefix state."""
        generation, position = slot.fence.generation, len(slot.prefix)
        return kind(self.session, index, generation, position=position, digest=slot.digest)

    def _on_close(self, msg: Message, _frame: framing.Frame) -> None:
        assert isinstance(msg, Close)
        slot = self._slot_for(msg, MsgType.CLOSE)
        if slot is None:
            return
        del self.slots[msg.slot]
        self.gate.closed(msg.slot, slot, self._now)
        self._send(Closed(session=self.session, slot=msg.slot))
        self._events.append(
            SlotEvent(MsgType.CLOSE, msg.slot, slot.fence.generation, len(slot.prefix))
        )

    def _on_step(self, msg: Step, slot: WorkerSlot, decision: fencing.Decision) -> None:
        kind = MsgType.STEP
        if decision.action is Action.REPLAY:
            assert slot.reply is not None
            self._queue_frames(slot.reply)
            self._events.append(StepReplayed(msg.slot, msg.round))
            return
        problem = self._check_step(slot, msg)
        if problem is not None:
            self._refuse_msg(problem, kind, msg)
            return
        cfg = self.config
        encoder = ReplyEncoder(
            self.session,
            msg,
            cfg.entries,
            shard=cfg.shard_range if cfg.sharded else None,
            tagged=self._sealer is not None,
        )
        job = DrawJob(
            slot,
            msg,
            drafter=self.drafter,
            proposer=self.proposer,
            encoder=encoder,
            vocab_size=cfg.vocab_size,
        )
        if self.defer_draws:
            self._drawing[msg.slot] = job
            self._events.append(DrawRequested(job))
            return
        self._served(slot, msg, job.run())

    def _served(self, slot: WorkerSlot, msg: Step, result: DrawResult, sent: int = 0) -> None:
        """Record and queue a drawn reply, less its first ``sent`` frames (streamed)."""
        reply, rows = result.reply, result.rows
        slot.fence.last_step_round = msg.round
        slot.fence.last_step = msg
        slot.drafts = tuple(r.token for r in rows)
        slot.reply = reply
        self._queue_frames(reply[sent:])
        self._events.append(
            StepServed(
                msg.slot,
                msg.generation,
                msg.round,
                len(rows),
                result.status,
                sum(memoryview(p).nbytes for parts in reply for p in parts),
                result.seconds,
                result.failure,
            )
        )

    def _check_step(self, slot: WorkerSlot, step: Step) -> ErrorCode | None:
        code = fencing.worker_step_fields(
            self.limits, slot.prefix, slot.digest, slot.context, slot.fence, step
        )
        if code is None and not self.gate.fresh(step.slot, self._now):
            return ErrorCode.DRAW_RATE_LIMITED  # last: only a STEP that would be drawn spends
        return code

    def _on_commit(self, msg: Commit, slot: WorkerSlot, decision: fencing.Decision) -> None:
        kind = MsgType.COMMIT
        if decision.action is Action.REPLAY:
            assert slot.committed_msg is not None
            self._send(slot.committed_msg)
            return
        drafts = slot.drafts if msg.round == slot.fence.last_step_round else ()
        if msg.accepted > len(drafts):
            self._refuse_msg(ErrorCode.COMMIT_INVALID, kind, msg)
            return
        if msg.extra is None and not (
            msg.accepted and slot.eos is not None and drafts[msg.accepted - 1] == slot.eos
        ):
            self._refuse_msg(ErrorCode.COMMIT_INVALID, kind, msg)
            return
        if msg.extra is not None and msg.extra >= self.config.vocab_size:
            self._refuse_msg(ErrorCode.TOKEN_OUT_OF_RANGE, kind, msg)
            return
        new = list(drafts[: msg.accepted]) + ([] if msg.extra is None else [msg.extra])
        if msg.position != len(slot.prefix) + len(new):
            self._refuse_msg(ErrorCode.WRONG_POSITION, kind, msg)
            return
        # O(new tokens): the digest is extended, and the prefix only once it matches.
        hasher = slot.hasher.copy()
        hasher.extend(new)
        digest = hasher.value
        if digest != msg.digest:
            self._refuse_msg(ErrorCode.PREFIX_DIGEST_MISMATCH, kind, msg)
            return
        self.gate.committed(slot, msg.round, self._now)  # §4.4: a draw passed over?
        slot.prefix.extend(new)
        slot.hasher = hasher
        slot.fence.committed_round = msg.round
        slot.fence.last_commit = msg
        slot.reply = None
        slot.drafts = ()
        ack = Committed(
            session=self.session,
            slot=msg.slot,
            generation=msg.generation,
            round=msg.round,
            position=len(slot.prefix),
            digest=digest,
        )
        slot.committed_msg = ack
        self._send(ack)
        self._events.append(
            SlotEvent(
                kind,
                msg.slot,
                msg.generation,
                len(slot.prefix),
                tokens=len(new),
                proposed=msg.round == slot.fence.last_step_round,
            )
        )

    def _on_reset(self, msg: Reset, slot: WorkerSlot, decision: fencing.Decision) -> None:
        kind = MsgType.RESET
        if decision.action is Action.ACCEPT:
            self.gate.reset(slot, self._now)
            slot.fence.invalidate(msg.generation)
            self._slot_generations[msg.slot] = msg.generation
            slot.reply = None
            slot.drafts = ()
            slot.committed_msg = None
            self._events.append(SlotEvent(kind, msg.slot, msg.generation, len(slot.prefix)))
        self._send(self._state(ResetDone, msg.slot, slot))


def _slot_of(frame: framing.Frame) -> int | None:
    """The slot a frame's message names (None for connection-level messages)."""
    slot = getattr(frame.message, "slot", None)
    return slot if isinstance(slot, int) else None
