"""The worker's asyncio server: one sans-IO ``WorkerProtocol`` per connection.

A thin uvloop shell: one ``BufferedProtocol`` per connection pumps bytes into
the core and writes what it queues; timers come from the core's deadlines.
:meth:`WorkerServer.stop` stops accepting, lets every connection finish the
frames it already received, flushes the replies and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl
import time
from typing import Final, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q.proposal import DrafterFn
from pp1wire.wire import framing, worker_core
from pp1wire.wire.messages import Error, Scope
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol

log = logging.getLogger("pp1wire.worker")

# Round trips and draws on loopback span 50 us to seconds.
SECONDS_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class WorkerMetrics:
    """Every metric the worker exposes, in a registry of its own."""

    def __init__(self) -> None:
        """Register the worker's metrics."""
        r = self.registry = CollectorRegistry()
        self.connections = Gauge("pp1_worker_open_connections", "Open connections.", registry=r)
        self.accepted = Counter("pp1_worker_connections", "Connections accepted.", registry=r)
        self.steps = Counter("pp1_worker_steps", "STEPs answered with a fresh draw.", registry=r)
        self.replays = Counter(
            "pp1_worker_replays", "Retried STEPs answered from the cache.", registry=r
        )
        self.rows = Counter("pp1_worker_rows", "REPLY rows sent.", registry=r)
        self.reply_bytes = Counter("pp1_worker_reply_bytes", "Bytes of replies sent.", registry=r)
        self.failed_steps = Counter(
            "pp1_worker_failed_proposals",
            "Replies sent with a failure status, by code.",
            ["code"],
            registry=r,
        )
        self.refusals = Counter(
            "pp1_worker_refusals", "Messages refused with an ERROR, by code.", ["code"], registry=r
        )
        self.propose_seconds = Histogram(
            "pp1_worker_propose_seconds",
            "Time to draw one proposal block.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )


#: Frames one connection may handle before the loop serves the others.
FRAMES_PER_TURN: Final = 64
#: Replies queued for a peer beyond this many bytes stop reading its requests.
WRITE_BUFFER_CAP: Final = 1 << 20


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
        self.reading = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        peer = self.transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER_CAP)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        srv = self.server
        if srv.stopping or len(srv.conns) >= srv.max_connections:
            code = ErrorCode.SHUTTING_DOWN if srv.stopping else ErrorCode.CONNECTION_LIMIT
            frame = framing.encode_frame(
                Error(code=int(code), answers=0, scope=int(Scope.CONNECTION))
            )
            self.transport.write(frame)
            self.transport.close()
            srv.metrics.refusals.labels(code=code.name.lower()).inc()
            log.warning("connection refused", extra={"peer": self.peer, "code": code.name})
            return
        self.core = WorkerProtocol(
            srv.config, srv.drafter, session=next(srv.sessions), now=time.monotonic()
        )
        srv.conns.add(self)
        srv.connection_opened()
        srv.metrics.connections.set(len(srv.conns))
        srv.metrics.accepted.inc()
        log.info("connection", extra={"peer": self.peer, "session": self.core.session})
        self._arm()

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

    def _pump(self) -> None:
        self.turn = None
        core, transport = self.core, self.transport
        if core is None or transport is None or core.closed:
            return
        queued = transport.get_write_buffer_size()
        if self.writing_paused or queued >= WRITE_BUFFER_CAP:
            self._set_reading(False)  # resume_writing pumps again
            return
        events = core.pump(
            time.monotonic(), max_frames=FRAMES_PER_TURN, out_budget=WRITE_BUFFER_CAP - queued
        )
        self._events(events)
        self._flush()
        if core.closed:
            return
        if core.more:
            # Frames are left: serve other connections first, then continue
            # without reading more from this one.
            self._set_reading(False)
            self.turn = asyncio.get_running_loop().call_soon(self._pump)
        elif not self.writing_paused:
            self._set_reading(True)

    def _set_reading(self, on: bool) -> None:
        transport = self.transport
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
            if isinstance(e, worker_core.StepServed):
                m.propose_seconds.observe(e.draw_seconds)
                m.reply_bytes.inc(e.reply_bytes)
                if e.status:
                    m.failed_steps.labels(code=_name(e.status)).inc()
                else:
                    m.steps.inc()
                    m.rows.inc(e.rows)
            elif isinstance(e, worker_core.StepReplayed):
                m.replays.inc()
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

    def _flush(self) -> None:
        core, transport = self.core, self.transport
        if core is None or transport is None:
            return
        chunks = core.data_to_send()
        if len(chunks) == 1:
            transport.write(chunks[0])
        elif chunks:
            transport.writelines(chunks)
        if core.closed:
            transport.close()
        else:
            self._arm()

    def _arm(self) -> None:
        core = self.core
        deadline = None if core is None else core.next_deadline()
        # The idle deadline moves with every message; a timer set for an earlier
        # time simply fires, finds nothing expired and re-arms, which is much
        # cheaper than cancelling and re-creating a timer per message.
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
        if self.timer is not None:
            self.timer.cancel()
        if self.turn is not None:
            self.turn.cancel()
        if self.core is not None:
            self.core.connection_lost()
        self.server.conns.discard(self)
        self.server.metrics.connections.set(len(self.server.conns))
        log.info("closed", extra={"peer": self.peer, "error": repr(exc) if exc else None})
        self.closed.set()

    def pause_writing(self) -> None:
        # Backpressure: stop reading requests while replies cannot be written.
        self.writing_paused = True
        self._set_reading(False)

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.turn is None:
            self._pump()


def _loop_time(monotonic_deadline: float) -> float:
    """A ``time.monotonic()`` deadline on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())


def _name(code: int) -> str:
    try:
        return ErrorCode(code).name.lower()
    except ValueError:
        return str(code)


class WorkerServer:
    """A listening worker; one :class:`WorkerProtocol` per connection."""

    def __init__(
        self,
        config: WorkerConfig,
        drafter: DrafterFn,
        *,
        max_connections: int = 16,
        ssl_context: ssl.SSLContext | None = None,
        busy_poll: bool = False,
    ) -> None:
        """Prepare a server (call :meth:`start`).

        ``busy_poll`` keeps the event loop spinning while any connection is open,
        trading one busy core for the wake-up latency of an idle one.
        """
        self.config = config
        self.drafter = drafter
        self.max_connections = max_connections
        self.ssl_context = ssl_context
        self.metrics = WorkerMetrics()
        self.conns: set[_Conn] = set()
        self.sessions = itertools.count(1)
        self.stopping = False
        self.busy_poll = busy_poll
        self._spinner: asyncio.Task[None] | None = None
        self.server: asyncio.Server | None = None

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
        self.server = await loop.create_server(
            lambda: _Conn(self), host, port, ssl=self.ssl_context, reuse_address=True
        )
        bound = self.server.sockets[0].getsockname()[1]
        return int(bound)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, flush and close every connection (waits at most ``grace`` s)."""
        self.stopping = True
        if self.server is not None:
            self.server.close()
        for conn in list(self.conns):
            if conn.transport is not None:
                conn.transport.close()  # close() flushes what is already queued
        waits = [c.closed.wait() for c in list(self.conns)]
        if waits:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits), grace)
        for conn in list(self.conns):
            if conn.transport is not None:
                conn.transport.abort()
        if self.server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)
