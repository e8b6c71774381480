"""A hostile worker: a real worker core whose replies (REPLY and COMPLETION frames) go to a test's
``mutate(conn, data)`` instead of the socket, to be held, delayed, corrupted, duplicated or cut
and written with ``conn.write``; every other frame passes unchanged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pp1wire.apps.models import ToyLM
from pp1wire.testing.builders import split_frames
from pp1wire.testing.conformance.spark_side import shut
from pp1wire.wire.messages import MsgType
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol

Mutator = Callable[["FaultyConn", bytes], None]


class FaultyConn(asyncio.Protocol):
    """One connection of a :class:`FaultyWorker`."""

    def __init__(self, server: FaultyWorker) -> None:
        self.server = server
        self.core = WorkerProtocol(
            server.config, server.drafter, session=server.next_session(), now=time.monotonic()
        )
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Register the connection with its server."""
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server.conns.append(self)

    def data_received(self, data: bytes) -> None:
        """Feed the worker core; hand replies to the server's mutator."""
        self.core.receive_data(data, time.monotonic())
        out = b"".join(self.core.data_to_send())
        if not out:
            return
        frames = split_frames(out)
        if any(f[3] in (MsgType.REPLY, MsgType.COMPLETION) for f in frames) and self.server.mutate:
            mutate = self.server.mutate
            if self.server.once:
                self.server.mutate = None
            mutate(self, out)
        else:
            self.write(out)

    def write(self, data: bytes) -> None:
        """Send ``data`` to the Spark side (if the connection is still open)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


@dataclass
class FaultyWorker:
    """A listening worker (toy drafter) whose replies go through ``mutate`` (once, or always)."""

    vocab: int
    seed: int = 3
    mutate: Mutator | None = None
    once: bool = True
    conns: list[FaultyConn] = field(default_factory=list)
    server: asyncio.Server | None = None
    _sessions: int = 0

    def __post_init__(self) -> None:
        """Build the worker's configuration and drafter."""
        self.config = WorkerConfig(vocab_size=self.vocab)
        self.drafter = ToyLM(self.vocab, self.seed, draft=True).logits

    def next_session(self) -> int:
        """A new session ID."""
        self._sessions += 1
        return self._sessions

    async def start(self) -> int:
        """Listen on a free loopback port; returns it."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: FaultyConn(self), "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def slot_prefix(self, slot: int = 0) -> list[int]:
        """The committed prefix of ``slot`` on the newest connection that has it open."""
        live = [c for c in self.conns if slot in c.core.slots]
        return list(live[-1].core.slots[slot].prefix)

    async def stop(self) -> None:
        """Abort every connection and stop listening."""
        await shut(self.server, closers=[c.transport.abort for c in self.conns if c.transport])
