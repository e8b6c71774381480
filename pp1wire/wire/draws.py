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
* :mod:`pp1wire.wire.budgets` holds a principal's draw budgets, kept between
  its connections; a fresh STEP beyond one is refused with
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

import functools
import math
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from pp1wire.q.batch import propose_batch
from pp1wire.q.proposal import QRow, batched_drafter, drafter_kind
from pp1wire.wire.budgets import SHARE_WINDOW_S
from pp1wire.wire.replies import FrameParts
from pp1wire.wire.worker_events import DrawJob, DrawResult, Streamer

K = TypeVar("K", bound=Hashable)
J = TypeVar("J")

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
                on_position=functools.partial(stream_position, mine),
            )
            for i, rows in zip(indices, drawn, strict=True):
                results[i] = jobs[i].complete(rows, started=started)
        return [jobs[i].run() if r is None else r for i, r in enumerate(results)]


def stream_position(jobs: list[DrawJob], position: int, rows: list[tuple[int, QRow]]) -> None:
    """One position's rows (``(index in jobs, row)``), framed and handed to their jobs'
    streamers, one call each (a frame that fails is left to the job's completion,
    which ends the block before it). Never raises for a job's row."""
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


@dataclass(frozen=True)
class _Group:
    """A group's entry in :class:`DrawScheduler`'s tables, never equal to a key."""

    group: Hashable


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

    Groups: with ``group_of``, keys of one group (the keyless lineages of one
    source address, ``docs/protocol.md`` §4.4) share as one key, and within it
    each key is served as above: a peer that opens more lineages gets no more
    of the workers, and a lineage of its address is still served next.
    """

    def __init__(
        self,
        workers: int,
        *,
        max_batch: int = 1,
        gather: float = 0.0,
        share_window: float = SHARE_WINDOW_S,
        group_of: Callable[[K], Hashable] | None = None,
    ) -> None:
        """Serve with ``workers`` (>= 1) workers, ``max_batch`` (>= 1) jobs per batch,
        waiting up to ``gather`` (>= 0) seconds for expected jobs (0: never), a key
        counting as active ``share_window`` (>= 0) seconds after its last batch;
        ``group_of`` names each key's group (default: each key its own).

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
        self._group: Callable[[K], Hashable] = group_of or (lambda key: key)
        # Per key: (time queued, owner, job), in submission order.
        self._queues: dict[K, deque[tuple[float, Hashable, J]]] = {}
        self._running: dict[Hashable, int] = {}  # jobs handed out, not finished: per key, group
        self._holding: dict[Hashable, int] = {}  # workers holding a batch with a job of the group
        self._active_until: dict[Hashable, float] = {}  # a group's batch: counted until then
        self._served_at: dict[Hashable, int] = {}  # per key, and per group (as a _Group)
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
            self._forget_group(self._group(key))
        return dropped

    def _forget_group(self, group: Hashable) -> None:
        """Forget when ``group`` was served once none of its keys is queued or running."""
        if not self._running.get(_Group(group)) and not any(
            self._group(k) == group for k in self._queues
        ):
            self._served_at.pop(_Group(group), None)

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
        running = {k.group for k in self._running if isinstance(k, _Group)}
        active = {self._group(k) for k in self._queues} | running | recent
        return max(1, -(-self.workers // max(1, len(active))))

    def _eligible(self, now: float) -> list[K]:
        """The keys with jobs queued whose group holds fewer workers than its share at ``now``."""
        share = self.share(now)
        return [k for k in self._queues if self._holding.get(self._group(k), 0) < share]

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
            key = min(eligible, key=self._turn_of)
            queue = self._queues[key]
            batch.append((key, queue.popleft()[2]))
            self._expected.pop(key, None)
            if not queue:
                del self._queues[key]
                eligible.remove(key)
            self.queued -= 1
            self._turn += 1
            for k in (key, _Group(self._group(key))):
                self._running[k] = self._running.get(k, 0) + 1
                self._served_at[k] = self._turn
        if not batch:
            return []
        for group in {self._group(k) for k, _ in batch}:
            self._holding[group] = self._holding.get(group, 0) + 1
            if now != math.inf:
                self._active_until[group] = now + self.share_window
        self.busy += 1
        return batch

    def _turn_of(self, key: K) -> tuple[int, int, int, int]:
        """Which queued key goes next (the least first): its group's jobs running and last
        turn, then its own."""
        group = _Group(self._group(key))
        return (
            self._running.get(group, 0),
            self._served_at.get(group, -1),
            self._running.get(key, 0),
            self._served_at.get(key, -1),
        )

    def finished(self, batch: Sequence[tuple[K, J]]) -> None:
        """A worker is done with ``batch`` (from :meth:`next_batch`) and free again."""
        self.busy -= 1
        for group in {self._group(k) for k, _ in batch}:
            held = self._holding[group] - 1
            if held:
                self._holding[group] = held
            else:
                del self._holding[group]
        for key, _ in batch:
            for k in (key, _Group(self._group(key))):
                left = self._running[k] - 1
                if left:
                    self._running[k] = left
                else:
                    del self._running[k]
            if key not in self._running and key not in self._queues:
                self._served_at.pop(key, None)
            self._forget_group(self._group(key))


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
