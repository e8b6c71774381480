"""Draw work shared fairly between connections, and bounded per connection (sans-IO).

A worker draws proposals on a pool of a few workers (threads). Served in
arrival order, one peer that keeps every slot drawing (a RESET/STEP loop on all
of them) puts every other peer's draw behind all of its own. Two rules bound
what one connection takes:

* :class:`DrawScheduler` keeps one queue per connection and gives each free
  worker a batch taken from the connections with the fewest draws running,
  the least recently served first among equals (round robin). A connection
  whose draw arrives while others are backlogged waits for the first worker
  that frees up, not for their queues.
* :class:`TokenBucket` limits the fresh draws one connection may ask for
  (``--max-draw-rate`` draws per second, ``--draw-burst`` at once); a STEP
  beyond it is refused with ``DRAW_RATE_LIMITED`` (``docs/protocol.md`` §4.4),
  changing nothing, before anything is drawn.

The scheduler hands out *batches* of up to ``max_batch`` jobs (fairly across
connections) to a :data:`BatchRunner`: :class:`DraftTogether` drafts every
STEP of a batch together, as an engine's step does (one drafter call per
position over all of them, the q rows of the batch built and drawn in one
compiled pass), and :func:`run_each` runs each job on its own.

STEPs that arrive together are drafted together. A Spark side that steps like
an engine sends every slot's COMMIT, then every slot's next STEP, in a burst
that may reach the worker over several reads; dispatching the first STEP at
once would draft the burst as several batches, one after another. So a
connection's slots that were opened, reset or committed since its last
dispatch are *expected* (:meth:`DrawScheduler.expect`), and a free worker
waits for them, at most ``gather`` seconds after the first queued job, before
taking a batch; a slot whose STEP arrives is no longer expected, and a
dispatch stops expecting the rest of its connections' slots (a slot that does
not STEP costs one wait, once). :class:`FailureLog` decides which drafter
failures a shell logs. No clock is read here: callers pass ``now``.
"""

from __future__ import annotations

import functools
import math
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Final, Generic, Protocol, TypeVar

from pp1wire.q.batch import propose_batch
from pp1wire.q.proposal import QRow, batched_drafter, drafter_kind
from pp1wire.wire.replies import FrameParts
from pp1wire.wire.worker_events import DrawJob, DrawResult, Streamer

K = TypeVar("K", bound=Hashable)
J = TypeVar("J")

# Refills add up elapsed time in floating point: a token due exactly now may come
# out a few ulps short of 1.
_EPSILON = 1e-9

BatchRunner = Callable[[list[DrawJob]], list[DrawResult]]
"""Draws a batch of jobs on a pool worker and returns one result per job, in order.

A runner that draws several jobs together hands each job's rows (or the
exception that stopped them) to :meth:`DrawJob.complete`; jobs that are not
``local`` (a sharded group's proposer) it leaves to :meth:`DrawJob.run`. It
should not raise; if it does, every job of the batch is answered as failed
(``INTERNAL``)."""


#: Most STEPs drafted together (one drafter call per position over all of them).
MAX_DRAW_BATCH: Final = 64
#: How long a free draw thread may wait for the STEPs a burst of COMMITs announced.
DRAW_GATHER_S: Final = 0.002
#: Most threads one batch's q rows are built on.
CONSTRUCT_THREADS: Final = 4


def default_runner(
    vocab_size: int, row_entries: int, *, local: bool, batch: int | None
) -> tuple[BatchRunner, int]:
    """The runner and batch size a worker uses unless told otherwise: for ``local``
    draws (an unsharded link's own chain) :class:`DraftTogether`, on up to
    :data:`CONSTRUCT_THREADS` of this process's cores, in batches of ``batch`` (default
    :data:`MAX_DRAW_BATCH`); else :func:`run_each`, one job per batch."""
    if not local:
        return run_each, batch or 1
    threads = max(1, min(CONSTRUCT_THREADS, len(os.sched_getaffinity(0))))
    return DraftTogether(vocab_size, row_entries, threads=threads), batch or MAX_DRAW_BATCH


def run_each(jobs: list[DrawJob]) -> list[DrawResult]:
    """A :data:`BatchRunner` that draws each job on its own, in order."""
    return [job.run() for job in jobs]


class DraftTogether:
    """The worker's engine step as a :data:`BatchRunner`: a batch's :attr:`~DrawJob.local`
    jobs drafted together by :func:`~pp1wire.q.batch.propose_batch`.

    Per position, one call of the drafter's batched form over every job still
    drafting (:func:`~pp1wire.q.proposal.batched_drafter`: the plugin's own
    ``batch``, else one call per prefix; its rows logits or, for a drafter of
    ``kind = "probs"``, probabilities: :func:`~pp1wire.q.proposal.drafter_kind`);
    the q rows of the batch built and drawn in one compiled pass on
    ``threads`` threads (or on the device of a probabilities tensor); with ``row_entries``
    (an unsharded link's dense row length), each dense row written once, as
    its FP32 wire values, and sent from there. Each job's reply is the one
    :meth:`DrawJob.run` gives, byte for byte, with the same proposal draws; a
    drafter call that fails for the batch is asked again prefix by prefix, so
    a failure is its own job's (its status, and the exception a shell logs).
    Each position's rows go to the jobs' streamers as soon as that position
    is drawn (:meth:`DrawJob.row_frame`), one hand-over per streamer. Jobs of
    a :data:`~pp1wire.wire.worker_events.Proposer` run alone.
    """

    def __init__(self, vocab_size: int, row_entries: int | None, *, threads: int = 2) -> None:
        """Draft over ``vocab_size`` tokens; see the class for ``row_entries`` and ``threads``.

        Raises:
            ValueError: for ``vocab_size`` or ``threads`` below 1, or ``row_entries``
                below ``vocab_size``.
        """
        if vocab_size < 1 or threads < 1:
            raise ValueError("vocab_size and threads must be at least 1")
        if row_entries is not None and row_entries < vocab_size:
            raise ValueError(f"row_entries {row_entries} below the vocabulary {vocab_size}")
        self.vocab_size = vocab_size
        self.row_entries = row_entries
        self.threads = threads

    def __call__(self, jobs: list[DrawJob]) -> list[DrawResult]:
        """One result per job, in order (never raises for a job's failure)."""
        results: list[DrawResult | None] = [None] * len(jobs)
        by_drafter: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            if job.local:
                by_drafter.setdefault(id(job.drafter), []).append(i)
        for indices in by_drafter.values():
            started = time.perf_counter()
            plugin = jobs[indices[0]].drafter
            try:
                kind = drafter_kind(plugin)
            except ValueError:  # left to each job alone, which answers (and logs) it
                continue
            mine = [jobs[i] for i in indices]
            drawn = propose_batch(
                batched_drafter(plugin),
                [job.draft_job() for job in mine],
                self.vocab_size,
                threads=self.threads,
                row_entries=self.row_entries,
                kind=kind,
                on_position=functools.partial(_stream_position, mine),
            )
            for i, rows in zip(indices, drawn, strict=True):
                results[i] = jobs[i].complete(rows, started=started)
        return [jobs[i].run() if r is None else r for i, r in enumerate(results)]


def _stream_position(jobs: list[DrawJob], position: int, rows: list[tuple[int, QRow]]) -> None:
    """One position's rows, framed and handed to their jobs' streamers, one call each."""
    out: dict[int, tuple[Streamer, list[tuple[DrawJob, FrameParts]]]] = {}
    for at, row in rows:
        job = jobs[at]
        try:
            frame = job.row_frame(position, row)
        except Exception:  # framed again at completion, which ends the block there
            frame = None
        if frame is not None and job.streamer is not None:
            out.setdefault(id(job.streamer), (job.streamer, []))[1].append((job, frame))
    for streamer, frames in out.values():
        streamer.send(frames)


class DrawScheduler(Generic[K, J]):
    """Per-connection draw queues served fairly by ``workers`` pool workers.

    ``K`` names a connection, ``J`` is a job. Jobs of one connection are handed
    out in the order they were submitted.
    """

    def __init__(self, workers: int, *, max_batch: int = 1, gather: float = 0.0) -> None:
        """Serve with ``workers`` (>= 1) workers, ``max_batch`` (>= 1) jobs per batch,
        waiting up to ``gather`` (>= 0) seconds for expected jobs (0: never).

        Raises:
            ValueError: for a count below 1 or a negative or non-finite ``gather``.
        """
        if workers < 1 or max_batch < 1:
            raise ValueError("a draw scheduler needs at least one worker and one job per batch")
        if not (math.isfinite(gather) and gather >= 0):
            raise ValueError("a draw scheduler's gather time must be finite and at least 0")
        self.workers = workers
        self.max_batch = max_batch
        self.gather = gather
        # Per connection: (time queued, job), in submission order.
        self._queues: dict[K, deque[tuple[float, J]]] = {}
        self._running: dict[K, int] = {}
        self._served_at: dict[K, int] = {}
        self._expected: dict[K, set[Hashable]] = {}
        self._turn = 0
        self.busy = 0  # workers holding a batch
        self.queued = 0  # jobs waiting

    def submit(self, key: K, job: J, *, now: float = 0.0, tag: Hashable = None) -> None:
        """Queue ``job`` for connection ``key`` at time ``now``; the job named ``tag``
        (a slot) is no longer expected."""
        self._queues.setdefault(key, deque()).append((now, job))
        self.queued += 1
        if tag is not None:
            self.unexpect(key, tag)

    def expect(self, key: K, tag: Hashable) -> None:
        """Connection ``key`` is expected to submit a job named ``tag`` soon."""
        self._expected.setdefault(key, set()).add(tag)

    def unexpect(self, key: K, tag: Hashable) -> None:
        """The job named ``tag`` is no longer expected (it came, or its slot closed)."""
        tags = self._expected.get(key)
        if tags is not None:
            tags.discard(tag)
            if not tags:
                del self._expected[key]

    def drop(self, key: K) -> list[J]:
        """Connection ``key`` is gone: its queued jobs, removed (running ones finish)."""
        jobs = [job for _, job in self._queues.pop(key, ())]
        self.queued -= len(jobs)
        self._expected.pop(key, None)
        if not self._running.get(key):
            self._served_at.pop(key, None)
        return jobs

    def hold_until(self) -> float | None:
        """While a free worker waits for expected jobs: the time it stops waiting
        (``gather`` after the oldest queued job); else None."""
        if (
            self.gather <= 0
            or self.busy >= self.workers
            or self.queued >= self.max_batch
            or not any(k in self._expected for k in self._queues)
        ):
            return None
        return min(q[0][0] for q in self._queues.values()) + self.gather

    def running(self, key: K) -> int:
        """Jobs of ``key`` handed out and not yet finished."""
        return self._running.get(key, 0)

    def next_batch(self, now: float = math.inf) -> list[tuple[K, J]]:
        """A batch for a free worker, now marked busy, or [] (no free worker, no job,
        or, at time ``now``, still waiting for expected jobs: :meth:`hold_until`).

        Each job of the batch goes to the queued connection with the fewest jobs
        running (this batch's included); ties go to the one served longest ago.
        The connections of the batch expect nothing more.
        """
        if self.busy >= self.workers or not self._queues:
            return []
        until = self.hold_until()
        if until is not None and now < until:
            return []
        batch: list[tuple[K, J]] = []
        while self._queues and len(batch) < self.max_batch:
            key = min(
                self._queues,
                key=lambda k: (self._running.get(k, 0), self._served_at.get(k, -1)),
            )
            queue = self._queues[key]
            batch.append((key, queue.popleft()[1]))
            self._expected.pop(key, None)
            if not queue:
                del self._queues[key]
            self.queued -= 1
            self._running[key] = self._running.get(key, 0) + 1
            self._turn += 1
            self._served_at[key] = self._turn
        self.busy += 1
        return batch

    def finished(self, batch: Sequence[tuple[K, J]]) -> None:
        """A worker is done with ``batch`` (from :meth:`next_batch`) and free again."""
        self.busy -= 1
        for key, _ in batch:
            left = self._running[key] - 1
            if left:
                self._running[key] = left
            else:
                del self._running[key]
                if key not in self._queues:
                    self._served_at.pop(key, None)


class TokenBucket:
    """At most ``burst`` draws at once and ``rate`` per second on average.

    Full at creation. The clock is the caller's (monotonic seconds).
    """

    __slots__ = ("_stamp", "_tokens", "burst", "rate")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        """A full bucket at time ``now``.

        Raises:
            ValueError: unless ``rate`` is finite and above 0 and ``burst`` >= 1.
        """
        if not (math.isfinite(rate) and rate > 0) or burst < 1:
            raise ValueError("a draw budget needs a finite rate above 0 and a burst of at least 1")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._stamp = now

    def _refill(self, now: float) -> None:
        if now > self._stamp:
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now

    def take(self, now: float) -> bool:
        """Spend one draw at ``now`` if the budget has one; False (nothing spent) if not."""
        self._refill(now)
        if self._tokens >= 1.0 - _EPSILON:
            self._tokens = max(0.0, self._tokens - 1.0)
            return True
        return False

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`take` would succeed (0 if it would now)."""
        self._refill(now)
        return 0.0 if self._tokens >= 1.0 - _EPSILON else (1.0 - self._tokens) / self.rate


class AbandonBudget:
    """Fresh draws one connection may leave uncommitted, and how fast it earns more.

    A draw is *abandoned* when the slot it was drawn for is reset or closed
    before any COMMIT of that round or a later one (``docs/protocol.md`` §4.4):
    the RESET/STEP loop that makes a worker draw without bound, since every
    RESET opens a new generation. A Spark side commits every round it asks for,
    so it abandons only what a reconnect or a shutdown cuts. At most ``burst``
    abandons are free, then ``rate`` per second; a connection beyond that owes
    them, and its fresh STEPs are refused (``DRAW_RATE_LIMITED``) until it has
    paid them back. The clock is the caller's.
    """

    __slots__ = ("_bucket", "_owed")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        """A full budget at ``now``.

        Raises:
            ValueError: as :class:`TokenBucket`.
        """
        self._bucket = TokenBucket(rate, burst, now)
        self._owed = 0

    def abandoned(self, now: float) -> None:
        """One more draw left uncommitted at ``now``."""
        if not self._bucket.take(now):
            self._owed += 1

    def allows(self, now: float) -> bool:
        """Whether a fresh draw may start at ``now`` (pays back what it can first)."""
        while self._owed and self._bucket.take(now):
            self._owed -= 1
        return not self._owed

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`allows` would be true (0 if it is now)."""
        if not self.allows(now):
            # What is owed after this payment comes in at the bucket's rate.
            return self._bucket.wait(now) + (self._owed - 1) / self._bucket.rate
        return 0.0


class DrawBudget:
    """Both of one connection's draw budgets (``docs/protocol.md`` §4.4): fresh draws
    per second (``max_draw_rate``, off unless set) and draws left uncommitted
    (:class:`AbandonBudget`, ``abandon_rate``). A fresh STEP either budget refuses
    is answered ``DRAW_RATE_LIMITED``."""

    __slots__ = ("_abandons", "_rate")

    def __init__(self, config: DrawLimits, now: float) -> None:
        """Full budgets at ``now`` for ``config``'s limits (None: that budget is off)."""
        rate, abandon = config.max_draw_rate, config.abandon_rate
        self._rate = None if rate is None else TokenBucket(rate, config.draw_burst, now)
        self._abandons = (
            None if abandon is None else AbandonBudget(abandon, config.abandon_burst, now)
        )

    def allows_fresh(self, now: float) -> bool:
        """Whether a fresh draw may start at ``now``; spends from the rate budget if so."""
        if self._abandons is not None and not self._abandons.allows(now):
            return False
        return self._rate is None or self._rate.take(now)

    def abandoned(self, now: float) -> None:
        """A fresh draw died uncommitted at ``now``."""
        if self._abandons is not None:
            self._abandons.abandoned(now)

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until a fresh draw would be allowed (0 if it is now);
        spends nothing."""
        abandons = 0.0 if self._abandons is None else self._abandons.wait(now)
        rate = 0.0 if self._rate is None else self._rate.wait(now)
        return max(abandons, rate)


class DrawLimits(Protocol):
    """The draw limits of a worker's configuration (``WorkerConfig``)."""

    @property
    def max_draw_rate(self) -> float | None:
        """Fresh draws per second per connection (None: no limit)."""

    @property
    def draw_burst(self) -> int:
        """Fresh draws at once."""

    @property
    def abandon_rate(self) -> float | None:
        """Uncommitted draws per second per connection (None: no limit)."""

    @property
    def abandon_burst(self) -> int:
        """Uncommitted draws at once."""


#: Each distinct drafter failure is logged with its traceback once, then at most
#: once per this many seconds (with the count since).
FAILURE_LOG_EVERY_S: Final = 60.0
#: Distinct drafter failures remembered; beyond them, one rate-limited line for the rest.
FAILURE_KINDS: Final = 64


class FailureLog:
    """When to log a drafter failure: a new kind at once, a known one at most every ``every`` s.

    A kind is the exception's class, message and the line that raised it. The
    clock is passed in. At most :data:`FAILURE_KINDS` kinds are remembered; any
    other is counted under one shared kind.
    """

    def __init__(self, every: float = FAILURE_LOG_EVERY_S, kinds: int = FAILURE_KINDS) -> None:
        """Log each kind at most once per ``every`` seconds, remembering ``kinds`` kinds."""
        self.every = every
        self.kinds = kinds
        # kind -> (when last logged, failures since then not logged)
        self._seen: dict[tuple[str, ...], tuple[float, int]] = {}

    @staticmethod
    def kind(error: BaseException) -> tuple[str, ...]:
        """What makes two failures the same: class, message and the raising line."""
        frames = traceback.extract_tb(error.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        return (type(error).__qualname__, str(error)[:200], where)

    def note(self, error: BaseException, now: float) -> tuple[bool, bool, int]:
        """Record a failure at ``now``: (log it?, first of its kind?, failures not logged since)."""
        key = self.kind(error)
        if key not in self._seen and len(self._seen) >= self.kinds:
            key = ("other",)
        last = self._seen.get(key)
        if last is None:
            self._seen[key] = (now, 0)
            return True, key != ("other",), 0
        logged_at, skipped = last
        if now - logged_at >= self.every:
            self._seen[key] = (now, 0)
            return True, False, skipped
        self._seen[key] = (logged_at, skipped + 1)
        return False, False, skipped + 1
