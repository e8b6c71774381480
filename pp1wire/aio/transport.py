"""The asyncio shells' socket plumbing: the client's buffered transport protocol, how its
futures are settled, and what the worker's server shares with it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Sequence
from typing import Any, Protocol, cast

from pp1wire.aio.handles import ProposalUnavailableError
from pp1wire.errors import ErrorCode, Pp1Error
from pp1wire.q.proposal import Proposal
from pp1wire.wire import spark_events
from pp1wire.wire.spark_core import SparkProtocol


class _Client(Protocol):
    """What the transport protocol needs of its client."""

    core: SparkProtocol

    def _handle(self, events: list[spark_events.SparkEvent]) -> None: ...

    def _lost(self) -> None: ...


class ClientConnection(asyncio.BufferedProtocol):
    """The client's transport protocol: the socket writes each large frame straight into
    the core's receive buffer, and the core's events go to the client."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        nodelay(transport.get_extra_info("socket"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.client.core.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        core = self.client.core
        events = core.buffer_updated(nbytes, time.monotonic())
        if events or core.has_output or core.closed:
            self.client._handle(events)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._handle(self.client.core.connection_lost())
        self.client._lost()


def nodelay(sock: socket.socket | None) -> None:
    """Set TCP_NODELAY on ``sock`` if it has one (an error is ignored)."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def write(transport: asyncio.Transport, chunks: Sequence[bytes | memoryview]) -> None:
    """Queue ``chunks`` on ``transport`` (one write for one chunk)."""
    if len(chunks) == 1:
        transport.write(chunks[0])
    elif chunks:
        transport.writelines(chunks)


def outcome_of(
    item: Proposal | ProposalUnavailableError | asyncio.Future[Proposal],
) -> Proposal | ProposalUnavailableError:
    """A batch entry: the proposal, or why there is none (a future settled or not)."""
    if not isinstance(item, asyncio.Future):
        return item
    if item.cancelled():
        return ProposalUnavailableError(ErrorCode.CANCELLED, "the wait was cancelled")
    error = item.exception()
    if error is None:
        return item.result()
    if isinstance(error, ProposalUnavailableError):
        return error
    code = error.code if isinstance(error, Pp1Error) else ErrorCode.INTERNAL
    return ProposalUnavailableError(code, str(error))


def settle(fut: asyncio.Future[Any] | None, value: Any) -> None:
    """Resolve ``fut`` with ``value`` unless it is gone or done."""
    if fut is not None and not fut.done():
        fut.set_result(value)


def fail_future(fut: asyncio.Future[Any] | None, error: BaseException) -> None:
    """Fail ``fut`` with ``error`` unless it is gone or done."""
    if fut is not None and not fut.done():
        fut.set_exception(error)
        # The caller may have stopped waiting (a reset, a shutdown): do not warn.
        fut.exception()


__all__ = ["ClientConnection", "fail_future", "nodelay", "outcome_of", "settle", "write"]
