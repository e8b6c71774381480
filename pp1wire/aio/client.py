"""Embeddable Spark-side client: async API, a synchronous facade, and flat-layout helpers.

The client is a thin asyncio shell around :class:`pp1wire.wire.spark_core.SparkProtocol`:
a ``BufferedProtocol`` lets the socket write every large frame straight into a
recycled receive buffer, the core validates each row as it arrives, and
:meth:`AsyncClient.propose` returns a :class:`~pp1wire.q.proposal.Proposal` only
after its COMPLETION validated. Every failure (refused, corrupt, timed out,
connection lost) surfaces as :class:`ProposalUnavailableError` with its code, so the
caller decodes that round target-only and commits it with :meth:`commit`.

Typical use from a sampler::

    client = await AsyncClient.connect("127.0.0.1", 7070, SparkConfig(vocab_size=V))
    generation = await client.open(0, seed=seed, prefix=prompt)
    verifier.rebuild(prompt, generation)            # pp1wire.q.verify.RequestVerifier
    verifier.session = client.session
    try:
        proposal = await client.propose(0, round_id=verifier.take_round(), depth=5)
        result = verifier.verify(proposal)
        client.release(proposal, 0)
    except ProposalUnavailableError:
        result = verifier.decode_target_only(verifier.take_round())
    client.commit(0, round_id=result.round_id, tokens=result.tokens, accepted=result.accepted)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl as ssl_module
import threading
import time
from collections import Counter as TallyCounter
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future as ThreadFuture
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ErrorCode, Pp1Error, ProtocolError
from pp1wire.q.arrays import host_array
from pp1wire.q.proposal import Proposal
from pp1wire.q.stoprules import FIXED, StopRule
from pp1wire.wire import spark_events
from pp1wire.wire.spark_core import SparkConfig, SparkProtocol

_T = TypeVar("_T")
_Rows = TypeVar("_Rows", bound=Any)  # numpy rows, or an engine tensor sliced the same way


class ProposalUnavailableError(Pp1Error):
    """No usable proposal this round (``code`` says why); decode it target-only."""


class ClientClosedError(Pp1Error):
    """The connection is gone; reconnect and reopen the slots."""


class BufferPool:
    """Receive buffers of one size, allocated once and recycled.

    A frame larger than the pool's buffers, or one arriving while every buffer
    is in use, gets a fresh allocation (counted in :attr:`misses`) rather than
    waiting: correctness never depends on the pool.
    """

    def __init__(self, size: int, count: int) -> None:
        """Allocate ``count`` buffers of ``size`` bytes."""
        self.size = size
        # The pool keeps every buffer alive, so an id() it knows can never be
        # reused by an unrelated object handed to release().
        self._buffers = [bytearray(size) for _ in range(count)]
        self._free = list(self._buffers)
        self._owned = {id(b) for b in self._buffers}
        self._free_ids = set(self._owned)
        self.misses = 0

    def acquire(self, nbytes: int) -> memoryview:
        """A writable buffer of at least ``nbytes``."""
        if nbytes <= self.size and self._free:
            buf = self._free.pop()
            self._free_ids.discard(id(buf))
            return memoryview(buf)
        self.misses += 1
        return memoryview(bytearray(nbytes))

    def release(self, view: memoryview) -> None:
        """Return the buffer behind ``view`` (ignores buffers the pool does not own)."""
        obj = view.obj
        if isinstance(obj, bytearray) and id(obj) in self._owned and id(obj) not in self._free_ids:
            self._free.append(obj)
            self._free_ids.add(id(obj))

    @property
    def free(self) -> int:
        """Buffers currently available."""
        return len(self._free)


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                import socket  # noqa: PLC0415

                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.client.core.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        core = self.client.core
        events = core.buffer_updated(nbytes, time.monotonic())
        if events or core.has_output or core.closed:
            self.client._handle(events)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._handle(self.client.core.connection_lost())
        self.client._lost()


class AsyncClient:
    """One connection to a worker, serving any number of concurrent slots."""

    def __init__(self, config: SparkConfig, *, busy_poll: bool = False) -> None:
        """Prefer :meth:`connect`.

        ``busy_poll`` keeps the event loop spinning while a proposal is awaited,
        trading a busy core for the wake-up latency of an idle one.
        """
        self.config = config
        self.busy_poll = busy_poll
        self._spinner: asyncio.Task[None] | None = None
        self.loop = asyncio.get_running_loop()
        row_frame = 16 + 4096 + 4 * config.entries
        # Two in-flight batches of every slot's full-depth block, allocated once.
        self.pool = BufferPool(row_frame, 2 * config.max_slots * config.max_depth)
        self.core = SparkProtocol(
            config, time.monotonic(), allocator=self.pool.acquire, release=self.pool.release
        )
        self._conn: _Connection | None = None
        self._handshake: asyncio.Future[None] = self.loop.create_future()
        self._opened: dict[int, asyncio.Future[None]] = {}
        self._proposals: dict[int, asyncio.Future[Proposal]] = {}
        self._resets: dict[int, asyncio.Future[None]] = {}
        self._commits: dict[tuple[int, int, int], asyncio.Future[None]] = {}  # slot, gen, round
        self._pongs: dict[int, asyncio.Future[None]] = {}
        self._nonces = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._deadline: float | None = None
        self._closed = asyncio.Event()
        self.failed: ErrorCode | None = None
        #: Called with every protocol event (metrics, logs); must not raise.
        self.observer: Callable[[spark_events.SparkEvent], None] | None = None
        self.fallbacks: TallyCounter[str] = TallyCounter()
        self.rejected: TallyCounter[str] = TallyCounter()
        self.dropped: TallyCounter[str] = TallyCounter()

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        config: SparkConfig,
        *,
        ssl: ssl_module.SSLContext | None = None,
        timeout: float = 10.0,
        busy_poll: bool = False,
    ) -> AsyncClient:
        """Connect and complete HELLO (and authentication); see :class:`AsyncClient`.

        Raises:
            OSError: if the TCP connection fails.
            ClientClosedError: if the handshake is refused or times out (``code`` says why).
        """
        client = cls(config, busy_poll=busy_poll)
        await client.loop.create_connection(
            client._make_conn, host, port, ssl=ssl, server_hostname=host if ssl else None
        )
        client.core.start(time.monotonic())
        client._flush()
        try:
            await asyncio.wait_for(asyncio.shield(client._handshake), timeout)
        except TimeoutError:
            client.abort()
            raise ClientClosedError(ErrorCode.HANDSHAKE_TIMEOUT, "no HELLO in time") from None
        return client

    def _make_conn(self) -> _Connection:
        self._conn = _Connection(self)
        return self._conn

    # -- plumbing -----------------------------------------------------------

    def _flush(self) -> None:
        chunks = self.core.data_to_send()
        if chunks and self._conn is not None and self._conn.transport is not None:
            if len(chunks) == 1:
                self._conn.transport.write(chunks[0])
            else:
                self._conn.transport.writelines(chunks)
        if self.core.closed and self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._arm_timer()

    def _arm_timer(self) -> None:
        deadline = self.core.next_deadline()
        if deadline == self._deadline:
            return  # most calls change nothing; re-arming costs more than the check
        self._deadline = deadline
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline is not None:
            delay = max(0.0, deadline - time.monotonic())
            self._timer = self.loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._deadline = None
        self._handle(self.core.handle_timer(time.monotonic()))

    def _handle(self, events: list[spark_events.SparkEvent]) -> None:
        for event in events:
            self._route(event)
        self._flush()

    def _route(self, event: spark_events.SparkEvent) -> None:
        if self.observer is not None:
            self.observer(event)
        if isinstance(event, spark_events.HandshakeDone):
            _settle(self._handshake, None)
        elif isinstance(event, spark_events.SlotOpened):
            _settle(self._opened.pop(event.slot, None), None)
        elif isinstance(event, spark_events.ProposalReady):
            _settle(self._proposals.pop(event.slot, None), event.proposal)
        elif isinstance(event, spark_events.ProposalFailed):
            if event.code is not ErrorCode.CANCELLED:  # a local close or reset is not one
                self.fallbacks[event.code.name.lower()] += 1
            _fail(self._proposals.pop(event.slot, None), ProposalUnavailableError(event.code))
        elif isinstance(event, spark_events.ResetAcked):
            _settle(self._resets.pop(event.slot, None), None)
        elif isinstance(event, spark_events.CommitAcked):
            _settle(self._commits.pop((event.slot, event.generation, event.round), None), None)
        elif isinstance(event, spark_events.SlotDesynced):
            error = ClientClosedError(event.code, f"slot {event.slot} out of sync")
            for table in (self._opened, self._resets):
                _fail(table.pop(event.slot, None), error)
            for key in [k for k in self._commits if k[0] == event.slot]:
                _fail(self._commits.pop(key), error)
        elif isinstance(event, spark_events.FrameRejected):
            self.rejected[event.code.name.lower()] += 1
        elif isinstance(event, spark_events.FrameDropped):
            self.dropped[event.code.name.lower()] += 1
        elif isinstance(event, spark_events.PongReceived):
            _settle(self._pongs.pop(event.nonce, None), None)
        elif isinstance(event, spark_events.ConnectionFailed):
            self.failed = event.code
            self._fail_all(ClientClosedError(event.code, "connection failed"))

    def _fail_all(self, error: Pp1Error) -> None:
        _fail(self._handshake, error)
        for table in (self._opened, self._proposals, self._resets, self._pongs):
            for fut in table.values():
                _fail(fut, error)
            table.clear()
        for fut in self._commits.values():
            _fail(fut, error)
        self._commits.clear()

    def _lost(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        code = self.failed or ErrorCode.CONNECTION_LOST
        self._fail_all(ClientClosedError(code, "connection lost"))
        self._closed.set()

    def _require_open(self) -> None:
        if self.core.closed:
            code = self.failed or ErrorCode.CONNECTION_LOST
            raise ClientClosedError(code, "connection is closed")

    # -- API ----------------------------------------------------------------

    @property
    def session(self) -> int:
        """The session ID the worker assigned."""
        return self.core.session

    @property
    def closed(self) -> bool:
        """True once the connection is dead."""
        return self.core.closed

    async def open(
        self,
        slot: int,
        *,
        seed: int,
        prefix: Sequence[int],
        eos: int | None = None,
        context: int = 0,
        generation: int | None = None,
        at_least: int = 0,
    ) -> int:
        """Open ``slot`` with the committed ``prefix`` and request ``seed``; wait for OPENED.

        Returns the slot's generation (``None`` picks the next unused one, no
        lower than ``at_least``: a reopened slot always moves to a higher one).

        Raises:
            ProtocolError: for a bad slot or prefix (nothing sent).
            ClientClosedError: if the worker refuses or the connection dies.
        """
        self._require_open()
        fut: asyncio.Future[None] = self.loop.create_future()
        chosen = self.core.open_slot(
            slot,
            seed=seed,
            prefix=prefix,
            eos=eos,
            context=context,
            generation=generation,
            at_least=at_least,
        )
        self._opened[slot] = fut
        self._flush()
        await fut
        return chosen

    async def propose(
        self,
        slot: int,
        *,
        round_id: int,
        depth: int,
        temperature: float = 1.0,
        support: int = 0,
        stop: StopRule = FIXED,
    ) -> Proposal:
        """Ask for one block under ``round_id`` and wait until it is validated whole.

        ``depth`` is the block's maximum; ``stop`` its stop rule
        (``docs/adaptive.md``; a rule other than FIXED needs
        ``SparkConfig.stop_rules``), audited on arrival.

        ``round_id`` comes from the request's own counter
        (:meth:`pp1wire.q.verify.RequestVerifier.take_round`), which also numbers
        its target-only rounds.

        Raises:
            ProposalUnavailableError: the proposal was refused, corrupt, late or lost;
                ``code`` says which (``CANCELLED``: this side closed or reset the slot
                meanwhile). Decode the round target-only.
            ProtocolError: for a locally invalid request (nothing sent).
            LocalStateError: the slot is busy, desynced, or the connection not ready.
        """
        if self.core.closed:
            code = self.failed or ErrorCode.CONNECTION_LOST
            raise ProposalUnavailableError(code, "connection closed")
        fut: asyncio.Future[Proposal] = self.loop.create_future()
        self.core.step(
            slot,
            round_id=round_id,
            depth=depth,
            temperature=temperature,
            support=support,
            now=time.monotonic(),
            stop=stop,
        )
        self._proposals[slot] = fut
        self._flush()
        if self.busy_poll and self._spinner is None:
            self._spinner = asyncio.ensure_future(self._spin())
        return await fut

    async def _spin(self) -> None:
        try:
            while self._proposals and not self.core.closed:
                await asyncio.sleep(0)
        finally:
            self._spinner = None

    def release(self, proposal: Proposal, slot: int) -> None:
        """Done with ``proposal``'s rows (after verifying): recycle their receive buffers."""
        self.core.release_proposal(slot, proposal.round_id)

    def next_round(self, slot: int) -> int:
        """The lowest round ``slot`` may use next (see :meth:`SparkProtocol.next_round`).

        Raises:
            ProtocolError: ``UNKNOWN_SLOT``.
            LocalStateError: a closed connection or a desynced slot.
        """
        return self.core.next_round(slot)

    def commit(
        self, slot: int, *, round_id: int, tokens: Sequence[int], accepted: int
    ) -> asyncio.Future[None]:
        """Queue COMMIT; the returned future resolves on COMMITTED (awaiting it is optional).

        Raises:
            ProtocolError: ``COMMIT_INVALID`` if the accepted tokens are not the drafts.
            LocalStateError: ``SLOT_DESYNCED`` until the slot is reopened.
            ClientClosedError: if the connection is closed.
        """
        self._require_open()
        fut: asyncio.Future[None] = self.loop.create_future()
        self.core.commit(slot, round_id=round_id, tokens=tokens, accepted=accepted)
        self._commits[(slot, self.core.slots[slot].fence.generation, round_id)] = fut
        self._flush()
        return fut

    async def reset(self, slot: int) -> int:
        """Move ``slot`` to a new generation; returns it once the worker confirms.

        A proposal or COMMITTED still awaited on the slot fails at once with
        ``CANCELLED``: nothing of the old generation can answer any more.

        Raises:
            ClientClosedError: if the worker refuses or the connection dies.
        """
        self._require_open()
        fut: asyncio.Future[None] = self.loop.create_future()
        self._cancel(slot, "the slot was reset")
        generation = self.core.reset(slot)
        self._resets[slot] = fut
        self._flush()
        await fut
        return generation

    async def close_slot(self, slot: int) -> None:
        """Close ``slot`` (fire and forget: the slot is free locally at once).

        A proposal or COMMITTED still awaited on the slot fails at once with
        ``CANCELLED``.
        """
        if self.core.closed or slot not in self.core.slots:
            return
        self._cancel(slot, "the slot was closed")
        self.core.close_slot(slot)
        self._flush()

    def _cancel(self, slot: int, why: str) -> None:
        _fail(self._proposals.pop(slot, None), ProposalUnavailableError(ErrorCode.CANCELLED, why))
        for key in [k for k in self._commits if k[0] == slot]:
            _fail(self._commits.pop(key), ClientClosedError(ErrorCode.CANCELLED, why))

    async def ping(self) -> float:
        """Round-trip time of one PING, in seconds.

        Raises:
            ClientClosedError: if the connection dies first.
        """
        self._require_open()
        started = time.perf_counter()
        nonce = next(self._nonces)
        fut: asyncio.Future[None] = self.loop.create_future()
        self._pongs[nonce] = fut
        self.core.ping(nonce)
        self._flush()
        await fut
        return time.perf_counter() - started

    def abort(self) -> None:
        """Drop the connection at once."""
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.abort()

    async def close(self) -> None:
        """Close the connection after queued frames are written."""
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closed.wait(), 5.0)


def _settle(fut: asyncio.Future[Any] | None, value: Any) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future[Any] | None, error: BaseException) -> None:
    if fut is not None and not fut.done():
        fut.set_exception(error)
        # The caller may have stopped waiting (a reset, a shutdown): do not warn.
        fut.exception()


class SyncClient:
    """A blocking facade over :class:`AsyncClient` that runs its loop on a thread.

    Every method blocks until the async call finishes and raises what it raises.
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
            OSError, ClientClosedError: as :meth:`AsyncClient.connect`.
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

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        async def call() -> Any:
            return fn(*args, **kwargs)

        return self._call(call())

    def open(self, slot: int, **kwargs: Any) -> int:
        """See :meth:`AsyncClient.open`."""
        return self._call(self.client.open(slot, **kwargs))

    def propose(self, slot: int, **kwargs: Any) -> Proposal:
        """See :meth:`AsyncClient.propose`."""
        return self._call(self.client.propose(slot, **kwargs))

    def release(self, proposal: Proposal, slot: int) -> None:
        """See :meth:`AsyncClient.release`."""
        self._run(self.client.release, proposal, slot)

    def next_round(self, slot: int) -> int:
        """See :meth:`AsyncClient.next_round`."""
        return self.client.next_round(slot)

    def commit(self, slot: int, *, round_id: int, tokens: Sequence[int], accepted: int) -> None:
        """See :meth:`AsyncClient.commit` (does not wait for COMMITTED)."""
        self._run(self.client.commit, slot, round_id=round_id, tokens=tokens, accepted=accepted)

    def reset(self, slot: int) -> int:
        """See :meth:`AsyncClient.reset`."""
        return self._call(self.client.reset(slot))

    def close_slot(self, slot: int) -> None:
        """See :meth:`AsyncClient.close_slot`."""
        self._call(self.client.close_slot(slot))

    @property
    def session(self) -> int:
        """The session ID the worker assigned."""
        return self.client.session

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


# -- flat layout helpers (vLLM / SGLang style) ----------------------------------------


def flatten_drafts(
    proposals: Sequence[Proposal | None],
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Draft token IDs ``[num_tokens]`` and draft counts ``[batch]`` for a batch.

    ``None`` (no proposal this round) contributes a count of 0.
    """
    counts = np.array([0 if p is None else len(p.rows) for p in proposals], dtype=np.int32)
    ids = [t for p in proposals if p is not None for t in p.tokens]
    return np.asarray(ids, dtype=np.int32), counts


def pack_outputs(outputs: Sequence[Sequence[int]], max_depth: int) -> npt.NDArray[np.int32]:
    """Accepted tokens per request as ``[batch, max_depth + 1]``, padded with -1.

    Raises:
        ValueError: if a request has more than ``max_depth + 1`` tokens.
    """
    out = np.full((len(outputs), max_depth + 1), -1, dtype=np.int32)
    for i, tokens in enumerate(outputs):
        row = host_array(tokens)  # a list, a numpy array or an engine tensor
        if len(row) > max_depth + 1:
            raise ValueError(f"request {i} has {len(row)} tokens > {max_depth + 1}")
        out[i, : len(row)] = row
    return out


def target_rows(target_probs: _Rows, draft_counts: npt.ArrayLike) -> list[_Rows]:
    """Split engine-layout target probabilities into per-request blocks (views, no copy).

    ``target_probs`` is ``[num_tokens + batch, V]``: for request i, its
    ``draft_counts[i]`` draft positions followed by one bonus position, in
    request order. Row j of block i is p for the prefix extended by the
    request's first j drafts. ``target_probs`` may be a numpy array or an
    engine's tensor (torch, any device): the blocks are slices of it, of the
    same type, and each row can go to the verifier as it is.

    Raises:
        ValueError: if the row count does not match ``sum(draft_counts) + batch``.
    """
    counts = [int(n) for n in host_array(draft_counts).tolist()]
    expected = sum(counts) + len(counts)
    if target_probs.shape[0] != expected:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, expected {expected}")
    blocks = []
    start = 0
    for n in counts:
        blocks.append(target_probs[start : start + n + 1])
        start += n + 1
    return blocks


__all__ = [
    "AsyncClient",
    "BufferPool",
    "ClientClosedError",
    "ProposalUnavailableError",
    "ProtocolError",
    "SyncClient",
    "flatten_drafts",
    "pack_outputs",
    "target_rows",
]
