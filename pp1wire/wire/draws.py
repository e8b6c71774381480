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
connections) to a :data:`BatchRunner`, so a runner that drafts many STEPs with
one drafter call per position can be plugged in; :func:`run_each` runs each
job on its own. :class:`FailureLog` decides which drafter failures a shell
logs. No clock is read here: callers pass ``now``.
"""

from __future__ import annotations

import math
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Final, Generic, TypeVar

from pp1wire.wire.worker_events import DrawJob, DrawResult

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


def run_each(jobs: list[DrawJob]) -> list[DrawResult]:
    """The default :data:`BatchRunner`: each job drawn on its own, in order."""
    return [job.run() for job in jobs]


class DrawScheduler(Generic[K, J]):
    """Per-connection draw queues served fairly by ``workers`` pool workers.

    ``K`` names a connection, ``J`` is a job. Jobs of one connection are handed
    out in the order they were submitted.
    """

    def __init__(self, workers: int, *, max_batch: int = 1) -> None:
        """Serve with ``workers`` (>= 1) workers, ``max_batch`` (>= 1) jobs per batch.

        Raises:
            ValueError: for a count below 1.
        """
        if workers < 1 or max_batch < 1:
            raise ValueError("a draw scheduler needs at least one worker and one job per batch")
        self.workers = workers
        self.max_batch = max_batch
        self._queues: dict[K, deque[J]] = {}
        self._running: dict[K, int] = {}
        self._served_at: dict[K, int] = {}
        self._turn = 0
        self.busy = 0  # workers holding a batch
        self.queued = 0  # jobs waiting

    def submit(self, key: K, job: J) -> None:
        """Queue ``job`` for connection ``key``."""
        self._queues.setdefault(key, deque()).append(job)
        self.queued += 1

    def drop(self, key: K) -> list[J]:
        """Connection ``key`` is gone: its queued jobs, removed (running ones finish)."""
        jobs = list(self._queues.pop(key, ()))
        self.queued -= len(jobs)
        if not self._running.get(key):
            self._served_at.pop(key, None)
        return jobs

    def running(self, key: K) -> int:
        """Jobs of ``key`` handed out and not yet finished."""
        return self._running.get(key, 0)

    def next_batch(self) -> list[tuple[K, J]]:
        """A batch for a free worker, now marked busy, or [] (no free worker or no job).

        Each job of the batch goes to the queued connection with the fewest jobs
        running (this batch's included); ties go to the one served longest ago.
        """
        if self.busy >= self.workers or not self._queues:
            return []
        batch: list[tuple[K, J]] = []
        while self._queues and len(batch) < self.max_batch:
            key = min(
                self._queues,
                key=lambda k: (self._running.get(k, 0), self._served_at.get(k, -1)),
            )
            queue = self._queues[key]
            batch.append((key, queue.popleft()))
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
