"""The embeddable Spark-side client (asyncio); :mod:`pp1wire.aio.sync` is its blocking facade.

A thin asyncio shell around :class:`pp1wire.wire.spark_core.SparkProtocol`: a
``BufferedProtocol`` lets the socket write every large frame straight into a
recycled receive buffer, the core validates each row as it arrives, and a
:class:`~pp1wire.q.proposal.Proposal` is handed out only after its COMPLETION
validated. An engine's sampler opens a :class:`Request` per slot, asks for a
whole step's proposals with :meth:`AsyncClient.propose_many`, verifies them with
``pp1wire.verify_step`` and commits with :meth:`AsyncClient.commit_round`
(``docs/embedding.md``). Errors: :class:`~pp1wire.errors.UsageError` (local
misuse, nothing sent), :class:`RefusedError` (the worker refused: reopen the
slot), :class:`ConnectionLostError` (reconnect, reopen) and, for one round,
:class:`ProposalUnavailableError` (decode it target-only).
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
from pp1wire.aio.transport import ClientConnection, fail_future, outcome_of, settle
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
        """Prefer :meth:`connect`.

        ``busy_poll`` keeps the event loop spinning while a proposal is awaited,
        trading a busy core for the wake-up latency of an idle one.
        """
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
        for table in (self._opened, self._resets, self._pongs):
            for other in table.values():
                fail_future(other, error)
            table.clear()
        for commit in self._commits.values():
            fail_future(commit, error)
        self._commits.clear()
        self._held.clear()  # every slot is gone; nothing left to give back

    def _lost(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._fail_all(self.failed or ErrorCode.CONNECTION_LOST, "connection lost")
        self._closed.set()

    def _gone(self) -> ConnectionLostError:
        return ConnectionLostError(self.failed or ErrorCode.CONNECTION_LOST, "connection is closed")

    def _require_open(self) -> None:
        if self.core.closed:
            raise self._gone()

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
        """Queue a slot message with ``send`` (a core call; its result is returned) and
        wait until the worker answers it (``waiting`` holds the slot's future).

        Raises:
            UsageError, RefusedError, ConnectionLostError: as the caller documents.
        """
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
        """Whether ``slot`` is open on this live connection and in sync with the worker
        (not refused: a refused slot must be reopened, :meth:`reopen_slot`)."""
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
        """Open ``slot`` with the committed ``prefix`` and request ``seed``; wait for OPENED.

        Returns the slot's generation (``None`` picks the next unused one, no
        lower than ``at_least``: a reopened slot always moves to a higher one).
        :meth:`open_request` also builds the request's verifier.

        Raises:
            UsageError: a bad slot, prefix or generation, or a slot in use (nothing sent).
            RefusedError: the worker refused the OPEN.
            ConnectionLostError: the connection is gone.
        """
        self._require_open()
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
        """Open ``slot`` for a new request and build its verifier (at the slot's next generation).

        ``seed`` keys every draw of the request (both sides'); ``processors``
        are pure ``(prefix, p) -> p`` functions applied to the target's rows;
        ``target`` is only for verifying without the engine's rows (the
        verifier calls it per prefix); ``audit`` recomputes the worker's draws.

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
        """Open ``request``'s slot again on this client, with its committed prefix, at a
        generation above its last (its rounds restart at 0, no key is reused).

        After a :class:`RefusedError` on the slot, or on a new connection after
        :class:`ConnectionLostError`; the request is then on this client.

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
        """The one way a slot is (re)opened for a running request: whatever instance of
        ``slot`` this client holds (refused, desynced, or the request's own) is closed
        first (unless ``close_first`` is False), then OPEN carries ``verifier``'s
        seed, committed prefix, terminal token and context, at ``generation``
        (None: the slot's next, no lower than ``at_least``). Returns the
        generation; ``verifier`` is not changed (the caller moves it:
        :meth:`reopen`, or a group once its ranks agree).

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
        """Ask for one block under ``round_id`` and wait until it is validated whole.

        ``depth`` is the block's maximum; ``stop`` its stop rule
        (``docs/adaptive.md``; a rule other than FIXED needs
        ``SparkConfig.stop_rules``), audited on arrival.

        ``round_id`` comes from the request's own counter
        (:meth:`pp1wire.q.verify.RequestVerifier.take_round`), which also numbers
        its target-only rounds. :meth:`propose_many` does this for a batch.

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
        except LocalStateError as exc:
            if exc.code is ErrorCode.SLOT_DESYNCED:
                raise ProposalUnavailableError(exc.code, exc.detail) from None
            self._local(exc)
        except ProtocolError as exc:
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
        """Send a STEP for every request at once; return when each proposal is whole or failed.

        Each request takes its next round ID for its STEP. The result holds, per
        request in order, its :class:`~pp1wire.q.proposal.Proposal` or the
        :class:`ProposalUnavailableError` saying why it has none (no STEP is
        sent, and no round taken, for a slot the worker refused earlier:
        ``SLOT_DESYNCED``, reopen it; nor on a closed connection:
        ``CONNECTION_LOST``). One slot's failure never raises.

        A proposal may be **cut** (:attr:`Proposal.cut`): a fault ended its block
        before its next row, and it holds the rows before the fault. Verify it
        like any other: its rows are exactly as legitimate (``docs/adaptive.md``
        §7). ``timeout`` (seconds) is the engine's own deadline: when it passes,
        each proposal still in flight is cut at the rows that arrived
        (``REPLY_TIMEOUT``; with none, that error) — never drop a late
        proposal's rows instead, which would choose blocks by how long they took
        to draw (:meth:`cut`).

        Raises:
            UsageError: nothing sent, no round taken: a depth or support out of
                range, a stop rule other than FIXED with no stop-rule set
                negotiated (``BAD_STOP_RULE``), two requests on one slot, a request not open on this
                client (another client, or closed), one that already ended
                (``REQUEST_FINISHED``, ``SESSION_POISONED``), or a proposal
                already in flight on a slot (``SLOT_BUSY``).
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
                late = [r.slot for r, f in zip(requests, out, strict=True)
                        if isinstance(f, asyncio.Future) and not f.done()]
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
        of the rows that arrived, cut by ``code`` (its waiter gets that proposal), or
        fails with ``code`` if no row arrived (``docs/adaptive.md`` §7). Later frames
        of those rounds are dropped as late. A slot with nothing in flight, or
        not open, is left alone; on a closed connection this does nothing.
        """
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
        """Done with ``proposal``'s rows (after verifying): recycle their receive buffers.

        Idempotent (:meth:`Proposal.release` and leaving a ``with proposal:``
        block call this); from another thread it returns once the client's loop
        took the buffers back. A proposal built in this process has nothing to release.

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
        """Queue COMMIT; the returned future resolves on COMMITTED (awaiting it is optional).

        The future fails with :class:`RefusedError` if the worker refuses the
        COMMIT (or ``CANCELLED``: the slot was reset or closed first) and with
        :class:`ConnectionLostError` if the connection dies first.

        Raises:
            UsageError: ``UNKNOWN_SLOT``, or ``COMMIT_INVALID`` if the accepted
                tokens are not the round's drafts (nothing sent).
            RefusedError: ``SLOT_DESYNCED`` until the slot is reopened.
            ConnectionLostError: the connection is gone.
        """
        self._require_open()
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
        """Move ``slot`` to a new generation; returns it once the worker confirms.

        A proposal or COMMITTED still awaited on the slot fails at once with
        ``CANCELLED``: nothing of the old generation can answer any more.

        Raises:
            UsageError: ``UNKNOWN_SLOT``.
            RefusedError: the worker refused the RESET.
            ConnectionLostError: the connection is gone.
        """
        self._require_open()
        if slot in self.core.slots:
            self._cancel(slot, "the slot was reset")
        return await self._answered(
            self._resets, slot, lambda: self.core.reset(slot, time.monotonic())
        )

    async def reset_request(self, request: Request) -> None:
        """:meth:`reset` ``request``'s slot and move its verifier to the new generation
        (same prefix; its rounds restart at 0). Whatever was in flight is discarded.

        Raises:
            UsageError: a request on another client; otherwise as :meth:`reset`.
            RefusedError, ConnectionLostError: as :meth:`reset`.
        """
        self._own(request)
        generation = await self.reset(request.slot)
        request.verifier.rebuild(request.verifier.committed, generation)

    async def close_slot(self, slot: int) -> None:
        """Close ``slot`` (fire and forget: the slot is free locally at once).

        A proposal or COMMITTED still awaited on the slot fails at once with
        ``CANCELLED``; its proposals not yet released are released. Closing a
        slot that is not open, or on a closed connection, does nothing.
        """
        if self.core.closed or slot not in self.core.slots:
            return
        self._cancel(slot, "the slot was closed")
        for key in [k for k in self._held if k[0] == slot]:
            del self._held[key]  # the core gives their buffers back with the slot
        self.core.close_slot(slot, time.monotonic())
        self._flush()

    async def close_request(self, request: Request) -> None:
        """:meth:`close_slot` ``request``'s slot (the request is done with this client).

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


__all__ = [
    "AsyncClient",
    "BufferPool",
    "ConnectionLostError",
    "ProposalBatch",
    "ProposalUnavailableError",
    "RefusedError",
    "Request",
]
