"""Draw work shared fairly between principals, and bounded per principal (sans-IO).

A worker draws proposals on a pool of a few workers (threads). Served in
arrival order, one peer that keeps every slot drawing (a RESET/STEP loop on all
of them) puts every other peer's draw behind all of its own. What one peer may
take is bounded per *principal* (``docs/protocol.md`` §2: the peer's source
address), never per connection, which a peer could open again or open more of:

* :class:`DrawScheduler` keeps one queue per principal and gives each free
  worker a batch taken from the principals with the fewest draws running, the
  least recently served first among equals (round robin); while several
  principals have drawn lately, none holds more than its share of the workers.
  A principal whose draw arrives while others are backlogged waits for the
  first worker that frees up, not for their queues.
* :class:`Account` holds a principal's budgets (``docs/protocol.md`` §4.4),
  kept between its connections by :class:`Accounts`: the fresh draws each of
  its slots may ask for per second (a :class:`TokenBucket` per slot, off
  unless ``--max-draw-rate`` is set) and the draws it may leave uncommitted
  (:class:`AbandonBudget`). A fresh STEP beyond either is refused with
  ``DRAW_RATE_LIMITED``, changing nothing, before anything is drawn.

The scheduler hands out *batches* of up to ``max_batch`` jobs (fairly across
principals) to a :data:`BatchRunner`: :class:`DraftTogether` drafts every
STEP of a batch together, as an engine's step does (one drafter call per
position over all of them, the q rows of the batch built and drawn in one
compiled pass), and :func:`run_each` runs each job on its own.

STEPs that arrive together are drafted together. A Spark side that steps like
an engine sends every slot's COMMIT, then every slot's next STEP, in a burst
that may reach the worker over several reads; dispatching the first STEP at
once would draft the burst as several batches, one after another. So a
connection's slots that were opened, reset or committed since its principal's
last dispatch are *expected* (:meth:`DrawScheduler.expect`), and a free worker
waits for them, at most ``gather`` seconds after the first queued job, before
taking a batch; a slot whose STEP arrives is no longer expected, and a
dispatch stops expecting the rest of its principal's slots (a slot that does
not STEP costs one wait, once). :class:`FailureLog` decides which drafter
failures a shell logs. No clock is read here: callers pass ``now``.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Final, Generic, Protocol, TypeVar

from pp1wire.errors import Pp1Error
from pp1wire.q.proposal import batched_drafter, propose_batch
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


#: Most STEPs drafted together (one drafter call per position over all of them).
MAX_DRAW_BATCH: Final = 64
#: How long a free draw thread may wait for the STEPs a burst of COMMITs announced.
DRAW_GATHER_S: Final = 0.002
#: Seconds a principal keeps its share of the draw threads after its last batch.
SHARE_WINDOW_S: Final = 1.0
#: Fresh draws one slot may ask for ahead of ``--max-draw-rate`` (the default ``--draw-burst``).
DRAW_BURST: Final = 4
#: Principals remembered with no connection open (their budgets still owing).
IDLE_ACCOUNTS: Final = 4096
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
    jobs drafted together by :func:`~pp1wire.q.proposal.propose_batch`.

    Per position, one call of the drafter's batched form over every job still
    drafting (:func:`~pp1wire.q.proposal.batched_drafter`: the plugin's own
    ``batch``, else one call per prefix); the q rows of the batch built and
    drawn in one compiled pass on ``threads`` threads; with ``row_entries``
    (an unsharded link's dense row length), each dense row written once, as
    its FP32 wire values, and sent from there. Each job's reply is the one
    :meth:`DrawJob.run` gives, byte for byte, with the same proposal draws. A
    job that fails in the batch is drawn again alone, so that its answer (the
    status, and the exception a shell logs) is exactly the per-job one; jobs
    of a :data:`~pp1wire.wire.worker_events.Proposer` run alone too.
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
            drafter = batched_drafter(jobs[indices[0]].drafter)
            drawn = propose_batch(
                drafter,
                [jobs[i].draft_job() for i in indices],
                self.vocab_size,
                threads=self.threads,
                row_entries=self.row_entries,
            )
            for i, rows in zip(indices, drawn, strict=True):
                if not isinstance(rows, Pp1Error):
                    results[i] = jobs[i].complete(rows, started=started)
        return [jobs[i].run() if r is None else r for i, r in enumerate(results)]


class DrawScheduler(Generic[K, J]):
    """Per-principal draw queues served fairly by ``workers`` pool workers.

    ``K`` names a principal (the peer a share belongs to: all its connections
    together), ``J`` is a job. Jobs of one key are handed out in the order they
    were submitted; each job may name its ``owner`` (a connection), whose jobs
    :meth:`drop` removes.

    Shares: while several keys are *active* (jobs queued or running, or a
    batch handed out within the last ``share_window`` seconds), a key holds at
    most its share of the workers, ``ceil(workers / active keys)`` of them (a
    worker holding a batch with one of its jobs counts as one of them). A key
    at its share waits even if a worker is free: that worker is the share of a
    key between two of its rounds, so its next draw starts at once instead of
    behind another key's batch. With one key active, every worker is its own.
    """

    def __init__(
        self,
        workers: int,
        *,
        max_batch: int = 1,
        gather: float = 0.0,
        share_window: float = SHARE_WINDOW_S,
    ) -> None:
        """Serve with ``workers`` (>= 1) workers, ``max_batch`` (>= 1) jobs per batch,
        waiting up to ``gather`` (>= 0) seconds for expected jobs (0: never), a key
        counting as active ``share_window`` (>= 0) seconds after its last batch.

        Raises:
            ValueError: for a count below 1 or a negative or non-finite ``gather``
                or ``share_window``.
        """
        if workers < 1 or max_batch < 1:
            raise ValueError("a draw scheduler needs at least one worker and one job per batch")
        if not (math.isfinite(gather) and gather >= 0):
            raise ValueError("a draw scheduler's gather time must be finite and at least 0")
        if not (math.isfinite(share_window) and share_window >= 0):
            raise ValueError("a draw scheduler's share window must be finite and at least 0")
        self.workers = workers
        self.max_batch = max_batch
        self.gather = gather
        self.share_window = share_window
        # Per key: (time queued, owner, job), in submission order.
        self._queues: dict[K, deque[tuple[float, Hashable, J]]] = {}
        self._running: dict[K, int] = {}  # jobs handed out, not finished
        self._holding: dict[K, int] = {}  # workers holding a batch with a job of the key
        self._active_until: dict[K, float] = {}  # a batch handed out: counted until then
        self._served_at: dict[K, int] = {}
        self._expected: dict[K, set[tuple[Hashable, Hashable]]] = {}
        self._turn = 0
        self.busy = 0  # workers holding a batch
        self.queued = 0  # jobs waiting

    def submit(
        self, key: K, job: J, *, now: float = 0.0, owner: Hashable = None, tag: Hashable = None
    ) -> None:
        """Queue ``job`` of ``owner`` for ``key`` at time ``now``; the job named ``tag``
        (a slot) of that owner is no longer expected."""
        self._queues.setdefault(key, deque()).append((now, owner, job))
        self.queued += 1
        if tag is not None:
            self.unexpect(key, tag, owner=owner)

    def expect(self, key: K, tag: Hashable, *, owner: Hashable = None) -> None:
        """``owner`` (of ``key``) is expected to submit a job named ``tag`` soon."""
        self._expected.setdefault(key, set()).add((owner, tag))

    def unexpect(self, key: K, tag: Hashable, *, owner: Hashable = None) -> None:
        """The job named ``tag`` is no longer expected (it came, or its slot closed)."""
        tags = self._expected.get(key)
        if tags is not None:
            tags.discard((owner, tag))
            if not tags:
                del self._expected[key]

    def drop(self, key: K, *, owner: Hashable = None) -> list[J]:
        """``owner`` of ``key`` is gone (None: the whole key): its queued jobs, removed
        (running ones finish), and nothing of it is expected any more."""
        queue = self._queues.get(key)
        dropped: list[J] = []
        if queue is not None:
            kept: deque[tuple[float, Hashable, J]] = deque()
            for item in queue:
                if owner is None or item[1] == owner:
                    dropped.append(item[2])
                else:
                    kept.append(item)
            if kept:
                self._queues[key] = kept
            else:
                del self._queues[key]
        self.queued -= len(dropped)
        tags = self._expected.get(key)
        if tags is not None:
            left = {t for t in tags if owner is not None and t[0] != owner}
            if left:
                self._expected[key] = left
            else:
                del self._expected[key]
        if key not in self._queues and not self._running.get(key):
            self._served_at.pop(key, None)
        return dropped

    def hold_until(self, now: float = math.inf) -> float | None:
        """While a free worker waits for expected jobs: the time it stops waiting
        (``gather`` after the oldest job a key within its share at ``now`` has
        queued); else None (a key at its share waits for a worker, not for this)."""
        if self.gather <= 0 or self.busy >= self.workers or self.queued >= self.max_batch:
            return None
        eligible = self._eligible(now)
        if not any(k in self._expected for k in eligible):
            return None
        return min(self._queues[k][0][0] for k in eligible) + self.gather

    def running(self, key: K) -> int:
        """Jobs of ``key`` handed out and not yet finished."""
        return self._running.get(key, 0)

    def share(self, now: float) -> int:
        """The most workers one key may hold at ``now`` (see the class)."""
        if now != math.inf:
            for key in [k for k, t in self._active_until.items() if t <= now]:
                del self._active_until[key]
        recent = {k for k, t in self._active_until.items() if t > now}
        active = set(self._queues) | set(self._running) | recent
        return max(1, -(-self.workers // max(1, len(active))))

    def _eligible(self, now: float) -> list[K]:
        """The keys with jobs queued that hold fewer workers than their share at ``now``."""
        share = self.share(now)
        return [k for k in self._queues if self._holding.get(k, 0) < share]

    def next_batch(self, now: float = math.inf) -> list[tuple[K, J]]:
        """A batch for a free worker, now marked busy, or [] (no free worker, no job
        a key within its share may take, or, at time ``now``, still waiting for
        expected jobs: :meth:`hold_until`).

        Each job of the batch goes to the queued key with the fewest jobs running
        (this batch's included), ties to the one served longest ago, among the keys
        that hold fewer than their share of the workers (:meth:`share`). The keys
        of the batch expect nothing more.
        """
        if self.busy >= self.workers or not self._queues:
            return []
        until = self.hold_until(now)
        if until is not None and now < until:
            return []
        eligible = self._eligible(now)
        batch: list[tuple[K, J]] = []
        while eligible and len(batch) < self.max_batch:
            key = min(
                eligible,
                key=lambda k: (self._running.get(k, 0), self._served_at.get(k, -1)),
            )
            queue = self._queues[key]
            batch.append((key, queue.popleft()[2]))
            self._expected.pop(key, None)
            if not queue:
                del self._queues[key]
                eligible.remove(key)
            self.queued -= 1
            self._running[key] = self._running.get(key, 0) + 1
            self._turn += 1
            self._served_at[key] = self._turn
        if not batch:
            return []
        for key in {k for k, _ in batch}:
            self._holding[key] = self._holding.get(key, 0) + 1
            if now != math.inf:
                self._active_until[key] = now + self.share_window
        self.busy += 1
        return batch

    def finished(self, batch: Sequence[tuple[K, J]]) -> None:
        """A worker is done with ``batch`` (from :meth:`next_batch`) and free again."""
        self.busy -= 1
        for key in {k for k, _ in batch}:
            held = self._holding[key] - 1
            if held:
                self._holding[key] = held
            else:
                del self._holding[key]
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

    def level(self, now: float) -> float:
        """The draws the bucket holds at ``now`` (fractions included)."""
        self._refill(now)
        return self._tokens

    def full(self, now: float) -> bool:
        """Whether the bucket is full at ``now`` (a new one would be no different)."""
        return self.level(now) >= self.burst - _EPSILON

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
    """Fresh draws a principal may leave uncommitted, and how fast it earns more.

    A draw is *abandoned* when the slot it was drawn for is reset or closed
    before any COMMIT of that round or a later one (``docs/protocol.md`` §4.4):
    the RESET/STEP loop that makes a worker draw without bound, since every
    RESET opens a new generation. A Spark side commits every round it asks for,
    so it abandons only what a reconnect or a shutdown cuts. At most ``burst``
    abandons are free, then ``rate`` per second; a principal beyond that owes
    them, and its fresh STEPs are refused (``DRAW_RATE_LIMITED``) until it has
    paid them back. The clock is the caller's.
    """

    __slots__ = ("_level", "_stamp", "burst", "rate")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        """A full budget at ``now``.

        Raises:
            ValueError: as :class:`TokenBucket`.
        """
        TokenBucket(rate, burst, now)  # the same limits
        self.rate = rate
        self.burst = burst
        # Free abandons left; below 0, what is owed. Paid back as it accrues, so a
        # debt is never charged twice by a bucket that would have been full meanwhile.
        self._level = float(burst)
        self._stamp = now

    def _refill(self, now: float) -> None:
        if now > self._stamp:
            self._level = min(float(self.burst), self._level + (now - self._stamp) * self.rate)
            self._stamp = now

    def abandoned(self, now: float) -> None:
        """One more draw left uncommitted at ``now``."""
        self._refill(now)
        self._level -= 1.0

    def allows(self, now: float) -> bool:
        """Whether a fresh draw may start at ``now`` (nothing is owed)."""
        self._refill(now)
        return self._level > -_EPSILON

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`allows` would be true (0 if it is now)."""
        return 0.0 if self.allows(now) else -self._level / self.rate

    def settled(self, now: float) -> bool:
        """Whether nothing is owed and the whole burst is free again at ``now``."""
        self._refill(now)
        return self._level >= self.burst - _EPSILON


class DrawLimits(Protocol):
    """The draw limits of a worker's configuration (``WorkerConfig``)."""

    @property
    def max_draw_rate(self) -> float | None:
        """Fresh draws per second per slot (None: no limit)."""

    @property
    def draw_burst(self) -> int:
        """Fresh draws one slot may ask for ahead of that rate."""

    @property
    def abandon_rate(self) -> float | None:
        """Uncommitted draws per second per principal (None: no limit)."""

    @property
    def abandon_burst(self) -> int:
        """Uncommitted draws at once per principal."""


class Activity:
    """When the principals last had a fresh draw accepted: whether a principal draws
    while others do (``docs/protocol.md`` §4.4). Remembers only the two principals
    that drew last, which is all that question needs."""

    __slots__ = ("_last", "window")

    def __init__(self, window: float = SHARE_WINDOW_S) -> None:
        """Others count as drawing for ``window`` seconds after their last draw."""
        self.window = window
        self._last: list[tuple[object, float]] = []  # (principal, when), latest first

    def drew(self, principal: object, now: float) -> None:
        """``principal`` had a fresh draw accepted at ``now``."""
        others = [e for e in self._last if e[0] != principal]
        self._last = [(principal, now), *others[:1]]

    def others(self, principal: object, now: float) -> bool:
        """Whether a principal other than ``principal`` drew in the last ``window`` s."""
        return any(p != principal and now - t < self.window for p, t in self._last)


class Account:
    """One principal's draw budgets (``docs/protocol.md`` §4.4), shared by all its
    connections and kept between them, so that reconnecting earns nothing.

    * The rate budget counts **per slot**: each open slot holds a *lane*, a
      :class:`TokenBucket` of ``max_draw_rate`` draws per second and
      ``draw_burst`` at once (off when ``max_draw_rate`` is None). A slot that
      closes, or whose connection ends, hands its lane back still owing what
      it spent, and a slot opened later takes the fullest lane handed back
      before a new one is made. So closing and reopening slots, or
      reconnecting, refills nothing, and a principal holds at most as many
      lanes as it ever had slots open at once.
    * The abandon budget (:class:`AbandonBudget`, ``abandon_rate``) is one for
      the principal: what one connection abandoned, the next one owes.
    * The first-draw grace of admission (:meth:`grace`): at most one of its new
      connections per period.
    * Whether other principals are drawing (:meth:`contended`), from the
      :class:`Activity` all the accounts of a worker share.

    The clock is the caller's.
    """

    __slots__ = (
        "_abandons",
        "_activity",
        "_burst",
        "_free",
        "_grace_free",
        "_rate",
        "bound",
        "principal",
        "refs",
    )

    def __init__(
        self,
        limits: DrawLimits,
        now: float,
        *,
        principal: object = None,
        activity: Activity | None = None,
    ) -> None:
        """Full budgets at ``now`` for ``limits`` (a limit that is None is off), for
        ``principal``, whose draws are recorded in ``activity`` (default: its own,
        where no other principal ever draws).

        Raises:
            ValueError: for a rate that is not finite and above 0, or a burst below 1.
        """
        rate, abandon = limits.max_draw_rate, limits.abandon_rate
        if rate is not None:
            TokenBucket(rate, limits.draw_burst, now)  # checks the limits once, here
        self._rate = rate
        self._burst = limits.draw_burst
        self._abandons = (
            None if abandon is None else AbandonBudget(abandon, limits.abandon_burst, now)
        )
        self._free: list[TokenBucket] = []  # lanes handed back, still paying back
        self._grace_free = -math.inf
        self._activity = activity if activity is not None else Activity()
        self.principal = principal
        self.bound = 0  #: lanes held by open slots
        self.refs = 0  #: connections of the principal holding this account

    def bind(self, now: float) -> TokenBucket | None:
        """A lane for a slot opened at ``now`` (None without a rate limit)."""
        if self._rate is None:
            return None
        self.bound += 1
        self._free = [lane for lane in self._free if not lane.full(now)]
        if not self._free:
            return TokenBucket(self._rate, self._burst, now)
        lane = max(self._free, key=lambda b: b.level(now))
        self._free.remove(lane)
        return lane

    def unbind(self, lane: TokenBucket | None, now: float) -> None:
        """The slot holding ``lane`` closed at ``now``: the lane is handed back."""
        if lane is None:
            return
        self.bound -= 1
        if not lane.full(now):
            self._free.append(lane)

    def allows(self, lane: TokenBucket | None, now: float) -> bool:
        """Whether a fresh draw of the slot holding ``lane`` may start at ``now``;
        spends from its lane if so (nothing is spent if not)."""
        if self._abandons is not None and not self._abandons.allows(now):
            return False
        return lane is None or lane.take(now)

    def owes(self, now: float) -> float:
        """Seconds from ``now`` until the abandon budget allows any fresh draw of the
        principal (0 if it does now)."""
        return 0.0 if self._abandons is None else self._abandons.wait(now)

    def abandoned(self, now: float) -> None:
        """A fresh draw of the principal died uncommitted at ``now``."""
        if self._abandons is not None:
            self._abandons.abandoned(now)

    def drew(self, now: float) -> None:
        """A fresh draw of the principal was accepted at ``now``."""
        self._activity.drew(self.principal, now)

    def contended(self, now: float) -> bool:
        """Whether another principal drew in the last share window (others wait for
        the draw threads this one's draws take)."""
        return self._activity.others(self.principal, now)

    def grace(self, now: float, period: float) -> bool:
        """Whether a connection of the principal that completed its handshake at ``now``
        gets the first-draw grace: yes unless another one got it less than ``period``
        seconds ago (which it then takes)."""
        if now < self._grace_free:
            return False
        self._grace_free = now + period
        return True

    def settled(self, now: float) -> bool:
        """Whether nothing is left to remember at ``now``: no connection, no slot, every
        budget full again and no grace period running (a new account would be no
        different)."""
        return (
            self.refs == 0
            and self.bound == 0
            and now >= self._grace_free
            and (self._abandons is None or self._abandons.settled(now))
            and all(lane.full(now) for lane in self._free)
        )


P = TypeVar("P", bound=Hashable)


class Accounts(Generic[P]):
    """The :class:`Account` of each principal, kept while a connection of it is open
    and afterwards only while it still owes something, up to ``idle`` such
    principals (beyond them the longest idle is forgotten first). The clock is
    the caller's.
    """

    def __init__(self, limits: DrawLimits, *, idle: int = IDLE_ACCOUNTS) -> None:
        """Budgets of ``limits`` for every principal; ``idle`` (>= 0) principals without
        a connection remembered at most.

        Raises:
            ValueError: for a negative ``idle``, or limits :class:`Account` refuses.
        """
        if idle < 0:
            raise ValueError("the idle accounts kept must be at least 0")
        Account(limits, 0.0)  # checks the limits once, here
        self.limits = limits
        self.idle = idle
        self.activity = Activity()
        self._accounts: dict[P, Account] = {}
        self._released: dict[P, None] = {}  # principals without a connection, oldest first

    def __len__(self) -> int:
        """Principals remembered (with a connection or still owing)."""
        return len(self._accounts)

    def __contains__(self, principal: object) -> bool:
        """Whether ``principal`` is remembered."""
        return principal in self._accounts

    def acquire(self, principal: P, now: float) -> Account:
        """The account of ``principal``, for a new connection of it at ``now``."""
        self._trim(now)
        account = self._accounts.get(principal)
        if account is None:
            account = self._accounts[principal] = Account(
                self.limits, now, principal=principal, activity=self.activity
            )
        self._released.pop(principal, None)
        account.refs += 1
        return account

    def release(self, principal: P, now: float) -> None:
        """A connection of ``principal`` ended at ``now`` (its slots closed first)."""
        account = self._accounts.get(principal)
        if account is None:
            return
        account.refs -= 1
        if not account.refs:
            if account.settled(now):
                del self._accounts[principal]
            else:
                self._released[principal] = None
        self._trim(now)

    def _trim(self, now: float) -> None:
        """Forget the oldest released principals that are settled, and any beyond ``idle``."""
        while self._released:
            oldest = next(iter(self._released))
            if len(self._released) <= self.idle and not self._accounts[oldest].settled(now):
                break
            del self._released[oldest]
            del self._accounts[oldest]


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
