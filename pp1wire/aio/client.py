"""The embeddable Spark-side client (asyncio); :mod:`pp1wire.aio.sync` is its blocking facade.

An asyncio shell around :class:`~pp1wire.wire.spark_core.SparkProtocol` that hands out a
proposal only once its COMPLETION validated (``docs/embedding.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import ssl as ssl_module
import threading
import time
from collections import Counter as TallyCounter
from collections.abc import Callable, Sequence
from typing import NoReturn

from pp1wire.aio.handles import (
    ConnectionLostError,
    ProposalBatch,
    ProposalUnavailableError,
    RefusedError,
    Request,
    scored_by_the_engine,
)
from pp1wire.aio.pool import BufferPool
from pp1wire.aio.transport import ClientConnection, fail_future, outcome_of, settle, write
from pp1wire.errors import ErrorCode, LocalStateError, ProtocolError, UsageError
from pp1wire.q.proposal import Proposal
from pp1wire.q.stoprules import FIXED, StopRule
from pp1wire.q.verify import Processor, RequestVerifier, RoundResult, TargetFn
from pp1wire.wire import spark_events
from pp1wire.wire.events import HandshakeDone
from pp1wire.wire.spark_core import SparkConfig, SparkProtocol

# Codes with which a connection ends without anyone refusing anything.
_LOST = frozenset(
    {
        ErrorCode.CONNECTION_LOST,
        ErrorCode.HANDSHAKE_TIMEOUT,
        ErrorCode.IDLE_TIMEOUT,
        ErrorCode.REPLY_TIMEOUT,
    }
)


class AsyncClient:
    """One connection to a worker, serving any number of concurrent slots."""

    def __init__(self, config: SparkConfig, *, busy_poll: bool = False) -> None:
        """Prefer :meth:`connect`; ``busy_poll`` spins the loop while a proposal is awaited."""
        self.config = config
        self.busy_poll = busy_poll
        self._spinner: asyncio.Task[None] | None = None
        self.loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        row_frame = 16 + 4096 + 4 * config.entries
        # Two in-flight batches of every slot's full-depth block, allocated once.
        self.pool = BufferPool(row_frame, 2 * config.max_slots * config.max_depth)
        self.core = SparkProtocol(
            config, time.monotonic(), allocator=self.pool.acquire, release=self.pool.release
        )
        self._conn: ClientConnection | None = None
        self._handshake: asyncio.Future[None] = self.loop.create_future()
        self._opened: dict[int, asyncio.Future[None]] = {}
        self._proposals: dict[int, asyncio.Future[Proposal]] = {}
        self._held: dict[tuple[int, int], Proposal] = {}  # (slot, round): handed out, unreleased
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
        #: Proposals a fault cut short (their rows before it handed out), by the fault.
        self.cuts: TallyCounter[str] = TallyCounter()
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
        """Connect and complete HELLO (and authentication) within ``timeout`` s in all.

        Raises:
            OSError: if the TCP connection fails (``ssl.SSLError`` for TLS), or it (with
                its TLS handshake) is not made within ``timeout`` (``TimeoutError``).
            RefusedError: the handshake was refused, by either side (``code`` says why).
            ConnectionLostError: the connection ended or the handshake timed out
                (``HANDSHAKE_TIMEOUT``).
        """
        client = cls(config, busy_poll=busy_poll)
        deadline = time.monotonic() + timeout
        # A full accept queue (or a mute TLS peer) holds a connect for minutes of retries.
        try:
            await asyncio.wait_for(
                client.loop.create_connection(
                    client._make_conn, host, port, ssl=ssl, server_hostname=host if ssl else None
                ),
                timeout,
            )
        except TimeoutError:
            raise TimeoutError(f"no connection to {host}:{port} within {timeout:g} s") from None
        client.core.start(time.monotonic())
        client._flush()
        try:
            left = max(0.0, deadline - time.monotonic())
            await asyncio.wait_for(asyncio.shield(client._handshake), left)
        except TimeoutError:
            client.abort()
            raise ConnectionLostError(ErrorCode.HANDSHAKE_TIMEOUT, "no HELLO in time") from None
        except ConnectionLostError as exc:
            if exc.code in _LOST:
                raise
            raise RefusedError(exc.code, "the handshake was refused") from None
        return client

    def _make_conn(self) -> ClientConnection:
        self._conn = ClientConnection(self)
        return self._conn

    async def __aenter__(self) -> AsyncClient:
        """The client itself."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the connection."""
        await self.close()

    # -- plumbing -----------------------------------------------------------

    @property
    def _transport(self) -> asyncio.Transport | None:
        return None if self._conn is None else self._conn.transport

    def _flush(self) -> None:
        chunks = self.core.data_to_send()
        transport = self._transport
        if transport is not None:
            write(transport, chunks)
            if self.core.closed:
                transport.close()
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
        if isinstance(event, HandshakeDone):
            settle(self._handshake, None)
        elif isinstance(event, spark_events.SlotOpened):
            settle(self._opened.pop(event.slot, None), None)
        elif isinstance(event, spark_events.ProposalReady):
            proposal = dataclasses.replace(event.proposal, slot=event.slot, releaser=self.release)
            if proposal.cut is not None:
                self.cuts[proposal.cut.name.lower()] += 1
            self._held[(event.slot, proposal.round_id)] = proposal
            waiter = self._proposals.pop(event.slot, None)
            if waiter is None or waiter.done():
                self._give_back(proposal)  # nobody waits for it any more (a cancelled call)
            else:
                waiter.set_result(proposal)
        elif isinstance(event, spark_events.ProposalFailed):
            if event.code is not ErrorCode.CANCELLED:  # a local close or reset is not one
                self.fallbacks[event.code.name.lower()] += 1
            fail_future(self._proposals.pop(event.slot, None), ProposalUnavailableError(event.code))
        elif isinstance(event, spark_events.ResetAcked):
            settle(self._resets.pop(event.slot, None), None)
        elif isinstance(event, spark_events.CommitAcked):
            settle(self._commits.pop((event.slot, event.generation, event.round), None), None)
        elif isinstance(event, spark_events.SlotDesynced):
            error = RefusedError(event.code, f"the worker refused a request on slot {event.slot}")
            for table in (self._opened, self._resets):
                fail_future(table.pop(event.slot, None), error)
            for key in [k for k in self._commits if k[0] == event.slot]:
                fail_future(self._commits.pop(key), error)
        elif isinstance(event, spark_events.FrameRejected):
            self.rejected[event.code.name.lower()] += 1
        elif isinstance(event, spark_events.FrameDropped):
            self.dropped[event.code.name.lower()] += 1
        elif isinstance(event, spark_events.PongReceived):
            settle(self._pongs.pop(event.nonce, None), None)
        elif isinstance(event, spark_events.ConnectionFailed):
            self.failed = event.code
            self._fail_all(event.code, "connection failed")

    def _fail_all(self, code: ErrorCode, why: str) -> None:
        error = ConnectionLostError(code, why)
        fail_future(self._handshake, error)
        for fut in self._proposals.values():
            fail_future(fut, ProposalUnavailableError(code, why))
        self._proposals.clear()
        for table in (self._opened, self._resets, self._pongs, self._commits):
            for other in table.values():
                fail_future(other, error)
            table.clear()
        self._held.clear()  # every slot is gone; nothing left to give back

    def _lost(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._fail_all(self.failed or ErrorCode.CONNECTION_LOST, "connection lost")
        self._closed.set()

    def _gone(self) -> ConnectionLostError:
        return ConnectionLostError(self.failed or ErrorCode.CONNECTION_LOST, "connection is closed")

    def _local(self, exc: ProtocolError | LocalStateError) -> NoReturn:
        """Raise what the core's refusal of a local call means to a caller."""
        if exc.code is ErrorCode.NOT_READY:
            raise self._gone() from None
        if exc.code is ErrorCode.SLOT_DESYNCED:
            raise RefusedError(exc.code, exc.detail) from None
        raise UsageError(exc.code, exc.detail) from None

    def _own(self, request: Request) -> None:
        if request.client is not self:
            raise UsageError(ErrorCode.BAD_ARGUMENT, f"slot {request.slot} is on another client")

    async def _answered(
        self, waiting: dict[int, asyncio.Future[None]], slot: int, send: Callable[[], int]
    ) -> int:
        """Queue a slot message with ``send`` (its result is returned) and wait for the
        worker's answer (``waiting`` holds the slot's future)."""
        fut: asyncio.Future[None] = self.loop.create_future()
        try:
            sent = send()
        except (ProtocolError, LocalStateError) as exc:
            self._local(exc)
        waiting[slot] = fut
        self._flush()
        await fut
        return sent

    # -- API ----------------------------------------------------------------

    @property
    def session(self) -> int:
        """The session ID the worker assigned."""
        return self.core.session

    @property
    def closed(self) -> bool:
        """True once the connection is dead."""
        return self.core.closed

    def slot_usable(self, slot: int) -> bool:
        """Whether ``slot`` is open on this live connection and not refused."""
        state = None if self.core.closed else self.core.slots.get(slot)
        return state is not None and not state.desynced

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
        """Open ``slot`` with the committed ``prefix`` and ``seed``; wait for OPENED and
        return the slot's generation (``None``: the next unused one, at least ``at_least``).

        Raises:
            UsageError: a bad slot, prefix or generation, or a slot in use (nothing sent).
            RefusedError: the worker refused the OPEN.
            ConnectionLostError: the connection is gone.
        """
        return await self._answered(
            self._opened,
            slot,
            lambda: self.core.open_slot(
                slot,
                seed=seed,
                prefix=prefix,
                eos=eos,
                context=context,
                generation=generation,
                at_least=at_least,
                now=time.monotonic(),
            ),
        )

    async def open_request(
        self,
        slot: int,
        *,
        seed: int,
        prompt: Sequence[int],
        eos: int | None = None,
        processors: Sequence[Processor] = (),
        target: TargetFn | None = None,
        audit: bool = False,
    ) -> Request:
        """Open ``slot`` for a new request and build its verifier: ``processors`` are pure
        ``(prefix, p) -> p`` functions on the target's rows; ``target`` is only for
        verifying without the engine's rows; ``audit`` recomputes the worker's draws.

        Raises:
            UsageError, RefusedError, ConnectionLostError: as :meth:`open`.
        """
        try:
            generation = await self.open(slot, seed=seed, prefix=prompt, eos=eos)
        except RefusedError:
            await self.close_slot(slot)  # free for the next request: nothing holds it
            raise
        verifier = RequestVerifier(
            session=self.session,
            seed=seed,
            vocab_size=self.config.vocab_size,
            prefix=prompt,
            target=target or scored_by_the_engine,
            processors=processors,
            eos=eos,
            generation=generation,
            audit=audit,
        )
        return Request(self, slot, verifier, len(verifier.committed))

    async def reopen(self, request: Request) -> None:
        """Open ``request``'s slot again on this client (after a refusal, or a lost
        connection), with its committed prefix, at a generation above its last.

        Raises:
            UsageError, RefusedError, ConnectionLostError: as :meth:`open`.
        """
        v = request.verifier
        generation = await self.reopen_slot(
            request.slot,
            v,
            at_least=v.generation + 1,
            close_first=request.client is self,
        )
        v.rebuild(v.committed, generation)
        v.session = self.session
        request.client = self

    async def reopen_slot(
        self,
        slot: int,
        verifier: RequestVerifier,
        *,
        generation: int | None = None,
        at_least: int = 0,
        close_first: bool = True,
    ) -> int:
        """The one way a slot is (re)opened for a running request: this client's instance
        of ``slot`` is closed first (unless not ``close_first``), then OPEN carries
        ``verifier``'s state, at ``generation`` (as :meth:`open`). Returns the
        generation; ``verifier`` is not changed (the caller moves it).

        Raises:
            UsageError, RefusedError, ConnectionLostError: as :meth:`open`.
        """
        if close_first and slot in self.core.slots:
            await self.close_slot(slot)
        return await self.open(
            slot,
            seed=verifier.seed,
            prefix=verifier.committed,
            eos=verifier.eos,
            context=verifier.context,
            generation=generation,
            at_least=at_least,
        )

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
        """Ask for one block of up to ``depth`` rows under ``round_id`` (from
        :meth:`~pp1wire.q.verify.RequestVerifier.take_round`) and ``stop`` (a rule other
        than FIXED needs ``SparkConfig.stop_rules``); wait until it validated whole.

        Raises:
            ProposalUnavailableError: the proposal was refused, corrupt, late or lost;
                ``code`` says which (see the class). Decode the round target-only.
            UsageError: a locally invalid request, or a proposal already in flight
                on the slot (nothing sent).
        """
        if self.core.closed:
            raise ProposalUnavailableError(self.failed or ErrorCode.CONNECTION_LOST, "closed")
        fut: asyncio.Future[Proposal] = self.loop.create_future()
        try:
            self.core.step(
                slot,
                round_id=round_id,
                depth=depth,
                temperature=temperature,
                support=support,
                now=time.monotonic(),
                stop=stop,
            )
        except (ProtocolError, LocalStateError) as exc:
            if exc.code is ErrorCode.SLOT_DESYNCED:
                raise ProposalUnavailableError(exc.code, exc.detail) from None
            self._local(exc)
        self._proposals[slot] = fut
        self._flush()
        self._spin_if_asked()
        return await fut

    async def propose_many(
        self,
        requests: Sequence[Request],
        *,
        depth: int,
        temperature: float = 1.0,
        support: int = 0,
        stop: StopRule = FIXED,
        timeout: float | None = None,
    ) -> ProposalBatch:
        """Send a STEP for every request at once (each takes its next round ID); return,
        per request in order, its :class:`~pp1wire.q.proposal.Proposal` (maybe cut by a
        fault: verify it like any other) or the :class:`ProposalUnavailableError` saying
        why (no STEP sent for a refused slot, ``SLOT_DESYNCED``, nor on a closed
        connection). After ``timeout`` s what is in flight is cut (:meth:`cut`).

        Raises:
            UsageError: nothing sent, no round taken: a depth, support or stop rule
                refused (``BAD_STOP_RULE``), two requests on one slot, a request not
                open on this client, one that ended (``REQUEST_FINISHED``,
                ``SESSION_POISONED``), or a proposal in flight on a slot (``SLOT_BUSY``).
        """
        try:
            self.core.check_step(depth=depth, support=support, stop=stop)
        except ProtocolError as exc:
            raise UsageError(exc.code, exc.detail) from None
        if len({r.slot for r in requests}) != len(requests):
            raise UsageError(ErrorCode.BAD_ARGUMENT, "two requests on one slot")
        for r in requests:
            self._own(r)
            v = r.verifier
            if v.finished or v.poisoned:
                code = ErrorCode.REQUEST_FINISHED if v.finished else ErrorCode.SESSION_POISONED
                raise UsageError(code, f"the request on slot {r.slot} has ended")
            if r.slot in self._proposals:
                raise UsageError(ErrorCode.SLOT_BUSY, f"slot {r.slot} has a proposal in flight")
            if not self.core.closed and r.slot not in self.core.slots:
                raise UsageError(ErrorCode.UNKNOWN_SLOT, f"slot {r.slot} is not open")
        out: list[Proposal | ProposalUnavailableError | asyncio.Future[Proposal]] = []
        now = time.monotonic()
        for r in requests:
            if self.core.closed:
                code = self.failed or ErrorCode.CONNECTION_LOST
                out.append(ProposalUnavailableError(code, "connection closed"))
                continue
            if self.core.slots[r.slot].desynced:
                out.append(ProposalUnavailableError(ErrorCode.SLOT_DESYNCED, "reopen the slot"))
                continue
            try:
                self.core.step(
                    r.slot,
                    round_id=r.verifier.take_round(),
                    depth=depth,
                    temperature=temperature,
                    support=support,
                    now=now,
                    stop=stop,
                )
            except (ProtocolError, LocalStateError) as exc:  # checked above: not expected
                out.append(ProposalUnavailableError(exc.code, exc.detail))
                continue
            fut: asyncio.Future[Proposal] = self.loop.create_future()
            self._proposals[r.slot] = fut
            out.append(fut)
        self._flush()  # every STEP in one write
        waiting = [f for f in out if isinstance(f, asyncio.Future)]
        if waiting:
            self._spin_if_asked()
            try:
                await asyncio.wait(waiting, timeout=timeout)
                late = [
                    r.slot
                    for r, f in zip(requests, out, strict=True)
                    if isinstance(f, asyncio.Future) and not f.done()
                ]
                if late:
                    self.cut(late)
                    await asyncio.wait(waiting)  # settled by the cut, on this loop
            except asyncio.CancelledError:
                for f in waiting:  # the caller left: give back what still arrives
                    f.add_done_callback(self._release_orphan)
                raise
        return ProposalBatch(outcome_of(f) for f in out)

    def cut(self, slots: Sequence[int], code: ErrorCode = ErrorCode.REPLY_TIMEOUT) -> None:
        """Stop waiting for the proposals in flight on ``slots``: each becomes the block
        of the rows that arrived, cut by ``code``, or fails with ``code`` if none did
        (``docs/adaptive.md`` §7); later frames of those rounds are dropped as late."""
        if self.core.closed:
            return
        events: list[spark_events.SparkEvent] = []
        for slot in slots:
            if slot in self.core.slots:
                events += self.core.cut(slot, code)
        self._handle(events)

    def _release_orphan(self, fut: asyncio.Future[Proposal]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())

    def _spin_if_asked(self) -> None:
        if self.busy_poll and self._spinner is None:
            self._spinner = asyncio.ensure_future(self._spin())

    async def _spin(self) -> None:
        try:
            while self._proposals and not self.core.closed:
                await asyncio.sleep(0)
        finally:
            self._spinner = None

    def release(self, proposal: Proposal) -> None:
        """Done with ``proposal``'s rows: recycle their receive buffers (idempotent; from
        another thread it returns once the client's loop took them back).

        Raises:
            UsageError: a proposal another client received.
        """
        releaser = proposal.releaser
        if releaser is None:
            return
        if getattr(releaser, "__self__", None) is not self:
            raise UsageError(ErrorCode.BAD_ARGUMENT, "a proposal another client received")
        if threading.get_ident() != self._thread and self.loop.is_running():
            done = threading.Event()

            def give_back() -> None:
                try:
                    self._give_back(proposal)
                finally:
                    done.set()

            with contextlib.suppress(RuntimeError):  # the loop closed: nothing to give back
                self.loop.call_soon_threadsafe(give_back)
                done.wait(10.0)  # a loop that stops before running it has nothing to give back
            return
        self._give_back(proposal)

    def _give_back(self, proposal: Proposal) -> None:
        key = (proposal.slot, proposal.round_id)
        if self._held.get(key) is proposal:
            del self._held[key]
            self.core.release_proposal(*key)

    def next_round(self, slot: int) -> int:
        """The lowest round ``slot`` may use next (see :meth:`SparkProtocol.next_round`).

        Raises:
            UsageError: ``UNKNOWN_SLOT``.
            RefusedError: ``SLOT_DESYNCED``: reopen the slot.
            ConnectionLostError: the connection is gone.
        """
        try:
            return self.core.next_round(slot)
        except (ProtocolError, LocalStateError) as exc:
            self._local(exc)

    def commit(
        self, slot: int, *, round_id: int, tokens: Sequence[int], accepted: int
    ) -> asyncio.Future[None]:
        """Queue COMMIT; the returned future resolves on COMMITTED (awaiting it is optional),
        or fails with :class:`RefusedError` (or ``CANCELLED``) or :class:`ConnectionLostError`.

        Raises:
            UsageError: ``UNKNOWN_SLOT``, or ``COMMIT_INVALID`` if the accepted
                tokens are not the round's drafts (nothing sent).
            RefusedError: ``SLOT_DESYNCED`` until the slot is reopened.
            ConnectionLostError: the connection is gone.
        """
        fut: asyncio.Future[None] = self.loop.create_future()
        try:
            self.core.commit(
                slot, round_id=round_id, tokens=tokens, accepted=accepted, now=time.monotonic()
            )
        except (ProtocolError, LocalStateError) as exc:
            self._local(exc)
        self._commits[(slot, self.core.slots[slot].fence.generation, round_id)] = fut
        self._flush()
        return fut

    def commit_round(self, request: Request, result: RoundResult) -> asyncio.Future[None]:
        """:meth:`commit` ``result`` (what the verifier committed) on ``request``'s slot.

        Raises:
            UsageError: a request on another client; otherwise as :meth:`commit`.
            RefusedError, ConnectionLostError: as :meth:`commit`.
        """
        self._own(request)
        return self.commit(
            request.slot, round_id=result.round_id, tokens=result.tokens, accepted=result.accepted
        )

    async def reset(self, slot: int) -> int:
        """Move ``slot`` to a new generation; returns it once the worker confirms (what
        is still awaited on the slot fails at once, ``CANCELLED``).

        Raises:
            UsageError: ``UNKNOWN_SLOT``.
            RefusedError: the worker refused the RESET.
            ConnectionLostError: the connection is gone.
        """
        if slot in self.core.slots:
            self._cancel(slot, "the slot was reset")
        return await self._answered(
            self._resets, slot, lambda: self.core.reset(slot, time.monotonic())
        )

    async def reset_request(self, request: Request) -> None:
        """:meth:`reset` ``request``'s slot and move its verifier to the new generation.

        Raises:
            UsageError: a request on another client; otherwise as :meth:`reset`.
            RefusedError, ConnectionLostError: as :meth:`reset`.
        """
        self._own(request)
        generation = await self.reset(request.slot)
        request.verifier.rebuild(request.verifier.committed, generation)

    async def close_slot(self, slot: int) -> None:
        """Close ``slot`` (fire and forget: free locally at once; what is awaited on it
        fails, ``CANCELLED``, and its proposals are released). Not open: nothing."""
        if self.core.closed or slot not in self.core.slots:
            return
        self._cancel(slot, "the slot was closed")
        for key in [k for k in self._held if k[0] == slot]:
            del self._held[key]  # the core gives their buffers back with the slot
        self.core.close_slot(slot, time.monotonic())
        self._flush()

    async def close_request(self, request: Request) -> None:
        """:meth:`close_slot` ``request``'s slot.

        Raises:
            UsageError: a request on another client.
        """
        self._own(request)
        await self.close_slot(request.slot)

    def _cancel(self, slot: int, why: str) -> None:
        cancelled = ProposalUnavailableError(ErrorCode.CANCELLED, why)
        fail_future(self._proposals.pop(slot, None), cancelled)
        for key in [k for k in self._commits if k[0] == slot]:
            fail_future(self._commits.pop(key), RefusedError(ErrorCode.CANCELLED, why))

    async def ping(self) -> float:
        """Round-trip time of one PING, in seconds.

        Raises:
            ConnectionLostError: if the connection dies first.
        """
        if self.core.closed:
            raise self._gone()
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
        if self._transport is not None:
            self._transport.abort()

    async def close(self) -> None:
        """Close the connection after queued frames are written."""
        if self._transport is not None:
            self._transport.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closed.wait(), 5.0)


__all__ = [
    "AsyncClient",
    "BufferPool",
    "ConnectionLostError",
    "ProposalBatch",
    "ProposalUnavailableError",
    "RefusedError",
    "Request",
]
