"""``pp1-worker``: the proposer server (drafter plugin, sessions, the only proposal RNG owner).

A thin uvloop shell around :class:`pp1wire.worker_core.WorkerProtocol`: one
``BufferedProtocol`` per connection pumps bytes into the core and writes what
it queues; timers come from the core's deadlines. SIGTERM or SIGINT stops
accepting, lets every connection finish the frames it already received, flushes
the replies, then exits 0.

``pp1-worker --check HOST:PORT`` is the health command: it performs a HELLO
with this worker's settings against a running worker and exits 0 on success.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import signal
import socket
import ssl
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from pp1wire import framing, metrics, worker_core
from pp1wire.errors import ErrorCode
from pp1wire.messages import Error, Scope
from pp1wire.models import DEFAULT_VOCAB
from pp1wire.proposal import DrafterFn
from pp1wire.settings import (
    SettingsError,
    host_port,
    load_factory,
    parse,
    setup_logging,
)
from pp1wire.worker_core import WorkerConfig, WorkerProtocol

log = logging.getLogger("pp1wire.worker")


class WorkerMetrics:
    """Every counter the worker exposes."""

    def __init__(self) -> None:
        """Register the worker's metrics."""
        r = self.registry = metrics.Registry()
        self.connections = r.add(metrics.Gauge("pp1_worker_connections", "Open connections."))
        self.accepted = r.add(
            metrics.Counter("pp1_worker_connections_total", "Connections accepted.")
        )
        self.steps = r.add(
            metrics.Counter("pp1_worker_steps_total", "STEPs answered with a fresh draw.")
        )
        self.replays = r.add(
            metrics.Counter("pp1_worker_replays_total", "Retried STEPs answered from the cache.")
        )
        self.rows = r.add(metrics.Counter("pp1_worker_rows_total", "REPLY rows sent."))
        self.reply_bytes = r.add(
            metrics.Counter("pp1_worker_reply_bytes_total", "Bytes of replies sent.")
        )
        self.failed_steps = r.add(
            metrics.Counter(
                "pp1_worker_failed_proposals_total",
                "Replies sent with a failure status, by code.",
                ["code"],
            )
        )
        self.refusals = r.add(
            metrics.Counter(
                "pp1_worker_refusals_total", "Messages refused with an ERROR, by code.", ["code"]
            )
        )
        self.propose_seconds = r.add(
            metrics.Histogram("pp1_worker_propose_seconds", "Time to draw one proposal block.")
        )


class _Conn(asyncio.BufferedProtocol):
    def __init__(self, server: WorkerServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.core: WorkerProtocol | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.peer = ""
        self.closed = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        peer = self.transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
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
            srv.metrics.refusals.inc(code=code.name.lower())
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
        started = time.perf_counter()
        events = self.core.buffer_updated(nbytes, time.monotonic())
        self._events(events, started)
        self._flush()

    def _events(self, events: list[worker_core.WorkerEvent], started: float) -> None:
        m = self.server.metrics
        for e in events:
            if isinstance(e, worker_core.StepServed):
                m.propose_seconds.observe(time.perf_counter() - started)
                m.reply_bytes.inc(e.reply_bytes)
                if e.status:
                    m.failed_steps.inc(code=_name(e.status))
                else:
                    m.steps.inc()
                    m.rows.inc(e.rows)
            elif isinstance(e, worker_core.StepReplayed):
                m.replays.inc()
            elif isinstance(e, worker_core.Refused):
                m.refusals.inc(code=e.code.name.lower())
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
        self._events(self.core.handle_timer(time.monotonic()), time.perf_counter())
        self._flush()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.core is not None:
            self.core.connection_lost()
        self.server.conns.discard(self)
        self.server.metrics.connections.set(len(self.server.conns))
        log.info("closed", extra={"peer": self.peer, "error": repr(exc) if exc else None})
        self.closed.set()

    def pause_writing(self) -> None:
        # Backpressure: stop reading requests while replies cannot be written.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()


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


def build_parser() -> argparse.ArgumentParser:
    """The ``pp1-worker`` argument parser (every flag also reads ``PP1_<FLAG>``)."""
    p = argparse.ArgumentParser(
        prog="pp1-worker", description="pp1 wire v2 proposer server (the draft worker)."
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=7070, help="listen port (0: any free port)")
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="vocabulary size")
    p.add_argument("--seed", type=int, default=0, help="toy model family seed")
    p.add_argument(
        "--drafter",
        default="pp1wire.models:drafter_factory",
        help="drafter plugin, module:factory; factory(vocab_size=, seed=) -> prefix -> logits",
    )
    p.add_argument("--vocab-hash", type=int, default=0, help="hash of the global token-ID map")
    p.add_argument("--draft-identity", default="pp1-toy-drafter")
    p.add_argument("--target-identity", default="pp1-toy-target")
    p.add_argument("--max-slots", type=int, default=4)
    p.add_argument("--max-depth", type=int, default=5)
    p.add_argument("--max-support", type=int, default=256)
    p.add_argument("--max-prefix", type=int, default=1 << 20, help="longest prefix in tokens")
    p.add_argument("--max-connections", type=int, default=16)
    p.add_argument(
        "--busy-poll",
        action="store_true",
        help="spin the event loop while connections are open (lower latency, one busy core)",
    )
    p.add_argument("--handshake-timeout", type=float, default=5.0)
    p.add_argument("--idle-timeout", type=float, default=300.0)
    p.add_argument("--psk-file", default=None, help="file holding the pre-shared key")
    p.add_argument("--tls-cert", default=None, help="PEM certificate (enables TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--config", default=None, help="TOML file with any of these settings")
    p.add_argument(
        "--check",
        default=None,
        metavar="HOST:PORT",
        help="health check: HELLO a running worker, exit 0 if it answers",
    )
    return p


def read_psk(path: str | None) -> bytes | None:
    """The pre-shared key from a file (surrounding whitespace stripped).

    Raises:
        SettingsError: if the file cannot be read or holds fewer than 16 bytes.
    """
    if not path:
        return None
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise SettingsError(f"psk file {path}: {exc}") from None
    if len(key) < 16:
        raise SettingsError(f"psk file {path}: a key needs at least 16 bytes")
    return key


def config_from(args: argparse.Namespace) -> WorkerConfig:
    """The :class:`WorkerConfig` the parsed settings describe.

    Raises:
        SettingsError: for limits outside their ranges.
    """
    if not 1 <= args.max_depth <= 5:
        raise SettingsError("--max-depth must be in 1..5")
    if args.vocab < 2 or args.max_slots < 1 or args.max_support < 0:
        raise SettingsError("--vocab >= 2, --max-slots >= 1, --max-support >= 0 required")
    return WorkerConfig(
        vocab_size=args.vocab,
        vocab_hash=args.vocab_hash,
        draft_identity=args.draft_identity,
        target_identity=args.target_identity,
        max_slots=args.max_slots,
        max_depth=args.max_depth,
        max_support=min(args.max_support, args.vocab),
        max_prefix=args.max_prefix,
        psk=read_psk(args.psk_file),
        handshake_timeout=args.handshake_timeout,
        idle_timeout=args.idle_timeout,
    )


async def check(args: argparse.Namespace, target: str) -> int:
    """Health check: HELLO against ``target`` with this worker's settings; 0 if answered."""
    from pp1wire.client import AsyncClient, ClientClosedError  # noqa: PLC0415
    from pp1wire.spark_core import SparkConfig  # noqa: PLC0415

    host, port = host_port(target)
    cfg = config_from(args)
    spark_cfg = SparkConfig(
        vocab_size=cfg.vocab_size,
        vocab_hash=cfg.vocab_hash,
        target_identity=cfg.target_identity,
        max_slots=1,
        max_depth=1,
        max_support=0,
        max_prefix=0,
        psk=cfg.psk,
    )
    ctx = None
    if args.tls_cert:
        ctx = ssl.create_default_context(cafile=args.tls_cert)
    try:
        client = await AsyncClient.connect(host, port, spark_cfg, ssl=ctx, timeout=5.0)
    except (OSError, ClientClosedError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    rtt = await client.ping()
    await client.close()
    print(f"healthy: session {client.session}, ping {rtt * 1e3:.3f} ms")
    return 0


async def serve(args: argparse.Namespace) -> int:
    """Run the worker until SIGTERM/SIGINT; returns the exit code."""
    config = config_from(args)
    factory = load_factory(args.drafter)
    drafter: DrafterFn = factory(vocab_size=args.vocab, seed=args.seed)
    ctx = None
    if args.tls_cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    server = WorkerServer(
        config,
        drafter,
        max_connections=args.max_connections,
        ssl_context=ctx,
        busy_poll=args.busy_poll,
    )
    port = await server.start(args.host, args.port)
    metrics_server = None
    if args.metrics_port:
        metrics_server = await metrics.serve(
            server.metrics.registry, args.metrics_host, args.metrics_port
        )
    log.info(
        "listening",
        extra={
            "host": args.host,
            "port": port,
            "vocab": args.vocab,
            "tls": bool(ctx),
            "auth": config.psk is not None,
            "metrics_port": args.metrics_port,
        },
    )
    print(f"pp1-worker listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining", extra={"connections": len(server.conns)})
    await server.stop()
    if metrics_server is not None:
        metrics_server.close()
    log.info("stopped")
    return 0


def install_uvloop() -> None:
    """Use uvloop's event loop where it is installed."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def main(argv: Sequence[str] | None = None) -> int:
    """``pp1-worker`` entry point."""
    parser = build_parser()
    try:
        args = parse(parser, argv)
        setup_logging(args.log_level)
        install_uvloop()
        if args.check:
            return asyncio.run(check(args, args.check))
        return asyncio.run(serve(args))
    except SettingsError as exc:
        print(f"pp1-worker: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pp1-worker: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
