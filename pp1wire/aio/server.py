"""The worker's asyncio server: one sans-IO ``WorkerProtocol`` per connection.

Each connection's ``BufferedProtocol`` pumps bytes into its core and writes what it
queues; timers come from the core's deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Final, cast

from pp1wire.aio.admission import HANDSHAKE_GRACE_S, SLOT_IDLE_S, Admission
from pp1wire.aio.transport import nodelay, write
from pp1wire.aio.worker_metrics import WorkerMetrics
from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q.proposal import DrafterFn
from pp1wire.wire import framing, worker_core
from pp1wire.wire.draws import (
    DRAW_GATHER_S,
    BatchRunner,
    DraftTogether,
    DrawScheduler,
    FailureLog,
    default_runner,
)
from pp1wire.wire.messages import Error, MsgType, Scope
from pp1wire.wire.principals import Principal, PrincipalPolicy, address_key, draw_group
from pp1wire.wire.replies import FrameParts
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol
from pp1wire.wire.worker_events import DrawResult, GroupDraws, Proposer

log = logging.getLogger("pp1wire.worker")


#: Frames one connection may handle before the loop serves the others.
FRAMES_PER_TURN: Final = 64
#: Replies queued for a peer beyond this many bytes stop reading its requests.
WRITE_BUFFER_CAP: Final = 1 << 20
#: Pending connections the kernel queues before the worker accepts them.
ACCEPT_BACKLOG: Final = 1024
#: Connections the TLS listener accepts per readiness event before serving others.
ACCEPT_BURST: Final = 64
#: A closing connection whose peer does not read is cut after this many seconds.
CLOSE_GRACE_S: Final = 2.0


class _Conn(asyncio.BufferedProtocol):
    def __init__(self, server: WorkerServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.core: WorkerProtocol | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.peer = ""
        self.closed = asyncio.Event()
        # Reading stops while replies back up or frames wait for the next turn.
        self.writing_paused = False
        self.turn: asyncio.Handle | None = None
        self.held = False  # a STEP held for its budget after a DRAW_RATE_LIMITED refusal
        self.reading = True
        self.accepted_at = 0.0
        self.authenticated_at = 0.0
        self.grace_until = 0.0  # protected from replacement until then, if it has not drawn
        self.address = ""
        self.principal: Principal | None = None
        self.lost = False
        self.draining = False  # stopping: closed once the frames received are answered
        self.sock: socket.socket | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        tr = cast(asyncio.Transport, transport)
        if self.core is not None:  # TLS: admitted at accept, now negotiated
            if self.core.closed:
                tr.abort()
            else:
                self._ready(tr)
            return
        nodelay(tr.get_extra_info("socket"))
        refusal = self._admit(tr.get_extra_info("peername"))
        if refusal is None:
            self._ready(tr)
        else:
            tr.write(
                framing.encode_frame(
                    Error(code=int(refusal), answers=0, scope=int(Scope.CONNECTION))
                )
            )
            tr.close()

    def accept_tls(self, sock: socket.socket, ctx: ssl.SSLContext) -> None:
        """Admit a connection accepted by the TLS listener, then negotiate TLS on it."""
        nodelay(sock)
        if self._admit(sock.getpeername()) is not None:
            sock.close()  # a TLS client could not read a plaintext ERROR
            return
        self.sock = sock
        # A pp1 frame's magic instead of a ClientHello: a plaintext peer, told so in plaintext.
        asyncio.get_running_loop().add_reader(sock.fileno(), self._first_bytes, sock, ctx)

    def _first_bytes(self, sock: socket.socket, ctx: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(sock.fileno())
        core = self.core
        assert core is not None
        try:
            head = b"" if core.closed else sock.recv(len(framing.MAGIC), socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            loop.add_reader(sock.fileno(), self._first_bytes, sock, ctx)
            return
        except OSError:
            head = b""
        if head == framing.MAGIC:
            self._events(core.close_with(ErrorCode.TLS_REQUIRED))
            with contextlib.suppress(OSError):
                sock.send(b"".join(core.data_to_send()))
        if head in (b"", framing.MAGIC):
            self.sock = None
            sock.close()
            self.connection_lost(None)
            return
        remaining = self.accepted_at + self.server.config.handshake_timeout - time.monotonic()
        # The handshake timeout runs from accept, TLS included.
        task = asyncio.ensure_future(
            loop.connect_accepted_socket(
                lambda: self, sock, ssl=ctx, ssl_handshake_timeout=max(0.001, remaining)
            )
        )
        task.add_done_callback(self._tls_done)

    def _tls_done(self, task: asyncio.Future[tuple[asyncio.Transport, _Conn]]) -> None:
        self.sock = None
        if task.cancelled() or task.exception() is not None:
            error = None if task.cancelled() else task.exception()
            log.info("tls handshake failed", extra={"peer": self.peer, "error": repr(error)})
            self.connection_lost(None)

    def _admit(self, peer: object) -> ErrorCode | None:
        """Register this connection (from accept), or the code it is refused with."""
        self.accepted_at = time.monotonic()
        srv, ip = self.server, str(peer[0]) if isinstance(peer, tuple) else str(peer)
        self.peer = f"{ip}:{peer[1]}" if isinstance(peer, tuple) else ip
        self.address = address_key(ip, srv.policy.ipv6_prefix)  # an IPv6 address's network
        refusal = srv.admit(self, self.accepted_at)
        if refusal is not None:
            srv.metrics.refusals.labels(code=refusal.name.lower()).inc()
            log.warning("connection refused", extra={"peer": self.peer, "code": refusal.name})
            return refusal
        # Counted from accept: a pending handshake holds a slot and a descriptor.
        self.core = WorkerProtocol(
            srv.config,
            srv.drafter,
            session=next(srv.sessions),
            now=self.accepted_at,
            defer_draws=srv.draw_pool is not None or srv.group is not None,
            proposer=srv.proposer,
            binder=srv.binder(self),
        )
        srv.conns.add(self)
        srv.connection_opened()
        srv.metrics.connections.set(len(srv.conns))
        srv.metrics.accepted.inc()
        log.info("connection", extra={"peer": self.peer, "session": self.core.session})
        self._arm()
        return None

    def _ready(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_BUFFER_CAP)

    def _cut_handshake(self) -> None:
        """End a connection still negotiating TLS: its handshake fails, the transport closes."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def fileno(self) -> int | None:
        """The connection's socket descriptor (None once closed)."""
        if self.sock is not None:
            return self.sock.fileno()
        if self.transport is None or self.transport.is_closing():
            return None
        sock = self.transport.get_extra_info("socket")
        return None if sock is None else int(sock.fileno())

    def peer_left(self) -> None:
        """The peer is gone although its connection was not being read: end it now, so
        that it stops counting against the limits (docs/protocol.md §2)."""
        log.info("peer left", extra={"peer": self.peer})
        self.server.closed_conn(self)
        if self.transport is not None:
            self.transport.abort()
        else:
            self._cut_handshake()
            self.connection_lost(None)

    @property
    def authenticated(self) -> bool:
        """The peer completed the handshake (HELLO, and AUTH when a key is set)."""
        core = self.core
        return core is not None and core.handshake_deadline is None and not core.closed

    def evict(self) -> None:
        """Close this connection (``CONNECTION_LIMIT``) to make room for a new one."""
        core = self.core
        log.warning("evicted", extra={"peer": self.peer, "authenticated": self.authenticated})
        self.server.metrics.evictions.inc()
        if self.transport is None or core is None:
            self._cut_handshake()
            self.connection_lost(None)
            return
        self.server.closed_conn(self)
        self._events(core.close_with(ErrorCode.CONNECTION_LIMIT))
        self._flush()

    def refuse(self, code: ErrorCode) -> None:
        """Close this authenticated connection with a fatal ERROR ``code``."""
        core = self.core
        if core is None or core.closed:
            return
        log.warning("connection refused", extra={"peer": self.peer, "code": code.name})
        self.server.metrics.refusals.labels(code=code.name.lower()).inc()
        self._events(core.close_with(code))
        self._flush()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.core is None or self.core.closed:
            return memoryview(bytearray(4096))  # discard anything after close
        return self.core.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.core is None or self.core.closed:
            return
        # A failed decoder has already closed the core; the pump reports anything else.
        with contextlib.suppress(ProtocolError):
            self.core.decoder.account(nbytes)
        self._pump()

    def stream(self, job: worker_core.DrawJob, frames: list[FrameParts]) -> None:
        """REPLY frames of ``job`` drawn so far (on the loop): queued and sent at once."""
        core = self.core
        if core is None or self.lost:
            return
        core.stream_rows(job, frames)
        self._flush()

    def _drawn(self, job: worker_core.DrawJob, result: worker_core.DrawResult) -> None:
        core = self.core
        if core is None or self.lost:
            return
        self._events(core.finish_draw(job, result))
        self._flush()
        if self.turn is None:
            self._pump()  # messages held for the slot go on

    def _end_hold(self) -> None:
        # A timer firing early (uvloop rounds to milliseconds) is harmless: _pump holds again.
        self.held = False
        self._pump()

    def _pump(self) -> None:
        self.turn = None
        core, transport = self.core, self.transport
        if core is None or transport is None or core.closed:
            return
        if self.writing_paused:
            self._set_reading(False)  # resume_writing pumps again
            return
        # The transport pauses us above the cap; this turn may queue up to it (one reply at least).
        budget = max(1, WRITE_BUFFER_CAP - transport.get_write_buffer_size())
        # After a refusal the next STEP is held with what follows it (draining: answered at once).
        now = time.monotonic()
        events = core.pump(
            now,
            max_frames=FRAMES_PER_TURN,
            out_budget=budget,
            hold_after_refusal=not self.draining,
        )
        self._events(events)
        self._flush()
        if core.closed:
            return
        hold = core.gate.hold_until - now
        if core.waiting and hold > 0 and not self.draining:
            # Nothing more from this peer until its STEP's budget: a loop of refused STEPs
            # costs one refusal per budget period, not one per frame.
            self._set_reading(False)
            self.held = True
            self.turn = asyncio.get_running_loop().call_later(hold, self._end_hold)
            return
        if core.waiting:
            self._set_reading(False)  # a message waits for its slot's draw: _drawn pumps again
        elif core.more:
            # Frames are left: serve other connections first, not reading this one.
            self._set_reading(False)
            self.turn = asyncio.get_running_loop().call_soon(self._pump)
        elif self.draining:
            self._close_if_drained()
        elif not self.writing_paused:
            self._set_reading(True)

    def drain(self) -> None:
        """Stop reading; close once every frame already received is answered, draws included."""
        if self.transport is None:
            self._cut_handshake()  # still negotiating TLS: nothing to answer
            return
        self.draining = True
        self._set_reading(False)
        if self.held and self.turn is not None:
            self.turn.cancel()  # a draining connection answers what it has at once
            self.turn, self.held = None, False
        if self.turn is None and not self.writing_paused:
            self._pump()  # frames already buffered are handled; then _close_if_drained
        else:
            self._close_if_drained()

    def _close_if_drained(self) -> None:
        core, transport = self.core, self.transport
        if transport is None or transport.is_closing():
            return
        if core is None or core.closed or not (core.drawing or core.waiting or core.more):
            transport.close()  # close() flushes what is already queued

    def _set_reading(self, on: bool) -> None:
        transport = self.transport
        if on and self.draining:
            return
        if transport is None or transport.is_closing() or on == self.reading:
            return
        self.reading = on
        if on:
            transport.resume_reading()
        else:
            transport.pause_reading()

    def _events(self, events: list[worker_core.WorkerEvent]) -> None:
        m = self.server.metrics
        for e in events:
            if isinstance(e, worker_core.DrawRequested):
                self.server.submit_draw(self, e.job)
            elif isinstance(e, worker_core.StepServed):
                if e.failure is not None:
                    self.server.draw_failed(self, e, e.failure)
                m.propose_seconds.observe(e.draw_seconds)
                m.reply_bytes.inc(e.reply_bytes)
                if e.status:
                    m.failed_steps.labels(code=_name(e.status)).inc()
                else:
                    m.steps.inc()
                    m.rows.inc(e.rows)
            elif isinstance(e, worker_core.StepReplayed):
                m.replays.inc()
            elif isinstance(e, worker_core.SlotEvent):
                if self.server.gathers:
                    # After OPEN, RESET or COMMIT the slot's next STEP is due; not after CLOSE.
                    draws = self.server.draws
                    (draws.unexpect if e.kind is MsgType.CLOSE else draws.expect)(
                        self.principal, e.slot, owner=self
                    )
                if e.kind is MsgType.COMMIT:
                    m.commits.labels(round="proposed" if e.proposed else "target_only").inc()
                    m.committed_tokens.inc(e.tokens)
            elif isinstance(e, worker_core.Refused):
                m.refusals.labels(code=e.code.name.lower()).inc()
                log.info(
                    "refused",
                    extra={
                        "peer": self.peer,
                        "code": e.code.name,
                        "scope": e.scope.name,
                        "answers": e.answers.name if e.answers else None,
                    },
                )
            elif isinstance(e, worker_core.HandshakeDone):
                log.info("handshake", extra={"peer": self.peer, "session": e.session})
                self.server.handshake_done(self)

    def _flush(self) -> None:
        core, transport = self.core, self.transport
        if core is None:
            return
        if transport is None:
            if core.closed:  # timed out or evicted during the TLS handshake
                self._cut_handshake()
                self.connection_lost(None)
            return
        write(transport, core.data_to_send())
        if core.closed:
            self.server.closed_conn(self)  # no longer counted (nor evicted again)
            transport.close()
            # close() waits to flush: a peer that never reads is cut after a grace period.
            asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self._abort)
        else:
            self._arm()

    def _abort(self) -> None:
        if not self.lost and self.transport is not None:
            self.transport.abort()

    def _arm(self) -> None:
        core = self.core
        deadline = None if core is None else core.next_deadline()
        # The idle deadline moves with every message: an earlier timer simply fires and
        # re-arms, much cheaper than re-creating a timer per message.
        if self.timer is not None:
            if deadline is not None and self.timer.when() <= _loop_time(deadline):
                return
            self.timer.cancel()
            self.timer = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(max(0.0, deadline - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.core is None:
            return
        self._events(self.core.handle_timer(time.monotonic()))
        self._flush()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost:
            return
        self.lost = True
        if self.timer is not None:
            self.timer.cancel()
        if self.turn is not None:
            self.turn.cancel()
        if self.core is not None:
            self.core.connection_lost()
            self.server.unbind(self, time.monotonic())
        self.server.forget_draws(self)
        self.server.conns.discard(self)
        self.server.closing.discard(self)
        self.server.metrics.connections.set(len(self.server.conns))
        log.info("closed", extra={"peer": self.peer, "error": repr(exc) if exc else None})
        self.closed.set()

    def pause_writing(self) -> None:
        self.writing_paused = True
        self._set_reading(False)

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.turn is None:
            self._pump()
        if self.draining:
            self._close_if_drained()


def _loop_time(monotonic_deadline: float) -> float:
    """A ``time.monotonic()`` deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())


def _name(code: int) -> str:
    try:
        return ErrorCode(code).name.lower()
    except ValueError:
        return str(code)


class WorkerServer(Admission[_Conn]):
    """A listening worker; one :class:`WorkerProtocol` per connection (admission rules:
    :class:`~pp1wire.aio.admission.Admission`)."""

    def __init__(
        self,
        config: WorkerConfig,
        drafter: DrafterFn,
        *,
        max_connections: int = 16,
        max_per_address: int | None = None,
        ssl_context: ssl.SSLContext | None = None,
        busy_poll: bool = False,
        draw_threads: int = 0,
        proposer: Proposer | None = None,
        slot_idle_timeout: float = SLOT_IDLE_S,
        handshake_grace: float = HANDSHAKE_GRACE_S,
        run_batch: BatchRunner | None = None,
        max_draw_batch: int | None = None,
        draw_gather: float = DRAW_GATHER_S,
        group: GroupDraws | None = None,
        policy: PrincipalPolicy | None = None,
        prepare: int = 0,
    ) -> None:
        """Prepare a server (call :meth:`start`).

        Admission (``docs/protocol.md`` §2): at most ``max_connections``
        authenticated connections, ``max_per_address`` from one address; a newcomer
        replaces a pending handshake, or on credit a peer with no fresh draw in
        ``slot_idle_timeout`` s (``handshake_grace`` s after a first handshake).
        Draw budgets (``config``, ``policy``'s caps) are kept per principal: its key
        ID, or without a key its lineage (:mod:`pp1wire.wire.principals`).

        ``busy_poll`` spins the loop while a connection is open. ``draw_threads``
        > 0 draws on that many threads, shared fairly between principals, each
        batch of up to ``max_draw_batch`` jobs by ``run_batch`` (default:
        :func:`~pp1wire.wire.draws.default_runner`) after up to ``draw_gather`` s
        for the STEPs COMMITs announced; 0 draws on the loop. ``proposer``
        replaces the local chain; ``group`` (a rank of a vocabulary-sharded
        group) draws every STEP instead. ``prepare`` > 0: after a batch, while no
        draw waits, the default runner prepares that many next blocks a slot
        (``docs/adaptive.md`` §8; needs ``draw_threads`` and the local chain).

        Raises:
            ValueError: for a limit below 1, a timeout that is not above 0, a
                negative ``draw_gather``, or ``prepare`` without the local chain.
        """
        if max_connections < 1 or (max_per_address is not None and max_per_address < 1):
            raise ValueError("connection limits must be at least 1")
        if not (slot_idle_timeout > 0 and handshake_grace >= 0) or (
            max_draw_batch is not None and max_draw_batch < 1
        ):
            raise ValueError("idle limits must be positive and a draw batch at least 1 job")
        if prepare and (draw_threads < 1 or run_batch is not None or group is not None):
            raise ValueError("prepared blocks need draw threads and the default runner")
        if run_batch is None:
            local = proposer is None and not config.sharded
            run_batch, max_draw_batch = default_runner(
                config.vocab_size,
                config.entries,
                local=local,
                batch=max_draw_batch,
                prepare=prepare,
            )
        self.config = config
        self.drafter = drafter
        self.proposer = proposer
        self.group = group
        self.max_connections = max_connections
        self.max_per_address = max_per_address
        self.slot_idle_timeout = slot_idle_timeout
        self.handshake_grace = handshake_grace
        self.ssl_context = ssl_context
        self.metrics = WorkerMetrics()
        self.conns: set[_Conn] = set()  # open: counted against the limits
        self.closing: set[_Conn] = set()  # closed, flushing what was queued
        self.init_principals(config, policy)
        self.sessions = itertools.count(1)
        self.stopping = False
        self.busy_poll = busy_poll
        self.draw_pool = ThreadPoolExecutor(draw_threads, "pp1-draw") if draw_threads > 0 else None
        self.draws: DrawScheduler[Principal | None, tuple[_Conn, worker_core.DrawJob]]
        self.draws = DrawScheduler(
            max(1, draw_threads),
            max_batch=max_draw_batch or 1,
            gather=draw_gather,
            group_of=draw_group,  # a lineage shares the threads with its address's others
        )
        # Only the server's own pool gathers draws (a group draws them itself).
        self.gathers = self.draw_pool is not None and group is None
        self.run_batch = run_batch
        self.prepared = run_batch.prepared if isinstance(run_batch, DraftTogether) else None
        # Running preparations: (halt, cancel) and their slots' ids; STEPs waiting for one.
        self._preparing: dict[tuple[threading.Event, threading.Event], frozenset[int]] = {}
        self._parked: list[tuple[_Conn, worker_core.DrawJob]] = []
        self._counted: tuple[Counter[str], Counter[str]] = (Counter(), Counter())
        self._scheduling = False  # a _schedule is due on the loop
        self._gather_timer: asyncio.TimerHandle | None = None
        self.failures = FailureLog()
        self._spinner: asyncio.Task[None] | None = None
        self.server: asyncio.Server | None = None
        self.listener: socket.socket | None = None

    # -- draws ----------------------------------------------------------------------

    def submit_draw(self, conn: _Conn, job: worker_core.DrawJob) -> None:
        """Queue ``conn``'s draw; batches are taken once the frames at hand are handled,
        so that STEPs read together are drafted together."""
        # Its rows go to the connection as they are drawn (docs/adaptive.md §7).
        job.owner = conn
        job.streamer = self._streamer
        if self.group is not None:  # its result comes back on a thread of the group's
            loop = asyncio.get_running_loop()
            self.group.submit(conn, job, functools.partial(_group_drawn, loop, conn, job))
            return
        if self.prepared is not None and job.local:
            origin = id(job.slot)
            for (halt, _), slots in self._preparing.items():
                if origin in slots:  # its round is decided: no later stage can serve it
                    halt.set()
            got = self.prepared.lookup(origin, job.draft_job())
            if got is True:  # the running stage draws this very STEP's block
                self._parked.append((conn, job))
                return
            if got is not False:  # prepared for exactly this STEP: out now, on no thread
                self.draws.unexpect(conn.principal, job.step.slot, owner=conn)
                result = job.complete(got)
                asyncio.get_running_loop().call_soon(conn._drawn, job, result)
                self._count_prepared()
                return
        self.draws.submit(
            conn.principal, (conn, job), now=time.monotonic(), owner=conn, tag=job.step.slot
        )
        if self._preparing and self.draws.busy >= self.draws.workers:
            # A STEP waits for a thread a preparation holds: the preparation yields,
            # unless it is preparing this very STEP's slot.
            for (halt, cancel), slots in self._preparing.items():
                if id(job.slot) not in slots:
                    halt.set()
                    cancel.set()
        if not self._scheduling:
            self._scheduling = True
            asyncio.get_running_loop().call_soon(self._schedule)

    @functools.cached_property
    def _streamer(self) -> _RowStreamer:
        return _RowStreamer(asyncio.get_running_loop())

    def forget_draws(self, conn: _Conn) -> None:
        """``conn`` is gone: its queued draws are dropped (running ones finish unused)."""
        if self.group is not None:
            self.group.leave(conn)
        self.draws.drop(conn.principal, owner=conn)
        self.metrics.draws_queued.set(self.draws.queued)

    def _schedule(self) -> None:
        self._scheduling = False
        pool = self.draw_pool
        if pool is not None:
            loop = asyncio.get_running_loop()
            now = time.monotonic()
            while batch := self.draws.next_batch(now):
                jobs = [job for _, (_, job) in batch]
                done = loop.run_in_executor(pool, self.run_batch, jobs)
                done.add_done_callback(functools.partial(self._batch_done, batch))
            until = self.draws.hold_until(now)
            if until is not None and self._gather_timer is None:
                self._gather_timer = loop.call_later(max(0.0, until - now), self._gathered)
        self.metrics.draws_queued.set(self.draws.queued)

    def _gathered(self) -> None:
        self._gather_timer = None
        self._schedule()

    def _batch_done(
        self,
        batch: list[tuple[Principal | None, tuple[_Conn, worker_core.DrawJob]]],
        done: asyncio.Future[list[worker_core.DrawResult]],
    ) -> None:
        if done.cancelled():  # the pool was shut down after the grace period
            self.draws.finished(batch)
            return
        error = done.exception()
        results = None if error is not None else done.result()
        if results is None or len(results) != len(batch):
            failure = error or RuntimeError(
                f"the batch runner returned {len(results or ())} results for {len(batch)} jobs"
            )
            results = [job.complete(failure) for _, (_, job) in batch]
        # Prepared work only when no draw waits for a thread, and for principals no rate
        # bounds (their draws are the budget's to count); it holds the batch's thread
        # (and its principals' share) until done, then the next batch goes.
        mine = [
            (job, result)
            for (_, (conn, job)), result in zip(batch, results, strict=True)
            if conn.core is not None and not conn.core.gate.account.capped
        ]
        prepare = (
            self.prepared is not None
            and self.draw_pool is not None
            and bool(mine)
            and not self.draws.queued
            and not self.stopping
        )
        jobs = [job for job, _ in mine]
        if prepare:
            assert self.prepared is not None
            self.prepared.begin([id(job.slot) for job in jobs])  # before a next STEP can look
        for (_, (conn, job)), result in zip(batch, results, strict=True):
            conn._drawn(job, result)
        if not prepare or self.draw_pool is None:  # (the pool is there when prepare is)
            self.draws.finished(batch)
            self._count_prepared()
            self._schedule()
            return
        runner = self.run_batch
        assert isinstance(runner, DraftTogether)
        events = (threading.Event(), threading.Event())
        slots = frozenset(id(job.slot) for job in jobs)
        self._preparing[events] = slots
        loop = asyncio.get_running_loop()
        drawn = [result for _, result in mine]
        ready = loop.run_in_executor(self.draw_pool, runner.prepare, jobs, drawn, *events)
        ready.add_done_callback(functools.partial(self._prepared_done, batch, jobs, events))

    def _prepared_done(
        self,
        batch: list[tuple[Principal | None, tuple[_Conn, worker_core.DrawJob]]],
        jobs: list[worker_core.DrawJob],
        events: tuple[threading.Event, threading.Event],
        done: asyncio.Future[None],
    ) -> None:
        slots = self._preparing.pop(events)
        if done.cancelled() and self.prepared is not None:  # never ran: release its slots
            self.prepared.end([id(job.slot) for job in jobs])
        self.draws.finished(batch)
        self._count_prepared()
        parked, self._parked = self._parked, []
        for conn, job in parked:  # its block is stored now, or it draws on request
            if id(job.slot) not in slots:
                self._parked.append((conn, job))
            elif conn.core is not None and not conn.lost:
                self.submit_draw(conn, job)
        self._schedule()

    def _count_prepared(self) -> None:
        """Bring the prepared-block counters up to the runner's counts."""
        if self.prepared is None:
            return
        m = self.metrics
        for metric, now, seen in (
            (m.prepared_blocks, self.prepared.prepared, self._counted[0]),
            (m.prepared_used, self.prepared.used, self._counted[1]),
        ):
            for name, count in now.items():
                if count > seen[name]:
                    metric.labels(hypothesis=name).inc(count - seen[name])
                    seen[name] = count

    def draw_failed(self, conn: _Conn, event: worker_core.StepServed, error: BaseException) -> None:
        """Count a drafter failure and log it (each kind with its traceback, then rate-limited)."""
        self.metrics.drafter_errors.labels(error=type(error).__name__).inc()
        show, first, skipped = self.failures.note(error, time.monotonic())
        if not show:
            return
        extra = {
            "peer": conn.peer,
            "slot": event.slot,
            "generation": event.generation,
            "round": event.round,
            "error": repr(error),
            "not_logged_since": skipped,
        }
        log.error(
            "drafter failed" if first else "drafter failed again",
            extra=extra,
            exc_info=(type(error), error, error.__traceback__) if first else None,
        )

    def connection_opened(self) -> None:
        """Start spinning (with ``busy_poll``) while connections are open."""
        if self.busy_poll and self._spinner is None:
            self._spinner = asyncio.ensure_future(self._spin())

    async def _spin(self) -> None:
        try:
            while self.conns and not self.stopping:
                await asyncio.sleep(0)
        finally:
            self._spinner = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a free port); returns the bound port.

        Raises:
            OSError: if the address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        if self.ssl_context is None:
            self.server = await loop.create_server(
                lambda: _Conn(self), host, port, reuse_address=True, backlog=ACCEPT_BACKLOG
            )
            return int(self.server.sockets[0].getsockname()[1])
        # TLS: accepted here, so that a connection counts from accept (the loop's TLS
        # server would hold any number of pending handshakes, each a descriptor).
        listener = socket.create_server((host, port), backlog=ACCEPT_BACKLOG)
        listener.setblocking(False)
        loop.add_reader(listener.fileno(), self._accept_tls)
        self.listener = listener
        return int(listener.getsockname()[1])

    def _accept_tls(self) -> None:
        assert self.listener is not None
        assert self.ssl_context is not None
        for _ in range(ACCEPT_BURST):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the next readiness retries
                log.warning("accept failed", extra={"error": repr(exc)})
                return
            sock.setblocking(False)
            _Conn(self).accept_tls(sock, self.ssl_context)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting; let every connection answer the frames it already received,
        flush and close; whatever is left after ``grace`` seconds is cut."""
        self.stopping = True
        if self.server is not None:
            self.server.close()
        if self.listener is not None:
            asyncio.get_running_loop().remove_reader(self.listener.fileno())
            self.listener.close()
            self.listener = None
        conns = list(self.conns)
        for conn in conns:
            conn.drain()
        waits = [c.closed.wait() for c in [*conns, *self.closing]]
        if waits:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits), grace)
        for conn in [*self.conns, *self.closing]:
            if conn.transport is not None:
                conn.transport.abort()
        if self._gather_timer is not None:
            self._gather_timer.cancel()
            self._gather_timer = None
        if self.draw_pool is not None:
            self.draw_pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)


class _RowStreamer:
    """Hands REPLY frames drawn on a pool thread to their connections, on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def send(self, frames: list[tuple[worker_core.DrawJob, FrameParts]]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nothing to send to
            self.loop.call_soon_threadsafe(self._deliver, frames)

    @staticmethod
    def _deliver(frames: list[tuple[worker_core.DrawJob, FrameParts]]) -> None:
        by_job: dict[worker_core.DrawJob, list[FrameParts]] = {}
        for job, frame in frames:
            by_job.setdefault(job, []).append(frame)
        for job, mine in by_job.items():
            conn = job.owner
            if isinstance(conn, _Conn):
                conn.stream(job, mine)


def _group_drawn(
    loop: asyncio.AbstractEventLoop, conn: _Conn, job: worker_core.DrawJob, result: DrawResult
) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
        loop.call_soon_threadsafe(conn._drawn, job, result)
