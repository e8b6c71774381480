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

    A preparation draws in stages, likeliest hypothesis first (:meth:`drawing`, then
    :meth:`put`). A slot's blocks are dropped by its next lookup that does not wait for
    a stage, hit or miss, so no block is served twice and none outlives its round. At
    most :data:`MAX_ORIGINS` slots and :data:`MAX_BYTES` of rows are kept; the oldest
    go first.
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
        self._coming: dict[int, set[Key]] = {}  # the keys their running stage draws
        self._lock = threading.Lock()
        self.prepared: Counter[str] = Counter()  # blocks prepared, by hypothesis
        self.used: Counter[str] = Counter()  # blocks served, by hypothesis

    def begin(self, origins: Sequence[int]) -> None:
        """Mark ``origins`` as being prepared: a lookup is pending until :meth:`drawing`
        names a stage's keys, then for those keys only, until :meth:`end`."""
        with self._lock:
            for o in origins:
                self._busy[o] = self._busy.get(o, 0) + 1
                self._drop(o)  # the previous round's, unused

    def drawing(self, origin: int, jobs: Sequence[DraftJob]) -> None:
        """``origin``'s preparation starts a stage that draws ``jobs``."""
        with self._lock:
            self._coming[origin] = {key_of(j) for j in jobs}

    def put(self, origin: int, blocks: Sequence[tuple[Hypothesis, tuple[QRow, ...]]]) -> None:
        """Add a stage's ``blocks`` to ``origin``'s prepared blocks."""
        with self._lock:
            self._coming.pop(origin, None)
            table = self._blocks.setdefault(origin, {})
            self._blocks.move_to_end(origin)
            for h, rows in blocks:
                n = _nbytes(rows)
                table[key_of(h.job)] = (h.name, rows, n)
                self._bytes += n
                self.prepared[h.name] += 1
            while self._blocks and (
                len(self._blocks) > self.max_origins or self._bytes > self.max_bytes
            ):
                self._drop(next(iter(self._blocks)))

    def end(self, origins: Sequence[int]) -> None:
        """``origins``' preparation is over (stored or not)."""
        with self._lock:
            for o in origins:
                left = self._busy[o] - 1
                if left:
                    self._busy[o] = left
                else:
                    del self._busy[o]
                    self._coming.pop(o, None)

    def lookup(self, origin: int, job: DraftJob) -> tuple[QRow, ...] | bool:
        """The rows prepared for ``origin`` under ``job``'s key (every block ``origin`` had
        then dropped); True while a running stage of ``origin`` may yet draw that key
        (nothing dropped: look again after :meth:`end`); else False, every block dropped."""
        key = key_of(job)
        with self._lock:
            table = self._blocks.get(origin)
            hit = None if table is None else table.get(key)
            if hit is None and origin in self._busy:
                coming = self._coming.get(origin)
                if coming is None or key in coming:
                    return True
            table = self._drop(origin)
            if table is None or hit is None:
                return False
            self.used[hit[0]] += 1
            return hit[1]

    def take(self, origin: int, job: DraftJob) -> tuple[QRow, ...] | None:
        """:meth:`lookup` that never leaves a STEP pending: its rows, or None."""
        got = self.lookup(origin, job)
        return None if isinstance(got, bool) else got

    def _drop(self, origin: int) -> dict[Key, tuple[str, tuple[QRow, ...], int]] | None:
        table = self._blocks.pop(origin, None)
        if table is not None:
            self._bytes -= sum(n for _, _, n in table.values())
        return table


class Cancelled(Exception):  # noqa: N818 - a control-flow signal, not an error type
    """A preparation stopped at a drafter call because a STEP needs its thread."""


def cancellable(drafter: BatchDrafterFn, cancel: threading.Event) -> BatchDrafterFn:
    """``drafter``, raising :class:`Cancelled` at a call once ``cancel`` is set."""

    def call(prefixes: Sequence[Sequence[int]]) -> Any:
        if cancel.is_set():
            raise Cancelled
        return drafter(prefixes)

    return call


__all__ = [
    "MAX_PREPARE",
    "Cancelled",
    "Hypothesis",
    "PreparedBlocks",
    "cancellable",
    "hypotheses",
    "key_of",
    "runner_up",
]
