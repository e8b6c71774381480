"""A rank of a vocabulary-sharded worker group: every STEP drawn by all ranks together.

Worker rank r serves its own link (the Spark rank r's connection) and holds
only the q of its range (``docs/protocol.md`` §6.7). A STEP arrives on every
link; the ranks must draw it together, in the same order, with the same
collectives. One thread per rank runs the group:

* rank 0 takes its link's STEPs in arrival order and broadcasts each one's key
  (slot, generation, round, position, prefix digest, depth, support,
  temperature, context); when it has none for a while it broadcasts an idle
  beat, so a follower never waits in a collective longer than that;
* every other rank finds the STEP with that key among its own link's
  (waiting up to ``match_timeout`` for it to arrive), and the ranks all-reduce
  whether each has it. If one does not, every rank answers its STEP with a
  COMPLETION of status ``INTERNAL`` (the Spark side falls back);
* then they run the proposal chain of §6.4 on the global q: each rank takes
  its range of the drafter's logits, the counts come from the sharded
  construction of §6.6 (:mod:`pp1wire.q.dist_ops`), rank 0 alone draws the
  24-bit PROPOSAL value from the request's stream and broadcasts it, and the
  sharded draw gives every rank the same token before the next row is
  conditioned on it.

A STEP of a follower's link that rank 0 never names is answered ``INTERNAL``
after ``match_timeout``. A broken group (a dead rank, a collective that timed
out) answers every STEP ``INTERNAL`` from then on: the Spark side decodes
target-only, which needs no worker.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error
from pp1wire.q import dyadic
from pp1wire.q.layout import as_int64
from pp1wire.q.proposal import MAX_DEPTH, DrafterFn, ExtendedPrefix, QRow
from pp1wire.q.rng import Domain, Role, RoundStreams
from pp1wire.tp import dist_ops
from pp1wire.tp.coordinator import GroupCoordinator
from pp1wire.wire.messages import Step

log = logging.getLogger("pp1wire.worker.group")

Key = tuple[int, ...]
AfterDraw = Callable[[int, int, tuple[QRow, ...]], tuple[QRow, ...]]
"""Testing hook ``(rank, draw, rows) -> rows`` run after each group draw (1-based, the
same count on every rank); it may alter the rows, sleep, raise or end the process."""
_WORDS = 10  # the beat word, then the key's nine
_STOP = object()  # the group thread's signal to leave


def key_of(step: Step) -> Key:
    """The words that name one STEP on every link (everything but the session)."""
    (temperature,) = struct.unpack("<q", struct.pack("<d", step.temperature))
    return (
        step.slot,
        step.generation,
        step.round,
        step.position,
        as_int64(step.digest),
        step.depth,
        step.support,
        temperature,
        as_int64(step.context),
    )


@dataclass
class _Job:
    key: Key
    seed: int
    prefix: Sequence[int]
    step: Step
    eos: int | None
    done: concurrent.futures.Future[tuple[QRow, ...]] = field(
        default_factory=concurrent.futures.Future
    )
    since: float = field(default_factory=time.monotonic)
    draw: int = 0  # the group's count of this draw, once drawn


class ShardedDrafting:
    """This rank's share of the worker group's draws (a :data:`Proposer` for its server)."""

    def __init__(
        self,
        coord: GroupCoordinator,
        drafter: DrafterFn,
        *,
        match_timeout: float = 5.0,
        beat: float = 0.25,
        after_draw: AfterDraw | None = None,
    ) -> None:
        """This rank's drafting over ``coord`` (its layout: one range per rank); call
        :meth:`start` once the server is listening.

        Raises:
            ValueError: if the coordinator has no vocabulary layout.
        """
        if coord.layout is None:
            raise ValueError("a sharded worker group needs a vocabulary layout")
        self.coord = coord
        self.rank = coord.rank
        self.world = coord.world
        self.lo, self.hi = coord.layout.range(self.rank)
        self.vocab = coord.layout.vocab_size
        self.drafter = drafter
        self.match_timeout = match_timeout
        self.beat = beat
        self.broken: str | None = None
        self.draws = 0
        self.after_draw = after_draw
        self._arrived: queue.Queue[_Job] = queue.Queue()  # rank 0: in arrival order
        self._pending: dict[Key, _Job] = {}  # other ranks: waiting to be named
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pp1-worker-group", daemon=True)

    def start(self) -> None:
        """Start the group thread."""
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the group thread is still alive (e.g. waiting in a collective)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop after the draw in progress (rank 0 tells the others to stop)."""
        self._stop.set()
        self._thread.join(timeout=self.match_timeout + self.beat + 1.0)

    # -- the Proposer ------------------------------------------------------

    def __call__(
        self, seed: int, prefix: Sequence[int], step: Step, eos: int | None
    ) -> tuple[QRow, ...]:
        """This rank's rows of ``step``, drawn with the group (blocks until drawn).

        Raises:
            Pp1Error: the construction's code on every rank, or ``INTERNAL`` if
                the group could not draw this STEP together.
        """
        job = _Job(key_of(step), seed, list(prefix), step, eos)
        if self.broken is not None:
            raise Pp1Error(ErrorCode.INTERNAL, f"worker group broken: {self.broken}")
        if self.rank == 0:
            self._arrived.put(job)
        else:
            with self._cond:
                self._pending[job.key] = job
                self._cond.notify_all()
        while True:  # never outlive the group: a stopped or broken one answers INTERNAL
            try:
                rows = job.done.result(timeout=self.beat)
                break
            except concurrent.futures.TimeoutError:
                if self.broken is not None or not self._thread.is_alive():
                    raise Pp1Error(ErrorCode.INTERNAL, "the worker group stopped") from None
        if self.after_draw is not None:  # on this STEP's own thread: the group goes on
            rows = self.after_draw(self.rank, job.draw, rows)
        return rows

    # -- the group thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                job = self._lead() if self.rank == 0 else self._follow()
                if job is _STOP:
                    return
                if isinstance(job, _Job):
                    self._draw(job)
        except Exception as exc:  # a dead rank or a timed-out collective: fail closed
            self.broken = repr(exc)
            log.error("worker group broken", extra={"error": self.broken})
        finally:
            self._fail_all(self.broken or "stopped")

    def _broadcast(self, words: list[int]) -> list[int]:
        t = self.coord.broadcast(torch.tensor(words, dtype=torch.int64), 0)
        return [int(v) for v in t.tolist()]

    def _everyone(self, flag: bool) -> bool:
        return self.coord.everyone(flag)

    def _lead(self) -> _Job | object | None:
        if self._stop.is_set():
            self._broadcast([-1] + [0] * (_WORDS - 1))
            return _STOP
        try:
            job = self._arrived.get(timeout=self.beat)
        except queue.Empty:
            self._broadcast([0] * _WORDS)
            return None
        self._broadcast([1, *job.key])
        if not self._everyone(True):
            self._fail(job, "a rank's link has no matching STEP")
            return None
        return job

    def _follow(self) -> _Job | object | None:
        words = self._broadcast([0] * _WORDS)
        self._expire()
        if words[0] < 0:
            return _STOP
        if words[0] == 0:
            return None
        key = tuple(words[1:])
        deadline = time.monotonic() + self.match_timeout
        with self._cond:
            while key not in self._pending and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            job = self._pending.pop(key, None)
        if not self._everyone(job is not None):
            if job is not None:
                self._fail(job, "a rank's link has no matching STEP")
            return None
        return job

    def _expire(self) -> None:
        now = time.monotonic()
        with self._cond:
            old = [k for k, j in self._pending.items() if now - j.since > self.match_timeout]
            jobs = [self._pending.pop(k) for k in old]
        for job in jobs:
            self._fail(job, "rank 0 never drew this STEP")

    def _fail(self, job: _Job, why: str) -> None:
        job.done.set_exception(Pp1Error(ErrorCode.INTERNAL, why))

    def _fail_all(self, why: str) -> None:
        with self._cond:
            jobs = list(self._pending.values())
            self._pending.clear()
        while not self._arrived.empty():
            jobs.append(self._arrived.get_nowait())
        for job in jobs:
            self._fail(job, f"worker group broken: {why}")

    # -- one proposal, on every rank -------------------------------------------

    def _draw(self, job: _Job) -> None:
        try:
            rows = self._chain(job)
        except Pp1Error as exc:  # raised on every rank alike (flags are all-reduced)
            job.done.set_exception(exc)
            return
        self.draws += 1
        job.draw = self.draws
        job.done.set_result(rows)

    def _chain(self, job: _Job) -> tuple[QRow, ...]:
        step = job.step
        if not 1 <= step.depth <= MAX_DEPTH:
            raise ConstructionError(ErrorCode.BAD_SHAPE, f"depth {step.depth} outside 1..5")
        # Only rank 0 holds the proposal randomness; the others learn each draw.
        streams = (
            RoundStreams(Role.WORKER, job.seed, step.generation, step.round)
            if self.rank == 0
            else None
        )
        context = ExtendedPrefix(job.prefix)
        rows: list[QRow] = []
        for i in range(step.depth):
            logits = self._local_logits(context)
            u24 = self._broadcast_draw(streams, step.position + i)
            row = self._row(logits, step.temperature, step.support, u24)
            rows.append(row)
            context.append(row.token)
            if row.token == job.eos:
                break
        return tuple(rows)

    def _local_logits(self, context: Sequence[int]) -> torch.Tensor:
        full = np.asarray(self.drafter(context), dtype=np.float64)
        if full.shape != (self.vocab,):
            # Every rank's drafter sees the same context: all of them refuse together.
            raise ConstructionError(ErrorCode.BAD_SHAPE, f"drafter gave shape {full.shape}")
        return torch.from_numpy(full[self.lo : self.hi].copy())

    def _broadcast_draw(self, streams: RoundStreams | None, position: int) -> int:
        u = streams.u24(Domain.PROPOSAL, position) if streams is not None else 0
        return self._broadcast([u])[0]

    def _row(self, logits: torch.Tensor, temperature: float, support: int, u24: int) -> QRow:
        g = self.coord
        if temperature == 0:
            counts, token = self._greedy(logits)
            if support == 0:
                return QRow(token=token, counts=counts)
            point = np.array([dyadic.M], dtype=np.int64)
            return self._shard_row(token, point, np.array([token], dtype=np.int32))
        if support == 0:
            local = dist_ops.counts_from_logits(logits, temperature, g)
            token = dist_ops.sample(local, u24, g)
            return QRow(token=token, counts=local.numpy().astype(np.int64))
        ids_t, counts_t = dist_ops.sparse_counts_from_logits(logits, temperature, support, g)
        ids, counts = ids_t.numpy().astype(np.int32), counts_t.numpy().astype(np.int64)
        token = int(ids[dyadic.sample(counts, u24)])  # the same global support on every rank
        return self._shard_row(token, counts, ids)

    def _shard_row(self, token: int, counts: np.ndarray, ids: np.ndarray | None) -> QRow:
        if ids is None:
            return QRow(token=token, counts=counts)
        mine = (ids >= self.lo) & (ids < self.hi)
        return QRow(token=token, counts=counts[mine], ids=ids[mine])

    def _greedy(self, logits: torch.Tensor) -> tuple[np.ndarray, int]:
        """The point mass at the first maximal logit of the whole vocabulary."""
        bad = bool(torch.isnan(logits).any() or torch.isposinf(logits).any())
        local = float(logits.max()) if logits.numel() else float("-inf")
        where = self.lo + int(torch.argmax(logits)) if logits.numel() else self.vocab
        offer = torch.tensor([float(bad), local, float(where)], dtype=torch.float64)
        offers = self.coord.all_gather(offer)
        if any(o[0] > 0 for o in offers):
            raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "greedy logits must be finite")
        top = max(float(o[1]) for o in offers)
        if top == float("-inf"):
            raise ConstructionError(ErrorCode.ZERO_MASS, "every logit is -inf")
        token = min(int(o[2]) for o in offers if float(o[1]) == top)
        counts = np.zeros(self.hi - self.lo, dtype=np.int64)
        if self.lo <= token < self.hi:
            counts[token - self.lo] = dyadic.M
        return counts, token


__all__ = ["ShardedDrafting", "key_of"]
