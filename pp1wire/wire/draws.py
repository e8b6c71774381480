"""Draw work shared fairly between principals (``docs/protocol.md`` §4.4; sans-IO): the
:class:`DrawScheduler` that hands the draw threads batches, the runners that draw a batch
(drafted together, or each alone), and :class:`FailureLog`; callers pass ``now``."""

from __future__ import annotations

import functools
import logging
import math
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from threading import Event
from typing import Final, Generic, TypeVar

import numpy as np

from pp1wire.errors import Pp1Error
from pp1wire.q.batch import propose_batch
from pp1wire.q.proposal import QRow, _host, batched_drafter, drafter_kind
from pp1wire.wire.budgets import SHARE_WINDOW_S
from pp1wire.wire.prepared import PreparedBlocks, cancellable, hypotheses
from pp1wire.wire.replies import FrameParts
from pp1wire.wire.worker_events import DrawJob, DrawResult, Streamer

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
J = TypeVar("J")

BatchRunner = Callable[[list[DrawJob]], list[DrawResult]]
"""Draws a batch of jobs on a pool worker: one result per job, in order (each job's rows
through :meth:`DrawJob.complete`, or :meth:`DrawJob.run` for one not ``local``). If it
raises, every job of the batch fails (``INTERNAL``)."""


#: Most STEPs drafted together (one drafter call per position over all of them).
MAX_DRAW_BATCH: Final = 64
#: How long a free draw thread may wait for the STEPs a burst of COMMITs announced.
DRAW_GATHER_S: Final = 0.002
#: Most threads one batch's q rows are built on.
CONSTRUCT_THREADS: Final = 4


def default_runner(
    vocab_size: int, row_entries: int, *, local: bool, batch: int | None, prepare: int = 0
) -> tuple[BatchRunner, int]:
    """A worker's default runner and batch size: for ``local`` draws :class:`DraftTogether`
    on up to :data:`CONSTRUCT_THREADS` cores, ``batch`` (or :data:`MAX_DRAW_BATCH`) at a
    time, preparing ``prepare`` blocks a slot (0: none); else :func:`run_each`, one job
    per batch.

    Raises:
        ValueError: for ``prepare`` above 0 without ``local`` draws, or above
            :data:`~pp1wire.wire.prepared.MAX_PREPARE`.
    """
    if not local:
        if prepare:
            raise ValueError("prepared blocks need the local chain, not a sharded group's")
        return run_each, batch or 1
    threads = max(1, min(CONSTRUCT_THREADS, len(os.sched_getaffinity(0))))
    prepared = PreparedBlocks(prepare) if prepare else None
    runner = DraftTogether(vocab_size, row_entries, threads=threads, prepared=prepared)
    return runner, batch or MAX_DRAW_BATCH


def run_each(jobs: list[DrawJob]) -> list[DrawResult]:
    """A :data:`BatchRunner` that draws each job on its own, in order."""
    return [job.run() for job in jobs]


class DraftTogether:
    """The worker's engine step as a :data:`BatchRunner`: a batch's :attr:`~DrawJob.local`
    jobs drafted together by :func:`~pp1wire.q.batch.propose_batch` (one drafter call per
    position, the q rows built in one pass on ``threads`` threads, a dense row written
    once as its ``row_entries`` FP32 wire values), each reply byte for byte the one
    :meth:`DrawJob.run` gives; each position's rows streamed as soon as it is drawn.
    """

    def __init__(
        self,
        vocab_size: int,
        row_entries: int | None,
        *,
        threads: int = 2,
        prepared: PreparedBlocks | None = None,
    ) -> None:
        """Draft over ``vocab_size`` tokens; with ``prepared``, serve a STEP the block
        :meth:`prepare` drew for it, and prepare blocks (``docs/adaptive.md`` §8).

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
        self.prepared = prepared

    def __call__(self, jobs: list[DrawJob]) -> list[DrawResult]:
        """One result per job, in order (never raises for a job's failure)."""
        results: list[DrawResult | None] = [None] * len(jobs)
        by_drafter: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            if not job.local:
                continue
            if self.prepared is not None:
                started = time.perf_counter()
                ready = self.prepared.take(id(job.slot), job.draft_job())
                if ready is not None:  # the block this STEP would draw, drawn already
                    results[i] = job.complete(ready, started=started)
                    continue
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

    def prepare(
        self, jobs: list[DrawJob], results: list[DrawResult], halt: Event, cancel: Event
    ) -> None:
        """Draw the next round's block for each hypothesis of each whole block in
        ``results`` (:func:`~pp1wire.wire.prepared.hypotheses`) and keep them for its slot,
        in stages: every slot's likeliest hypothesis, then every slot's next, and so on.
        No stage starts once ``halt`` is set; the running one stops at its next drafter
        call once ``cancel`` is. The caller marked the slots with
        :meth:`PreparedBlocks.begin`; this ends them. Never raises."""
        prepared = self.prepared
        assert prepared is not None
        try:
            plan: dict[int, list[tuple[DrawJob, tuple[QRow, ...]]]] = {}
            for job, result in zip(jobs, results, strict=True):
                if job.local and result.status == 0 and result.rows:
                    plan.setdefault(id(job.drafter), []).append((job, tuple(result.rows)))
            for group in plan.values():
                if not halt.is_set():
                    self._prepare_group(group, halt, cancel)
        except Exception:  # a failed guess costs only its block
            log.debug("preparing blocks failed", exc_info=True)
        finally:
            prepared.end([id(job.slot) for job in jobs])

    def _prepare_group(
        self, group: list[tuple[DrawJob, tuple[QRow, ...]]], halt: Event, cancel: Event
    ) -> None:
        prepared = self.prepared
        assert prepared is not None
        plugin = group[0][0].drafter
        kind = drafter_kind(plugin)
        batch = cancellable(batched_drafter(plugin), cancel)
        try:  # the drafter's likeliest next token after each block: the bonus guess
            after = [(*job.prefix, *(r.token for r in rows)) for job, rows in group]
            values = np.asarray(_host(batch(after)))
            bonus: list[int | None] = [int(np.argmax(v)) for v in values]
        except Exception:  # no bonus guess; the others stand
            bonus = [None] * len(group)
        hyps = [
            hypotheses(job.draft_job(), rows, prepared.count, b)
            for (job, rows), b in zip(group, bonus, strict=True)
        ]
        for stage in range(prepared.count):
            todo = [
                (job, hs[stage])
                for (job, _), hs in zip(group, hyps, strict=True)
                if stage < len(hs)
            ]
            if not todo or halt.is_set():
                return
            for job, h in todo:
                prepared.drawing(id(job.slot), [h.job])
            drawn = propose_batch(
                batch,
                [h.job for _, h in todo],
                self.vocab_size,
                threads=self.threads,
                row_entries=self.row_entries,
                kind=kind,
            )
            for (job, h), rows in zip(todo, drawn, strict=True):
                prepared.put(id(job.slot), [] if isinstance(rows, Pp1Error) else [(h, rows)])


def stream_position(jobs: list[DrawJob], position: int, rows: list[tuple[int, QRow]]) -> None:
    """Frame one position's rows (``(index in jobs, row)``) and hand them to their jobs'
    streamers, one call each; a row that fails to frame is left to its job's completion."""
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
    """Per-principal draw queues served fairly by ``workers`` pool workers (§4.4).

    ``K`` names a principal, ``J`` is a job; a key's jobs go out in submission order, each
    job's ``owner`` (a connection) dropped together. While several keys are active, one
    holds at most ``ceil(workers / active keys)`` workers, even with one free (the share
    of a key between two rounds). With ``group_of``, the keys of one group (the lineages
    of one address) share as one key. A slot expected to STEP soon (:meth:`expect`: its
    COMMIT arrived) is waited for up to ``gather`` seconds, so that a burst of STEPs
    that arrives over several reads is drafted as one batch.
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
        """Serve with ``workers`` workers, ``max_batch`` jobs per batch, a key counting as
        active ``share_window`` seconds after its last batch.

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
        self._queues: dict[K, deque[tuple[float, Hashable, J]]] = {}  # (queued at, owner, job)
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
        """Queue ``job`` of ``owner`` for ``key`` at ``now``; its ``tag`` (a slot) is no
        longer expected."""
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
        (running ones finish); nothing of it is expected any more."""
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
        """While a free worker waits for expected jobs, when it stops (``gather`` after the
        oldest job of a key within its share at ``now``); else None."""
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
        """A batch for a free worker, now busy, or [] (none free, no key within its share,
        or still waiting for expected jobs at ``now``). Each job goes to the key with the
        fewest jobs running, ties to the one served longest ago (:meth:`_turn_of`).
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
        """A queued key's turn (least first): its group's jobs running and last turn, its own."""
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


#: Each distinct drafter failure is logged once with its traceback, then once per this.
FAILURE_LOG_EVERY_S: Final = 60.0
#: Distinct drafter failures remembered; beyond them, one rate-limited line for the rest.
FAILURE_KINDS: Final = 64


class FailureLog:
    """When to log a drafter failure: a new kind (class, message, raising line) at once, a
    known one at most every ``every`` s; beyond ``kinds`` kinds, one shared kind."""

    def __init__(self, every: float = FAILURE_LOG_EVERY_S, kinds: int = FAILURE_KINDS) -> None:
        """Log each kind at most once per ``every`` seconds, remembering ``kinds`` kinds."""
        self.every = every
        self.kinds = kinds
        self._seen: dict[tuple[str, ...], tuple[float, int]] = {}  # (logged at, skipped since)

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
