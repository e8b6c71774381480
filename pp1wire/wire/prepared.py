"""Prepared blocks: a slot's next block drafted while the Spark side verifies this one,
under guesses of what this round commits, and served only to the STEP that asks for
exactly it (``docs/adaptive.md`` §8)."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np

from pp1wire.q.proposal import BatchDrafterFn, DraftJob, QRow

#: Most hypotheses one slot may prepare a block for (``pp1-worker --prepare``).
MAX_PREPARE: Final = 8
#: Slots whose prepared blocks are kept at once; the oldest go first.
MAX_ORIGINS: Final = 4096
#: Bytes of prepared rows kept at once; the oldest slots' go first.
MAX_BYTES: Final = 256 << 20
#: How long a STEP waits for the block being prepared for its slot before drafting anew.
WAIT_S: Final = 1.0

Key = tuple[object, ...]


def key_of(job: DraftJob) -> Key:
    """Everything a block's rows are a function of, besides the drafter: two jobs with one
    key draw the same rows (the draws are keyed by seed, generation, round and position)."""
    stop = job.stop
    return (
        job.seed,
        job.generation,
        job.round_id,
        tuple(job.prefix),
        job.depth,
        job.temperature,
        job.support,
        job.eos,
        int(stop.kind),
        stop.threshold,
    )


@dataclass(frozen=True)
class Hypothesis:
    """A guess of what round ``job.round_id - 1`` commits, and the next block's job for it."""

    name: str  # "bonus" or "reject@k"
    job: DraftJob


def runner_up(row: QRow) -> int | None:
    """The likeliest token of ``row``'s q other than its drawn one (ties to the lowest ID),
    or None when q has no other token."""
    values = row.counts if row.counts is not None else row.q32
    assert values is not None
    ids = row.ids
    at = row.token if ids is None else int(np.searchsorted(ids, row.token))
    # Two views around the drawn entry: no copy of a dense row.
    best, best_at = 0.0, -1
    for lo, part in ((0, values[:at]), (at + 1, values[at + 1 :])):
        if len(part):
            j = int(np.argmax(part))
            if part[j] > best:
                best, best_at = float(part[j]), lo + j
    if best_at < 0:
        return None
    return best_at if ids is None else int(ids[best_at])


def hypotheses(
    job: DraftJob, rows: Sequence[QRow], count: int, bonus: int | None
) -> list[Hypothesis]:
    """The first ``count`` guesses for round ``job.round_id``'s outcome, likeliest first
    under the drafter's own q: every draft accepted and ``bonus`` (the drafter's likeliest
    next token, None: not guessed), then the first draft rejected for the runner-up of its
    row, then the second, and so on. A guess whose committed tokens reach ``job.eos`` ends
    the request, and is left out. Each guess's job is the next round's, on its prefix."""
    drafts = [r.token for r in rows]
    committed: list[tuple[str, list[int]]] = []
    if bonus is not None:
        committed.append(("bonus", [*drafts, bonus]))
    for k, row in enumerate(rows, start=1):
        other = runner_up(row)
        if other is not None:
            committed.append((f"reject@{k}", [*drafts[: k - 1], other]))
    out: list[Hypothesis] = []
    for name, tokens in committed:
        if len(out) == count:
            break
        if job.eos is not None and job.eos in tokens:
            continue
        nxt = replace(job, round_id=job.round_id + 1, prefix=(*job.prefix, *tokens))
        out.append(Hypothesis(name, nxt))
    return out


def _nbytes(rows: Sequence[QRow]) -> int:
    total = 0
    for r in rows:
        for a in (r.counts, r.q32, r.ids):
            if a is not None:
                total += a.nbytes
    return total


class PreparedBlocks:
    """The blocks prepared for each slot's next round, keyed by the slot (an ``int``, the
    worker's ``id`` of it) and the next job's :func:`key_of`. Thread-safe. A block is served
    only under its whole key, so even a slot ID reused after its slot ended serves only
    rows that are that key's anyway.

    A slot's blocks are replaced by its next preparation and dropped by its next lookup,
    hit or miss, so no block is served twice and none outlives its round. At most
    :data:`MAX_ORIGINS` slots and :data:`MAX_BYTES` of rows are kept; the oldest go first.
    """

    def __init__(
        self, count: int, *, max_origins: int = MAX_ORIGINS, max_bytes: int = MAX_BYTES
    ) -> None:
        """Keep up to ``count`` blocks per slot.

        Raises:
            ValueError: for a count outside 1..:data:`MAX_PREPARE` or a bound below 1.
        """
        if not 1 <= count <= MAX_PREPARE:
            raise ValueError(f"prepared blocks per slot must be 1..{MAX_PREPARE}, not {count}")
        if max_origins < 1 or max_bytes < 1:
            raise ValueError("prepared-block bounds must be at least 1")
        self.count = count
        self.max_origins = max_origins
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[int, dict[Key, tuple[str, tuple[QRow, ...], int]]] = OrderedDict()
        self._bytes = 0
        self._busy: dict[int, int] = {}  # slots being prepared, by preparations
        self._coming: dict[int, set[Key]] = {}  # the keys their preparations are drawing
        self._done = threading.Condition()
        self.prepared: Counter[str] = Counter()  # blocks prepared, by hypothesis
        self.used: Counter[str] = Counter()  # blocks served, by hypothesis
        self.lookups = 0  # STEPs looked up (each slot's first STEP after a preparation)

    def begin(self, origins: Sequence[int]) -> None:
        """Mark ``origins`` as being prepared: their lookups wait (up to :data:`WAIT_S`)
        until :meth:`drawing` names the keys, then only for those keys."""
        with self._done:
            for o in origins:
                self._busy[o] = self._busy.get(o, 0) + 1

    def drawing(self, origin: int, jobs: Sequence[DraftJob]) -> None:
        """``origin``'s preparation is drawing ``jobs``: a lookup for another key misses."""
        with self._done:
            self._coming.setdefault(origin, set()).update(key_of(j) for j in jobs)
            self._done.notify_all()

    def end(self, origins: Sequence[int]) -> None:
        """``origins``' preparation is over (stored or not): their lookups go on."""
        with self._done:
            for o in origins:
                left = self._busy[o] - 1
                if left:
                    self._busy[o] = left
                else:
                    del self._busy[o]
                    self._coming.pop(o, None)
            self._done.notify_all()

    def preparing(self, origin: int) -> bool:
        """Whether a preparation for ``origin`` is running."""
        with self._done:
            return origin in self._busy

    def put(self, origin: int, blocks: Sequence[tuple[Hypothesis, tuple[QRow, ...]]]) -> None:
        """Keep ``blocks`` as ``origin``'s prepared blocks, replacing any it had."""
        table = {key_of(h.job): (h.name, rows, _nbytes(rows)) for h, rows in blocks}
        with self._done:
            self._drop(origin)
            if not table:
                return
            self._blocks[origin] = table
            self._bytes += sum(n for _, _, n in table.values())
            for h, _ in blocks:
                self.prepared[h.name] += 1
            while self._blocks and (
                len(self._blocks) > self.max_origins or self._bytes > self.max_bytes
            ):
                self._drop(next(iter(self._blocks)))

    def take(self, origin: int, job: DraftJob, *, wait: float = WAIT_S) -> tuple[QRow, ...] | None:
        """The rows prepared for ``origin`` under ``job``'s key, or None; either way every
        block ``origin`` had is dropped. Waits up to ``wait`` s for a running preparation."""
        key = key_of(job)

        def settled() -> bool:  # not being prepared, or being prepared for another key
            coming = self._coming.get(origin)
            return origin not in self._busy or (coming is not None and key not in coming)

        with self._done:
            self._done.wait_for(settled, timeout=wait)
            table = self._drop(origin)
            if table is None:
                return None
            self.lookups += 1
            hit = table.get(key)
            if hit is None:
                return None
            self.used[hit[0]] += 1
            return hit[1]

    def take_now(self, origin: int, job: DraftJob) -> tuple[QRow, ...] | None:
        """:meth:`take` without waiting, and without a lookup while ``origin``'s
        preparation may still draw ``job``'s key (then None, and nothing dropped)."""
        key = key_of(job)
        with self._done:
            coming = self._coming.get(origin)
            if origin in self._busy and (coming is None or key in coming):
                return None
        return self.take(origin, job, wait=0.0)

    def _drop(self, origin: int) -> dict[Key, tuple[str, tuple[QRow, ...], int]] | None:
        table = self._blocks.pop(origin, None)
        if table is not None:
            self._bytes -= sum(n for _, _, n in table.values())
        return table


class Cancelled(Exception):  # noqa: N818 - a control-flow signal, not an error type
    """A preparation stopped because a STEP needs its thread."""


def cancellable(drafter: BatchDrafterFn, cancel: threading.Event) -> BatchDrafterFn:
    """``drafter``, raising :class:`Cancelled` at a call once ``cancel`` is set."""

    def call(prefixes: Sequence[Sequence[int]]) -> Any:
        if cancel.is_set():
            raise Cancelled
        return drafter(prefixes)

    return call


__all__ = [
    "MAX_PREPARE",
    "WAIT_S",
    "Cancelled",
    "Hypothesis",
    "PreparedBlocks",
    "cancellable",
    "hypotheses",
    "key_of",
    "runner_up",
]
