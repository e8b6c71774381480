"""A rank of a vocabulary-sharded worker group: STEPs matched per group session, drawn together.

Held STEPs are matched by key across the ranks in fixed-size exchanges, drawn position by
position with the sharded kernels and answered on finishing threads (``docs/tp.md`` §11).
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error
from pp1wire.q.layout import as_int64
from pp1wire.q.proposal import (
    MAX_DEPTH,
    DrafterFn,
    ExtendedPrefix,
    QRow,
    _host,
    batched_drafter,
    drafter_kind,
    stopped_by,
)
from pp1wire.q.rng import Domain, Role, RoundStreams
from pp1wire.q.stoprules import StopKind, StopRule, admits_next
from pp1wire.tp import dist_ops
from pp1wire.tp.coordinator import GroupCoordinator
from pp1wire.wire.draws import stream_position
from pp1wire.wire.messages import Step
from pp1wire.wire.worker_events import DrawJob, DrawResult

log = logging.getLogger("pp1wire.worker.group")

Key = tuple[int, ...]
AfterDraw = Callable[[int, int, tuple[QRow, ...]], tuple[QRow, ...]]
"""Testing hook ``(rank, draw, (row,)) -> (row,)`` on each STEP's first row before it is
sent (``draw``: the STEP's 1-based count among those drawn), on its finishing thread: it
may alter the row, sleep, raise (the STEP answers with the error) or end the process."""
Done = Callable[[DrawResult], None]
"""Where a STEP's result goes (called on a finishing thread)."""
_Ended = tuple["_Chain", tuple[QRow, ...] | BaseException]
"""A matched STEP whose block ended, and its rows (or the failure that ended it)."""

# A key's row in an exchange: the nonce's two words, the STEP's nine, the terminal token,
# the stop rule, then 1 (2: a live link's nonce instead; row 0: key count, stopping).
_KEY_WORDS = 14


def nonce_words(group: bytes) -> tuple[int, int]:
    """A group nonce as two int64 words."""
    nonce = group.ljust(16, b"\0")
    return (
        int.from_bytes(nonce[:8], "little", signed=True),
        int.from_bytes(nonce[8:16], "little", signed=True),
    )


def key_of(group: bytes, step: Step, eos: int | None) -> Key:
    """The int64 words that name one STEP of one group session on every link."""
    (temperature,) = struct.unpack("<q", struct.pack("<d", step.temperature))
    return (
        *nonce_words(group),
        step.slot,
        step.generation,
        step.round,
        step.position,
        as_int64(step.digest),
        step.depth,
        step.support,
        temperature,
        as_int64(step.context),
        -1 if eos is None else eos,
        # The rule decides the block's length: STEPs under different rules never match.
        (step.stop << 32) | step.threshold,
    )


@dataclass
class _Held:
    """A STEP held by this rank until its group matches it (or the match timeout)."""

    link: Hashable
    key: Key
    job: DrawJob
    done: Done
    since: float = field(default_factory=time.monotonic)


class _Chain:
    """One matched STEP while the group draws it."""

    __slots__ = (
        "context", "draw", "drawn", "first", "held", "lane", "rows", "rule", "streams",
    )  # fmt: skip

    def __init__(self, held: _Held, streams: RoundStreams | None, lane: int) -> None:
        self.held = held
        self.streams = streams
        self.lane = lane  # the finishing thread that sends its reply, in order
        self.draw = 0  # its count among the STEPs the group drew a row of (0: none yet)
        # What the fault hook made of its first row (set on its finishing thread).
        self.first: QRow | BaseException | None = None
        self.context = ExtendedPrefix(held.job.prefix)
        self.rows: list[QRow] = []
        self.drawn: list[int] = []  # each row's count at its token, known to every rank
        step = held.job.step
        self.rule = StopRule(StopKind(step.stop), step.threshold)  # checked on acceptance


class ShardedDrafting:
    """This rank's share of the worker group's draws (the server's group hook)."""

    def __init__(
        self,
        coord: GroupCoordinator,
        drafter: DrafterFn,
        *,
        match_timeout: float = 5.0,
        beat: float = 0.25,
        tick: float = 0.002,
        linger: float = 0.002,
        width: int = 64,
        after_draw: AfterDraw | None = None,
        finish_threads: int = 4,
    ) -> None:
        """This rank's drafting over ``coord`` (with a layout); :meth:`start` it once the
        server listens. ``beat``: the longest time without an exchange; ``tick``: the
        shortest between exchanges while a STEP is held by only some ranks; ``linger``:
        how long a new STEP waits for its burst (at most four times that); ``width``:
        the keys per exchange; ``finish_threads``: the threads that send the replies.

        Raises:
            ValueError: if the coordinator has no vocabulary layout, a time is not
                positive or a count is below 1.
        """
        if coord.layout is None:
            raise ValueError("a sharded worker group needs a vocabulary layout")
        if not (match_timeout > 0 and beat > 0 and tick > 0 and linger >= 0):
            raise ValueError("the group's times must be positive")
        if finish_threads < 1 or width < 1:
            raise ValueError("a group needs one finishing thread and one key per exchange")
        self.coord = coord
        self.rank = coord.rank
        self.lo, self.hi = coord.layout.range(self.rank)
        self.vocab = coord.layout.vocab_size
        self.draft_batch = batched_drafter(drafter)
        self.probs = drafter_kind(drafter) == "probs"
        self.match_timeout = match_timeout
        self.beat = beat
        self.tick = tick
        self.linger = linger
        self.width = width
        self.after_draw = after_draw
        self.broken: str | None = None
        self.draws = 0  # STEPs the group drew a row of (the same count on every rank)
        self._groups: dict[bytes, Hashable] = {}  # group nonce -> this rank's live link
        self._links: dict[Hashable, bytes] = {}
        # Group nonce -> when its link here left: no other link takes its place while the
        # session lives on (docs/protocol.md §6.7).
        self._closed: dict[bytes, float] = {}
        self._held: dict[Key, _Held] = {}  # in arrival order
        # Nonce words -> whether every rank had a live link for it at the last exchange.
        self._matchable: dict[tuple[int, int], bool] = {}
        self._fresh = False  # a STEP arrived since the last exchange
        self._burst = 0.0  # when the first of them arrived
        self._arrived = 0.0  # when the last of them arrived
        self._stopping = False
        self._ended = False  # the group thread has left
        self._cond = threading.Condition()
        # One thread per lane keeps each STEP's frames in order: its rows, then COMPLETION.
        self._lanes = [
            ThreadPoolExecutor(1, thread_name_prefix=f"pp1-group-reply-{i}")
            for i in range(finish_threads)
        ]
        self._turns = itertools.count()  # round-robin over the lanes
        self._thread = threading.Thread(target=self._run, name="pp1-worker-group", daemon=True)

    def start(self) -> None:
        """Start the group thread."""
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the group thread is still alive (e.g. waiting in a collective)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the draw in progress (every rank stops at the same exchange)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=self.coord.timeout + self.beat + 1.0)
        for lane in self._lanes:
            lane.shutdown(wait=False)

    # -- the server's hook ---------------------------------------------------------------

    def join(self, link: Hashable, group: bytes) -> bool:
        """``link`` completed its handshake with ``group``'s nonce: False (refuse it,
        ``GROUP_IN_USE``) if another live link here serves that session, or one left
        while it lives on (until no rank has a live link of it and ``match_timeout``
        passed): without a key the nonce is a bearer secret."""
        with self._cond:
            holder = self._groups.get(group)
            if (holder is not None and holder is not link) or group in self._closed:
                return False
            self._groups[group] = link
            self._links[link] = group
            return True

    def leave(self, link: Hashable) -> None:
        """``link`` is gone: its held STEPs are dropped, unanswered (nobody is listening)."""
        with self._cond:
            group = self._links.pop(link, None)
            if group is not None and self._groups.get(group) is link:
                del self._groups[group]
                self._matchable.pop(nonce_words(group), None)
                self._closed[group] = time.monotonic()
            for key in [k for k, h in self._held.items() if h.link is link]:
                del self._held[key]

    def submit(self, link: Hashable, job: DrawJob, done: Done) -> None:
        """Hold ``job`` (an accepted STEP of ``link``) until its group matches it; ``done``
        gets its result on a finishing thread (``GROUP_UNMATCHED`` after the match
        timeout, ``INTERNAL`` from a broken group)."""
        with self._cond:
            group = self._links.get(link)
            key = None if group is None else key_of(group, job.step, job.eos)
            refusal: Pp1Error | None = None
            if self.broken is not None or self._ended or self._stopping:
                refusal = Pp1Error(ErrorCode.INTERNAL, f"worker group down: {self.broken}")
            elif key is None or key in self._held:
                refusal = Pp1Error(ErrorCode.INTERNAL, "this link cannot draw with the group")
            else:
                held = _Held(link, key, job, done)
                self._held[key] = held
                if not self._fresh:
                    self._fresh, self._burst = True, held.since
                self._arrived = held.since
                self._cond.notify_all()
                return
        self._answer(_Held(link, (), job, done), refusal)

    # -- answering (finishing threads) -------------------------------------------------

    def _lane(self) -> int:
        return next(self._turns) % len(self._lanes)

    def _post(self, lane: int, task: Callable[..., None], *args: Any) -> None:
        try:
            self._lanes[lane].submit(task, *args)
        except RuntimeError:  # shut down: done on this thread
            task(*args)

    def _answer(self, held: _Held, outcome: BaseException) -> None:
        """Answer a STEP the group did not draw (unmatched, refused, a broken group)."""
        self._post(self._lane(), self._complete, held, outcome)

    @staticmethod
    def _complete(held: _Held, outcome: tuple[QRow, ...] | BaseException) -> None:
        held.done(held.job.complete(outcome))

    # -- the group thread -----------------------------------------------------------------

    def _run(self) -> None:
        last = time.monotonic()
        wait = self.beat  # until the next exchange, unless a STEP arrives
        try:
            while True:
                snapshot, stop = self._next_turn(last, wait)
                matched, stopping, everywhere = self._exchange(snapshot, stop)
                last = time.monotonic()
                if stopping:
                    return
                wait = self._backoff(snapshot, matched, everywhere, last)
                if matched:
                    self._chains(matched, self._sent)
        except Exception as exc:  # a dead rank or a timed-out collective: fail closed
            self.broken = repr(exc)
            log.error("worker group broken", extra={"error": self.broken})
        finally:
            with self._cond:
                self._ended = True
            self._fail_all(self.broken or "stopped")

    def _next_turn(self, last: float, wait: float) -> tuple[list[_Held], bool]:
        """Wait for a burst, a stop or the next exchange, answering expired STEPs; then the
        held STEPs (arrival order) and the stop flag."""
        expired: list[_Held] = []
        with self._cond:
            while True:
                now = time.monotonic()
                old = [k for k, h in self._held.items() if now - h.since >= self.match_timeout]
                expired += [self._held.pop(k) for k in old]
                if self._stopping or now >= last + wait:
                    break
                if self._fresh:
                    # A Spark group sends a step's STEPs together: give the rest of the
                    # burst a moment, so that they are matched and drawn as one batch.
                    quiet = self._arrived + self.linger - now
                    if quiet <= 0 or now >= self._burst + 4 * self.linger:
                        break
                    self._cond.wait(quiet)
                    continue
                oldest = min((h.since for h in self._held.values()), default=now)
                until = min(last + wait, oldest + self.match_timeout)
                self._cond.wait(max(0.0, until - now))
            self._fresh = False
            snapshot, stop = list(self._held.values()), self._stopping
        why = f"no matching STEP on every link within {self.match_timeout:g} s"
        for held in expired:
            self._answer(held, Pp1Error(ErrorCode.GROUP_UNMATCHED, why))
        return snapshot, stop

    def _window(self, snapshot: list[_Held]) -> tuple[list[_Held], list[tuple[int, int]]]:
        """The keys and nonces this rank sends in the next exchange (``docs/tp.md`` §11)."""
        sessions: dict[tuple[int, int], list[_Held]] = {}
        for held in snapshot:  # arrival order: each session's list is oldest first
            sessions.setdefault((held.key[0], held.key[1]), []).append(held)
        queues = [q for n, q in sessions.items() if self._matchable.get(n, True)]
        window: list[_Held] = []
        depth = 0
        while len(window) < self.width and queues:
            queues = [q for q in queues if depth < len(q)]
            for q in queues[: self.width - len(window)]:
                window.append(q[depth])
            depth += 1
        live = [nonce_words(g) for g in self._groups]
        nonces = list(sessions) + [n for n in live if n not in sessions]
        return window, nonces[: self.width]

    def _exchange(
        self, snapshot: list[_Held], stop: bool
    ) -> tuple[list[_Held], bool, set[tuple[int, ...]]]:
        """One all-gather of the windows: the STEPs every rank sent (rank 0's order, now
        taken), whether any rank stops, and the nonces every rank has a live link for."""
        width = self.width
        words = np.zeros((1 + 2 * width, _KEY_WORDS), dtype=np.int64)
        with self._cond:
            sent, nonces = self._window(snapshot)
            taken = {id(h) for h in sent}
            if any(  # a key that can match but did not fit goes in the next exchange, at once
                id(h) not in taken and self._matchable.get((h.key[0], h.key[1]), True)
                for h in snapshot
            ):
                self._fresh = True
        words[0, 0], words[0, 1] = len(sent), int(stop)
        for i, held in enumerate(sent, start=1):
            words[i, :-1] = held.key
            words[i, -1] = 1
        for i, nonce in enumerate(nonces, start=1 + width):
            words[i, :2] = nonce
            words[i, -1] = 2
        gathered = self.coord.all_gather(torch.from_numpy(words)).tolist()
        if any(rank[0][1] for rank in gathered):
            return [], True, set()
        keys = [{tuple(row[:-1]) for row in rank[1:] if row[-1] == 1} for rank in gathered]
        links = [{tuple(row[:2]) for row in rank[1:] if row[-1] == 2} for rank in gathered]
        everywhere = set.intersection(*links)
        ordered = [tuple(row[:-1]) for row in gathered[0][1:] if row[-1] == 1]
        ordered = [k for k in ordered if all(k in s for s in keys[1:])]
        mine = {h.key: h for h in sent}
        matched = [mine[k] for k in ordered]
        with self._cond:
            for held in matched:
                if self._held.get(held.key) is held:
                    del self._held[held.key]
            live = {nonce_words(g) for g in self._groups}
            for nonce in nonces:
                if nonce in live:
                    self._matchable[nonce] = nonce in everywhere
            anywhere = set.union(*links)
            now = time.monotonic()
            self._closed = {
                g: since
                for g, since in self._closed.items()
                if now - since < self.match_timeout or nonce_words(g) in anywhere
            }
        return matched, False, everywhere

    def _backoff(
        self,
        snapshot: list[_Held],
        matched: list[_Held],
        everywhere: set[tuple[int, ...]],
        now: float,
    ) -> float:
        """Until the next exchange: soon while a young STEP here waits for the other ranks'
        copies (which do not wake this rank), backing off as it ages; else a beat."""
        taken = {id(h) for h in matched}
        ages = [now - h.since for h in snapshot if id(h) not in taken and h.key[:2] in everywhere]
        if not ages:
            return self.beat
        return min(self.beat, max(self.tick, min(ages) / 4))

    def _fail_all(self, why: str) -> None:
        with self._cond:
            held = list(self._held.values())
            self._held.clear()
        for h in held:
            self._answer(h, Pp1Error(ErrorCode.INTERNAL, f"worker group down: {why}"))

    # -- the matched STEPs, drawn together on every rank -------------------------------------

    def _sent(self, position: int, drawn: list[_Chain], ended: list[_Ended]) -> None:
        """Hand a position's rows and the replies that ended there to the finishing threads."""
        lanes: dict[int, tuple[list[tuple[_Chain, QRow]], list[_Ended]]] = {}
        for c in drawn:
            if position == 0:
                self.draws += 1
                c.draw = self.draws
            lanes.setdefault(c.lane, ([], []))[0].append((c, c.rows[position]))
        for c, outcome in ended:
            with self._cond:
                live = c.held.link in self._links
            if live:  # a closed link's STEP was drawn with the group, its reply is dropped
                lanes.setdefault(c.lane, ([], []))[1].append((c, outcome))
        for lane, (rows, done) in lanes.items():
            self._post(lane, self._send, position, rows, done)

    def _send(self, position: int, rows: list[tuple[_Chain, QRow]], ended: list[_Ended]) -> None:
        """One lane's share of a position: its rows streamed, then the COMPLETIONs."""
        jobs: list[DrawJob] = []
        out: list[tuple[int, QRow]] = []
        for c, drawn in rows:
            if isinstance(c.first, BaseException):
                continue  # the hook failed its first row (earlier on this thread): none sent
            row = drawn
            if position == 0 and self.after_draw is not None:
                try:
                    row = c.first = self.after_draw(self.rank, c.draw, (drawn,))[0]
                except Exception as exc:  # a fault hook's failure answers this STEP only
                    c.first = exc
                    continue  # its later rows are not framed: the block ends before row 0
            out.append((len(jobs), row))
            jobs.append(c.held.job)
        stream_position(jobs, position, out)
        for c, outcome in ended:
            first = c.first
            reply = outcome
            if isinstance(first, BaseException):
                reply = first
            elif first is not None and isinstance(outcome, tuple):
                reply = (first, *outcome[1:])
            self._complete(c.held, reply)

    def _chains(
        self, matched: list[_Held], on_position: Callable[[int, list[_Chain], list[_Ended]], None]
    ) -> None:
        """Draw every matched STEP's block, a position at a time for all; each position's
        drawn chains and ended ones (rows or failure) go to ``on_position`` (refused at 0)."""
        chains: list[_Chain] = []
        ended: list[_Ended] = []
        for held in matched:
            step = held.job.step
            chain = _Chain(held, None, self._lane())
            if not 1 <= step.depth <= MAX_DEPTH:
                refused = ConstructionError(ErrorCode.BAD_SHAPE, f"depth {step.depth} outside 1..5")
                ended.append((chain, refused))
                continue
            if self.rank == 0:  # only rank 0 holds the proposal randomness; the others learn it
                job = held.job
                chain.streams = RoundStreams(Role.WORKER, job.seed, step.generation, step.round)
            chains.append(chain)
        if ended:
            on_position(0, [], ended)
        for i in range(MAX_DEPTH):
            if not chains:
                break
            logits, codes, errors = self._logits([c.context for c in chains])
            specs = [self._spec(c, i, code) for c, code in zip(chains, codes, strict=True)]
            built = dist_ops.construct_rows(logits, specs, self.coord, probs=self.probs)
            going: list[_Chain] = []
            drawn: list[_Chain] = []
            ended = []
            for c, got, error in zip(chains, built, errors, strict=True):
                if isinstance(got, Pp1Error):
                    # This rank's own drafter failure keeps its exception, for the log.
                    mine = error is not None and got.code is ErrorCode.INTERNAL
                    failure = error if mine and error is not None else got
                    # The rows drawn before the failure are shipped (every rank
                    # learns the failure from the same collective, at the same row).
                    ended.append((c, stopped_by(failure, c.rows)))
                    continue
                c.rows.append(QRow(token=got.token, counts=got.counts, ids=got.ids))
                c.context.append(got.token)
                c.drawn.append(got.count)
                step, eos = c.held.job.step, c.held.job.eos
                # Every rank learned each row's count at its token with the token, so
                # every rank stops each block at the same row (docs/adaptive.md).
                try:
                    more = admits_next(c.rule, step.depth, c.drawn, c.context.tail, eos)
                except ValueError as exc:  # a count outside 0..2**24: never from the kernels
                    c.rows.pop()  # not sent: the block ends before it
                    ended.append((c, stopped_by(Pp1Error(ErrorCode.INTERNAL, str(exc)), c.rows)))
                    continue
                drawn.append(c)
                if more:
                    going.append(c)
                else:
                    ended.append((c, tuple(c.rows)))
            on_position(i, drawn, ended)
            chains = going

    def _spec(self, chain: _Chain, i: int, drafter_code: int) -> dist_ops.RowSpec:
        step = chain.held.job.step
        u24, draw_code = 0, 0
        if chain.streams is not None:
            try:
                u24 = chain.streams.u24(Domain.PROPOSAL, step.position + i)
            except Pp1Error as exc:
                draw_code = int(exc.code)
        return dist_ops.RowSpec(step.temperature, step.support, u24, draw_code, drafter_code)

    def _logits(
        self, contexts: Sequence[Sequence[int]]
    ) -> tuple[npt.NDArray[np.floating], list[int], list[BaseException | None]]:
        """This rank's range of the drafter's rows (one call), each row's code and exception."""
        n = len(contexts)
        dtype = np.float32 if self.probs else np.float64
        local = np.zeros((n, self.hi - self.lo), dtype=dtype)
        codes = [0] * n
        errors: list[BaseException | None] = [None] * n
        try:
            got: Any = _host(self.draft_batch(contexts))
            if isinstance(got, np.ndarray):
                if got.shape != (n, self.vocab):
                    raise ConstructionError(
                        ErrorCode.BAD_SHAPE, f"drafter gave logits of shape {got.shape}"
                    )
                if got.dtype == dtype:  # the range of each row, viewed where it lies
                    view: npt.NDArray[np.floating] = got[:, self.lo : self.hi]
                    return view, codes, errors
                with np.errstate(over="ignore"):  # beyond FP32: infinite, and refused
                    local[:] = got[:, self.lo : self.hi]
                return local, codes, errors
            if len(got) != n:
                raise ConstructionError(
                    ErrorCode.BAD_SHAPE, f"drafter gave {len(got)} rows for {n} prefixes"
                )
        except Pp1Error as exc:
            return local, [int(exc.code)] * n, errors
        except Exception as exc:  # a plugin failure fails its rows, not the group
            return local, [int(ErrorCode.INTERNAL)] * n, [exc] * n
        for j, item in enumerate(got):
            try:
                with np.errstate(over="ignore"):
                    row = np.asarray(_host(item), dtype=dtype)
            except Exception as exc:  # a plugin's odd row
                codes[j], errors[j] = int(ErrorCode.INTERNAL), exc
                continue
            if row.shape != (self.vocab,):
                codes[j] = int(ErrorCode.BAD_SHAPE)
                continue
            local[j] = row[self.lo : self.hi]
        return local, codes, errors


__all__ = ["AfterDraw", "Done", "ShardedDrafting", "key_of", "nonce_words"]
