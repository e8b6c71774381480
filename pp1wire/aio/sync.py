"""A blocking facade over :class:`~pp1wire.aio.client.AsyncClient`, for a synchronous sampler."""

from __future__ import annotations

import asyncio
import ssl as ssl_module
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Future as ThreadFuture
from typing import Any, TypeVar

from pp1wire.aio.client import AsyncClient
from pp1wire.aio.handles import ProposalBatch, Request
from pp1wire.errors import ErrorCode
from pp1wire.q.proposal import Proposal
from pp1wire.q.verify import RoundResult
from pp1wire.wire.spark_core import SparkConfig

_T = TypeVar("_T")


class SyncClient:
    """A blocking facade over :class:`AsyncClient` that runs its loop on a thread.

    Every method blocks until the async call finishes and raises what it raises.
    Proposals may be released (and their ``with`` blocks left) on any thread.
    """

    def __init__(
        self,
        host: str,
        port: int,
        config: SparkConfig,
        *,
        ssl: ssl_module.SSLContext | None = None,
        timeout: float = 10.0,
    ) -> None:
        """Start the background loop and connect.

        Raises:
            OSError, RefusedError, ConnectionLostError: as :meth:`AsyncClient.connect`.
        """
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.timeout = timeout
        try:
            self.client = self._call(
                AsyncClient.connect(host, port, config, ssl=ssl, timeout=timeout)
            )
        except BaseException:
            self._stop()
            raise

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        fut: ThreadFuture[_T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    def _run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        async def call() -> _T:
            return fn(*args, **kwargs)

        return self._call(call())

    def open(self, slot: int, **kwargs: Any) -> int:
        """See :meth:`AsyncClient.open`."""
        return self._call(self.client.open(slot, **kwargs))

    def open_request(self, slot: int, **kwargs: Any) -> Request:
        """See :meth:`AsyncClient.open_request`."""
        return self._call(self.client.open_request(slot, **kwargs))

    def reopen(self, request: Request) -> None:
        """See :meth:`AsyncClient.reopen`."""
        self._call(self.client.reopen(request))

    def propose(self, slot: int, **kwargs: Any) -> Proposal:
        """See :meth:`AsyncClient.propose`."""
        return self._call(self.client.propose(slot, **kwargs))

    def propose_many(self, requests: Sequence[Request], **kwargs: Any) -> ProposalBatch:
        """See :meth:`AsyncClient.propose_many`."""
        return self._call(self.client.propose_many(requests, **kwargs))

    def cut(self, slots: Sequence[int], code: ErrorCode = ErrorCode.REPLY_TIMEOUT) -> None:
        """See :meth:`AsyncClient.cut`."""
        self._run(self.client.cut, slots, code)

    def release(self, proposal: Proposal) -> None:
        """See :meth:`AsyncClient.release` (returns once the buffers are back)."""
        self.client.release(proposal)

    def next_round(self, slot: int) -> int:
        """See :meth:`AsyncClient.next_round`."""
        return self._run(self.client.next_round, slot)

    def commit(self, slot: int, *, round_id: int, tokens: Sequence[int], accepted: int) -> None:
        """See :meth:`AsyncClient.commit` (does not wait for COMMITTED)."""
        self._run(self.client.commit, slot, round_id=round_id, tokens=tokens, accepted=accepted)

    def commit_round(self, request: Request, result: RoundResult) -> None:
        """See :meth:`AsyncClient.commit_round` (does not wait for COMMITTED)."""
        self._run(self.client.commit_round, request, result)

    def commit_rounds(self, pairs: Iterable[tuple[Request, RoundResult]]) -> None:
        """:meth:`commit_round` for each pair, in one hop to the client's thread.

        Raises:
            UsageError, RefusedError, ConnectionLostError: as :meth:`AsyncClient.commit`,
                for the first pair that fails (the pairs before it are committed).
        """
        todo = list(pairs)

        def each() -> None:
            for request, result in todo:
                self.client.commit_round(request, result)

        self._run(each)

    def reset(self, slot: int) -> int:
        """See :meth:`AsyncClient.reset`."""
        return self._call(self.client.reset(slot))

    def reset_request(self, request: Request) -> None:
        """See :meth:`AsyncClient.reset_request`."""
        self._call(self.client.reset_request(request))

    def close_slot(self, slot: int) -> None:
        """See :meth:`AsyncClient.close_slot`."""
        self._call(self.client.close_slot(slot))

    def close_request(self, request: Request) -> None:
        """See :meth:`AsyncClient.close_request`."""
        self._call(self.client.close_request(request))

    @property
    def session(self) -> int:
        """The session ID the worker assigned."""
        return self.client.session

    @property
    def closed(self) -> bool:
        """True once the connection is dead."""
        return self.client.closed

    def close(self) -> None:
        """Close the connection and stop the background loop."""
        try:
            self._call(self.client.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> SyncClient:
        """Context manager entry."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close on exit."""
        self.close()


__all__ = ["SyncClient"]
