"""This rank's connection to its worker (``pp1-spark``): the first connect retries what a later
attempt may cure until ``--connect-timeout``; a lost connection is retried with backoff while
rounds go on target-only (``docs/runner.md`` §3); it counts what was received and refused."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import ssl
import time

from pp1wire.aio.client import AsyncClient, ConnectionLostError, RefusedError
from pp1wire.apps.metrics import SparkMetrics
from pp1wire.errors import ErrorCode
from pp1wire.wire import spark_events
from pp1wire.wire.spark_core import SparkConfig

log = logging.getLogger("pp1wire.apps.spark")

#: Handshake refusals that a later attempt may overcome (docs/runner.md §3; the codes:
#: docs/protocol.md §9).
RETRYABLE_REFUSALS = frozenset({ErrorCode.SHUTTING_DOWN, ErrorCode.CONNECTION_LIMIT})


class Link:
    """This rank's connection to its worker: connects, reconnects with backoff, counts."""

    def __init__(
        self,
        host: str,
        port: int,
        config: SparkConfig,
        metrics_: SparkMetrics,
        *,
        tls: ssl.SSLContext | None = None,
        reconnect: bool = True,
    ) -> None:
        """A link to ``host:port`` (nothing connects yet)."""
        self.host, self.port = host, port
        self.config = config
        self.metrics = metrics_
        self.tls = tls
        self.reconnect = reconnect
        self.client: AsyncClient | None = None
        self.bytes_received = 0
        self._retry_at = 0.0
        self._backoff = 0.05
        self._lock = asyncio.Lock()

    async def connect(self, timeout: float) -> None:
        """Connect, retrying with backoff until ``timeout`` a refused or reset connection, or a
        worker's refusal in :data:`RETRYABLE_REFUSALS` (full, or shutting down).

        Raises:
            RefusedError, ConnectionLostError, OSError: the last failure; at once for a
                TLS failure or a refusal that no retry can cure.
        """
        deadline = time.monotonic() + timeout
        pause = 0.1
        while True:
            try:
                self._adopt(await self._dial(max(0.1, min(10.0, deadline - time.monotonic()))))
                return
            except (OSError, RefusedError, ConnectionLostError) as exc:
                if isinstance(exc, ssl.SSLError):
                    raise  # a certificate or TLS-versus-plain mismatch: certain, not transient
                if isinstance(exc, RefusedError) and exc.code not in RETRYABLE_REFUSALS:
                    raise
                if time.monotonic() >= deadline:
                    raise
                # Jitter: waiting clients should not all arrive at once when a worker frees up.
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, 1.0) * (0.75 + random.random() / 2)

    async def _dial(self, timeout: float) -> AsyncClient:
        return await AsyncClient.connect(
            self.host, self.port, self.config, ssl=self.tls, timeout=timeout
        )

    def _adopt(self, client: AsyncClient) -> None:
        self.client = client
        client.observer = self.observe
        if client.core.lineage:  # presented again on a reconnect (docs/protocol.md §4.4)
            self.config = dataclasses.replace(self.config, lineage=client.core.lineage)

    def current(self) -> AsyncClient | None:
        """The client while its connection is up, without waiting (None otherwise)."""
        client = self.client
        return client if client is not None and not client.closed else None

    async def live(self) -> AsyncClient | None:
        """The connected client, reconnecting (with backoff) if it died and this link may; None
        while it is down. Cancelling it abandons a reconnect."""
        async with self._lock:
            client = self.client
            if client is not None and not client.closed:
                return client
            if client is not None:
                self._count(client)
                self.client = None  # counted once, even if this reconnect is cancelled
            if not self.reconnect:
                return None
            now = time.monotonic()
            if now < self._retry_at:
                return None
            try:
                client = await self._dial(2.0)
            except (OSError, RefusedError, ConnectionLostError) as exc:
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, 2.0)
                log.info("reconnect failed", extra={"error": repr(exc)})
                return None
            self._backoff = 0.05
            self._adopt(client)
            self.metrics.reconnects.inc()
            log.info("reconnected", extra={"session": client.session})
            return client

    def observe(self, event: spark_events.SparkEvent) -> None:
        """Count rejected and dropped frames as the client sees them."""
        if isinstance(event, spark_events.FrameRejected):
            self.metrics.rejected.labels(code=event.code.name.lower()).inc()
        elif isinstance(event, spark_events.FrameDropped):
            self.metrics.dropped.labels(code=event.code.name.lower()).inc()

    def _count(self, client: AsyncClient) -> None:
        self.bytes_received += client.core.decoder.bytes_received

    async def close(self) -> None:
        """Close the connection after queued frames are written."""
        if self.client is not None:
            self._count(self.client)
            await self.client.close()
            self.client = None
