"""The accept/resample walk of a block, written once (``docs/protocol.md`` §6.5): every
verifying path (per request, an engine's step on numpy, compiled or torch rows, a sharded
group) differs only in the row operations (:class:`RowOps`) it hands :func:`walk`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from pp1wire.q.proposal import QRow
from pp1wire.q.rng import Domain, Role, RoundStreams

try:  # the compiled Philox (pp1wire/q/_fastq.c), qualified against pp1wire.q.rng by the tests
    from pp1wire.q import _fastq  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised by tests that disable it
    _fastq = None

_U32 = 0xFFFFFFFF
_U53_SHIFT = 53
_Q_SHIFT = 24


def accept_exact(u53_int: int, count: int, p_x: float) -> bool:
    """Exact test of ``(u53_int / 2**53) * (count / 2**24) < p_x`` in integers: a draft
    is accepted with probability ``min(1, p(x) / q(x))``, never where ``p(x) = 0``."""
    num, den = float(p_x).as_integer_ratio()
    return u53_int * count * den < num << (_U53_SHIFT + _Q_SHIFT)


class Stop(enum.IntEnum):
    """Where a round stopped."""

    EOS = 0
    """An accepted terminal draft: no bonus."""
    CORRECTION = 1
    BONUS = 2
    TARGET = 3
    """The token of a target-only round."""
    BAD_ROW = 4
    """The row the round reached failed its checks (or could not be read)."""
    EMPTY = 5
    """The correction or bonus had no mass to draw from."""


class Decision(NamedTuple):
    """How one round ended: ``accepted`` drafts, then ``token`` (-1: none) drawn
    from the round's row ``row`` (an offset into :attr:`RoundRows.rows`)."""

    stop: Stop
    row: int
    accepted: int
    token: int


class RoundRows(NamedTuple):
    """One round, as the walk needs it: ``rows``, its target rows in the backend's layout
    (one per draft and the bonus); ``counts``, each draft's count at its token (None: read
    when reached); ``start``, the absolute position of the first draft.
    """

    rows: tuple[int, ...]
    drafts: tuple[QRow, ...]
    tokens: tuple[int, ...]
    counts: tuple[int, ...] | None
    seed: int
    generation: int
    round_id: int
    start: int
    eos: int | None
    vocab: int

    def in_rng_range(self) -> bool:
        """Whether every key field of its draws fits the RNG ABI."""
        return (
            0 <= self.seed < 1 << 64
            and 0 <= self.generation <= _U32
            and 0 <= self.round_id <= _U32
            and self.start >= 0
            and self.start + len(self.drafts) <= _U32
        )


class Draw(NamedTuple):
    """A draw from ``row``: from ``max(p - q, 0)`` over the whole vocabulary with ``q``
    (the correction), from ``p`` without (the bonus, the target-only token)."""

    row: int
    q: QRow | None
    u53: int
    vocab: int


class RowOps(Protocol):
    """The row operations of one batch of rounds: each call covers every live round, and
    answers what it is asked, in order (it may compute more)."""

    eager_draws: bool
    """Whether draws are asked for right after their position (rows still in cache), or
    all at the end in one call (one transfer, one set of a group's collectives)."""

    def check(self, rows: Sequence[tuple[int, int]]) -> list[bool]:
        """Whether each (row, vocabulary size) is a distribution: the right shape, finite,
        non-negative, a positive canonical total (kept)."""
        ...

    def p_at(self, asks: Sequence[tuple[int, int]]) -> list[float]:
        """``p(x) = v[x] / total`` of each (checked row, x), bit for bit
        :func:`~pp1wire.q.targetrows.check_target`'s entry."""
        ...

    def draw(self, draws: Sequence[Draw]) -> list[int]:
        """Each :class:`Draw` on a checked row by the tree descent of §6.6; -1 without mass."""
        ...


class RoundDraws:
    """A round's Spark-side draws: the compiled Philox, else
    :class:`~pp1wire.q.rng.RoundStreams` (which refuses fields out of range)."""

    __slots__ = ("_key", "_philox", "_streams")

    def __init__(self, job: RoundRows) -> None:
        """The draws of ``job``'s key.

        Raises:
            RngError: ``RNG_FIELD_RANGE`` for a key outside the RNG ABI.
        """
        philox = getattr(_fastq, "philox_u53", None)
        self._philox: Any = philox if philox is not None and job.in_rng_range() else None
        self._streams: RoundStreams | None = None
        if self._philox is None:  # it refuses a key out of range here, as the ABI's own
            self._streams = RoundStreams(Role.SPARK, job.seed, job.generation, job.round_id)
        self._key = (job.seed, job.generation, job.round_id)

    def u53(self, domain: Domain, position: int) -> int:
        """The 53-bit draw of ``domain`` at ``position``.

        Raises:
            RngError: ``RNG_FIELD_RANGE`` for a position outside the RNG ABI.
        """
        if self._streams is not None:
            return self._streams.u53_int(domain, position)
        seed, generation, round_id = self._key
        return int(self._philox(seed, generation, round_id, position, domain))


_ACCEPTANCE, _CORRECTION, _TARGET = Domain.ACCEPTANCE, Domain.CORRECTION, Domain.TARGET


def walk(jobs: Sequence[RoundRows], ops: RowOps) -> list[Decision]:
    """Decide every round of ``jobs``: one :class:`Decision` each, in order.

    Every live round goes one position at a time: its row checked, then the exact test
    ``u * q(x) < p(x)``; an accepted terminal draft stops without a bonus, a rejection
    draws the correction from ``max(p - q, 0)``, the row after the last draft the bonus
    (a round without drafts: the target-only token). Only rows a round reaches are
    asked for; a draw decides nothing but its own token.

    Raises:
        RngError: a round's key outside the RNG ABI (only a round the caller
            did not check with :meth:`RoundRows.in_rng_range`).
    """
    n = len(jobs)
    out: list[Decision | None] = [None] * n
    keyed = [RoundDraws(j).u53 for j in jobs]
    at, accepted = [0] * n, [0] * n
    draws: list[Draw] = []
    drawing: list[int] = []
    live = list(range(n))
    while live:
        asked = [(jobs[k].rows[at[k]], jobs[k].vocab) for k in live]
        testing: list[int] = []
        asks: list[tuple[int, int]] = []
        for k, (row, vocab), ok in zip(live, asked, ops.check(asked), strict=True):
            job, i = jobs[k], at[k]
            if not ok:
                out[k] = Decision(Stop.BAD_ROW, i, accepted[k], -1)
            elif i < len(job.tokens):
                testing.append(k)
                asks.append((row, job.tokens[i]))
            else:  # the bonus, or the target-only token
                domain = _CORRECTION if job.tokens else _TARGET
                draws.append(Draw(row, None, keyed[k](domain, job.start + i), vocab))
                drawing.append(k)
        live = []
        for k, (row, x), p_x in zip(testing, asks, ops.p_at(asks) if asks else [], strict=True):
            job, i = jobs[k], at[k]
            count = job.drafts[i].count_at(x) if job.counts is None else job.counts[i]
            if accept_exact(keyed[k](_ACCEPTANCE, job.start + i), count, p_x):
                accepted[k] += 1
                if x == job.eos:
                    out[k] = Decision(Stop.EOS, i, accepted[k], -1)
                else:
                    at[k] = i + 1
                    live.append(k)
                continue
            u = keyed[k](_CORRECTION, job.start + i)
            draws.append(Draw(row, job.drafts[i], u, job.vocab))
            drawing.append(k)
        if draws and (ops.eager_draws or not live):
            for k, spec, y in zip(drawing, draws, ops.draw(draws), strict=True):
                if y < 0:
                    stop = Stop.EMPTY
                elif spec.q is not None:
                    stop = Stop.CORRECTION
                else:
                    stop = Stop.BONUS if jobs[k].tokens else Stop.TARGET
                out[k] = Decision(stop, at[k], accepted[k], y)
            draws, drawing = [], []
    done = [d for d in out if d is not None]
    assert len(done) == n  # every round ends once: a bad row, an accepted terminal, or a draw
    return done
