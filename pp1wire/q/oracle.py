"""Exact reference for q, acceptance, residual and the fixed-depth block verifier.

Everything here is rational arithmetic (:class:`fractions.Fraction`) and
integers, for small vocabularies. Float inputs mean their exact binary64
values. It exists to qualify the numpy paths in :mod:`pp1wire.q.dyadic`,
:mod:`pp1wire.q.proposal` and :mod:`pp1wire.q.verify`, never to serve traffic.

The verifier is the standard tokenwise algorithm (Leviathan et al. 2023,
algorithm 1 and appendix A.1): accept a draft x with probability
``min(1, p(x)/q(x))``; at the first rejection draw a correction from the
normalized ``max(p - q, 0)`` over every target ID; if every draft survives,
draw a bonus token from p. An accepted terminal token stops without a bonus.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from math import floor, isfinite

from pp1wire.errors import ConstructionError, ErrorCode, VerifyError
from pp1wire.q.dyadic import M

Dist = list[Fraction]
Prefix = tuple[int, ...]
DistFn = Callable[[Prefix], Sequence[Fraction]]


def exact(value: float | int | Fraction) -> Fraction:
    """The exact rational value of a number (a float means its binary64 value).

    Raises:
        ConstructionError: ``WEIGHT_NON_FINITE`` for NaN or infinities.
    """
    if isinstance(value, float) and not isfinite(value):
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, f"{value!r} is not finite")
    return Fraction(value)


def normalize(weights: Sequence[float | int | Fraction]) -> Dist:
    """Exact normalization of non-negative weights.

    Raises:
        ConstructionError: ``WEIGHT_NON_FINITE``, ``WEIGHT_NEGATIVE`` or ``ZERO_MASS``.
    """
    w = [exact(v) for v in weights]
    if any(v < 0 for v in w):
        raise ConstructionError(ErrorCode.WEIGHT_NEGATIVE, "negative weight")
    total = sum(w, Fraction(0))
    if total == 0:
        raise ConstructionError(ErrorCode.ZERO_MASS, "zero total mass")
    return [v / total for v in w]


def dyadic_counts(weights: Sequence[float | int | Fraction]) -> list[int]:
    """Exact floor-plus-largest-remainder allocation of M tickets (ties to lowest ID).

    Raises:
        ConstructionError: as :func:`normalize`.
    """
    q = normalize(weights)
    shares = [v * M for v in q]
    counts = [floor(s) for s in shares]
    remaining = M - sum(counts)
    order = sorted(range(len(q)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in order[:remaining]:
        counts[i] += 1
    return counts


def sparse_dyadic_counts(weights: Sequence[float | int | Fraction], k: int) -> dict[int, int]:
    """Exact sparse top-k allocation: ``{id: count}`` with zero counts dropped.

    Raises:
        ConstructionError: as :func:`normalize`, or ``BAD_SHAPE`` for k < 1.
    """
    if k < 1:
        raise ConstructionError(ErrorCode.BAD_SHAPE, "k must be >= 1")
    w = [exact(v) for v in weights]
    normalize(w)  # validity checks only
    ranked = sorted((i for i in range(len(w)) if w[i] > 0), key=lambda i: (-w[i], i))
    support = sorted(ranked[:k])
    counts = dyadic_counts([w[i] for i in support])
    return {i: c for i, c in zip(support, counts, strict=True) if c}


def q_from_counts(counts: Sequence[int]) -> Dist:
    """q(v) = c_v / M."""
    return [Fraction(c, M) for c in counts]


def acceptance(p: Sequence[Fraction], q: Sequence[Fraction], x: int) -> Fraction:
    """``min(1, p(x)/q(x))`` for a proposed x with q(x) > 0.

    Raises:
        VerifyError: ``MALFORMED_PROPOSAL`` if q(x) is zero.
    """
    if q[x] <= 0:
        raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, "q(x) is zero")
    return min(Fraction(1), p[x] / q[x])


def accepted_mass(p: Sequence[Fraction], q: Sequence[Fraction]) -> Dist:
    """Mass accepted at each v in one position: ``q(v) * acceptance = min(p(v), q(v))``."""
    return [q[v] * acceptance(p, q, v) if q[v] > 0 else Fraction(0) for v in range(len(q))]


def rejection_mass(p: Sequence[Fraction], q: Sequence[Fraction]) -> Fraction:
    """Total rejection probability ``sum_v max(p(v) - q(v), 0)``."""
    return sum((max(pv - qv, Fraction(0)) for pv, qv in zip(p, q, strict=True)), Fraction(0))


def residual(p: Sequence[Fraction], q: Sequence[Fraction]) -> Dist:
    """``normalize(max(p - q, 0))`` over every target ID.

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` when p == q (no rejection is possible then).
    """
    r = [max(pv - qv, Fraction(0)) for pv, qv in zip(p, q, strict=True)]
    total = sum(r, Fraction(0))
    if total == 0:
        raise VerifyError(ErrorCode.EMPTY_RESIDUAL, "residual has zero mass")
    return [v / total for v in r]


def step_distribution(p: Sequence[Fraction], q: Sequence[Fraction]) -> Dist:
    """Exact output law of one draft position (draw from q, then verify)."""
    out = accepted_mass(p, q)
    reject = rejection_mass(p, q)
    if reject:
        out = [a + reject * r for a, r in zip(out, residual(p, q), strict=True)]
    return out


def _add(dist: dict[Prefix, Fraction], key: Prefix, mass: Fraction) -> None:
    if mass:
        dist[key] = dist.get(key, Fraction(0)) + mass


def round_distribution(
    prefix: Prefix, depth: int, q_fn: DistFn, p_fn: DistFn, eos: int | None = None
) -> dict[Prefix, Fraction]:
    """Exact law of the tokens one fixed-depth round commits after ``prefix``.

    Depth is fixed before any draw; each q is conditioned on the earlier drafts;
    only a drafted terminal token shortens the block.

    Raises:
        VerifyError: ``MALFORMED_PROPOSAL`` unless ``1 <= depth``.
    """
    if depth < 1:
        raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, "depth must be >= 1")
    out: dict[Prefix, Fraction] = {}

    def walk(drafts: Prefix, mass: Fraction) -> None:
        ctx = prefix + drafts
        p = list(p_fn(ctx))
        if len(drafts) == depth:
            for b, pb in enumerate(p):
                _add(out, (*drafts, b), mass * pb)
            return
        q = list(q_fn(ctx))
        reject_total = Fraction(0)
        for x, qx in enumerate(q):
            if not qx:
                continue
            a = acceptance(p, q, x)
            if a:
                if x == eos:
                    _add(out, (*drafts, x), mass * qx * a)
                else:
                    walk((*drafts, x), mass * qx * a)
            reject_total += qx * (1 - a)
        if reject_total:
            for y, ry in enumerate(residual(p, q)):
                _add(out, (*drafts, y), mass * reject_total * ry)

    walk((), Fraction(1))
    return out


def generate_distribution(
    prefix: Prefix,
    length: int,
    depth: int,
    q_fn: DistFn,
    p_fn: DistFn,
    eos: int | None = None,
) -> dict[Prefix, Fraction]:
    """Exact law of the first ``length`` generated tokens under repeated rounds.

    A sequence that ends in ``eos`` before ``length`` tokens is kept as is.
    """
    out: dict[Prefix, Fraction] = {}

    def walk(generated: Prefix, mass: Fraction) -> None:
        if len(generated) >= length or (generated and generated[-1] == eos):
            _add(out, generated[:length], mass)
            return
        for block, pb in round_distribution(prefix + generated, depth, q_fn, p_fn, eos).items():
            walk(generated + block, mass * pb)

    walk((), Fraction(1))
    return out


def target_only_distribution(
    prefix: Prefix, length: int, p_fn: DistFn, eos: int | None = None
) -> dict[Prefix, Fraction]:
    """Exact law of the first ``length`` tokens sampled from the target alone."""
    out: dict[Prefix, Fraction] = {}

    def walk(generated: Prefix, mass: Fraction) -> None:
        if len(generated) >= length or (generated and generated[-1] == eos):
            _add(out, generated, mass)
            return
        for v, pv in enumerate(p_fn(prefix + generated)):
            if pv:
                walk((*generated, v), mass * pv)

    walk((), Fraction(1))
    return out


def selective_admission_distribution(
    p: Sequence[Fraction], q: Sequence[Fraction], admit: Callable[[int], bool]
) -> Dist:
    """Law of one token under an *anticipating* admission rule (the known bias).

    Draw x from q; if ``admit(x)`` verify it as usual, else discard it and draw
    target-only from p. This inspects its own draw before deciding to verify,
    which the fixed-depth design forbids; it is kept to show the bias.
    """
    out = [Fraction(0)] * len(p)
    for x, qx in enumerate(q):
        if not qx:
            continue
        if admit(x):
            a = acceptance(p, q, x)
            out[x] += qx * a
            if a != 1:
                for y, ry in enumerate(residual(p, q)):
                    out[y] += qx * (1 - a) * ry
        else:
            for y, py in enumerate(p):
                out[y] += qx * py
    return out
