"""Exact rational reference (:class:`fractions.Fraction`) for q, acceptance, the residual,
the fixed-depth and adaptive verifiers and their output laws, for small vocabularies: it
qualifies the numpy paths in tests, never serves traffic (``docs/adaptive.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import floor, isfinite
from typing import NamedTuple, TypeVar

from pp1wire.errors import ConstructionError, ErrorCode, VerifyError
from pp1wire.q.dyadic import M
from pp1wire.q.proposal import MAX_DEPTH
from pp1wire.q.stoprules import StopRule, continues

Dist = list[Fraction]
Prefix = tuple[int, ...]
DistFn = Callable[[Prefix], Sequence[Fraction]]
_K = TypeVar("_K")


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


def _add(dist: dict[_K, Fraction], key: _K, mass: Fraction) -> None:
    if mass:
        dist[key] = dist.get(key, Fraction(0)) + mass


def round_distribution(
    prefix: Prefix, depth: int, q_fn: DistFn, p_fn: DistFn, eos: int | None = None
) -> dict[Prefix, Fraction]:
    """Exact law of the tokens one fixed-depth round commits after ``prefix`` (each q
    conditioned on the earlier drafts; only a drafted terminal token shortens the block).

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
    prefix: Prefix, length: int, depth: int, q_fn: DistFn, p_fn: DistFn, eos: int | None = None
) -> dict[Prefix, Fraction]:
    """Exact law of the first ``length`` tokens under repeated rounds (one ending in
    ``eos`` earlier is kept as is)."""
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
    """Law of one token when a draw x from q is verified only if ``admit(x)``, else
    discarded for a target-only token: an anticipating rule, kept to show its bias."""
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


# -- adaptive blocks (docs/adaptive.md) ------------------------------------------

Admit = Callable[[Prefix, Prefix, tuple[Fraction, ...]], Fraction | bool]
"""A legal stop rule: ``(context, drafts x_1..x_i, (q_1(x_1), ..., q_i(x_i)))`` → the
probability of drawing position i+1, from draws already made only."""

Revoke = Callable[[Prefix, Prefix, tuple[Fraction, ...]], bool]
"""An anticipating worker (forbidden; kept to show its bias): after drawing x_i,
whether to drop it and end the block at i - 1."""

Fault = Callable[[Prefix, Prefix], Fraction | bool]
"""A fault: ``(context, drafts x_1..x_i)`` → the probability that row i+1 is lost, a
function of the drafts before it, never of its own draw (``docs/adaptive.md`` §7)."""

DRAFT, BONUS, TARGET = "d", "b", "t"
"""How a committed token was produced: at a drafted position, as the bonus, or target-only."""


class RoundOutcome(NamedTuple):
    """One round's committed tokens, how each was produced, and its verification result."""

    tokens: Prefix
    kinds: tuple[str, ...]
    accepted: int
    rejected: bool


@dataclass(frozen=True)
class Drafting:
    """How one round drafts: a maximum depth (0: target-only), a stop rule (``None``:
    fixed), a (forbidden) revocation, and faults; a fault's block is verified as stopped
    there, or with ``discard_on_fault`` (kept to show its bias) discarded whole.
    """

    depth: int
    admit: Admit | None = None
    revoke: Revoke | None = None
    fault: Fault | None = None
    discard_on_fault: bool = False


Planner = Callable[[Prefix, tuple[RoundOutcome, ...]], Sequence[tuple[Fraction, Drafting]]]
"""A law over :class:`Drafting` from the committed context and the earlier outcomes."""

Marks = tuple[tuple[int, str], ...]
"""Per committed token: its index within its round and its kind (DRAFT, BONUS, TARGET)."""


def dyadic_count(qx: Fraction) -> int:
    """The 24-bit count ``q(x) * 2**24`` of a dyadic24 probability.

    Raises:
        VerifyError: ``MALFORMED_PROPOSAL`` if ``q(x) * 2**24`` is not an integer in 0..2**24.
    """
    c = qx * M
    if c.denominator != 1 or not 0 <= c <= M:
        raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, f"q(x) = {qx} is not dyadic24")
    return int(c)


def rule_admission(rule: StopRule) -> Admit:
    """The :data:`Admit` of an integer stop rule, fed the rows' counts at their tokens."""

    def admit(_context: Prefix, _drafts: Prefix, qs: tuple[Fraction, ...]) -> bool:
        return continues(rule, [dyadic_count(v) for v in qs])

    return admit


def _go(drafting: Drafting, context: Prefix, drawn: Prefix, qs: tuple[Fraction, ...]) -> Fraction:
    if len(drawn) >= drafting.depth:
        return Fraction(0)
    if drafting.admit is None:
        return Fraction(1)
    go = Fraction(drafting.admit(context, drawn, qs))
    if not 0 <= go <= 1:
        raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, f"admission probability {go} not in [0, 1]")
    return go


def _lost(drafting: Drafting, context: Prefix, drawn: Prefix) -> Fraction:
    """The chance that the row after ``drawn`` is lost (0 without a fault model)."""
    if drafting.fault is None:
        return Fraction(0)
    f = Fraction(drafting.fault(context, drawn))
    if not 0 <= f <= 1:
        raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, f"fault probability {f} not in [0, 1]")
    return f


def _check_depth(depth: int) -> None:
    if not 0 <= depth <= MAX_DEPTH:
        raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, f"depth {depth} outside 0..{MAX_DEPTH}")


def adaptive_round_distribution(
    prefix: Prefix, drafting: Drafting, q_fn: DistFn, p_fn: DistFn, eos: int | None = None
) -> dict[RoundOutcome, Fraction]:
    """Exact law of one round's outcome under ``drafting``.

    After an accepted-so-far draw x_i ``admit`` gives the chance of drawing i+1; a block with every
    draft kept gets a bonus, one with none a target-only token. Drafting and verifying interleaved
    give the law of drafting first: no decision uses the verifier's draws.

    Raises:
        VerifyError: ``MALFORMED_PROPOSAL`` for a depth outside 0..5 or an
            admission or fault probability outside [0, 1].
    """
    _check_depth(drafting.depth)
    if drafting.fault is not None and drafting.discard_on_fault:
        return _discarding_round_distribution(prefix, drafting, q_fn, p_fn, eos)
    out: dict[RoundOutcome, Fraction] = {}

    def close(drafts: Prefix, mass: Fraction) -> None:
        kind = BONUS if drafts else TARGET
        kinds = (DRAFT,) * len(drafts) + (kind,)
        for b, pb in enumerate(p_fn(prefix + drafts)):
            _add(out, RoundOutcome((*drafts, b), kinds, len(drafts), False), mass * pb)

    def walk(drafts: Prefix, qs: tuple[Fraction, ...], mass: Fraction) -> None:
        lost = _lost(drafting, prefix, drafts)
        if lost:  # the row is lost before its draw: the block is the rows before it
            close(drafts, mass * lost)
            mass *= 1 - lost
            if not mass:
                return
        ctx = prefix + drafts
        p = list(p_fn(ctx))
        q = list(q_fn(ctx))
        reject_total = Fraction(0)
        for x, qx in enumerate(q):
            if not qx:
                continue
            drawn, qs_x = (*drafts, x), (*qs, qx)
            if drafting.revoke is not None and drafting.revoke(prefix, drawn, qs_x):
                close(drafts, mass * qx)
                continue
            a = acceptance(p, q, x)
            reject_total += qx * (1 - a)
            if not a:
                continue
            kept = mass * qx * a
            if x == eos:
                _add(out, RoundOutcome(drawn, (DRAFT,) * len(drawn), len(drawn), False), kept)
                continue
            go = _go(drafting, prefix, drawn, qs_x)
            if go:
                walk(drawn, qs_x, kept * go)
            if go != 1:
                close(drawn, kept * (1 - go))
        if reject_total:
            kinds = (DRAFT,) * (len(drafts) + 1)
            rejected = mass * reject_total
            for y, ry in enumerate(residual(p, q)):
                _add(out, RoundOutcome((*drafts, y), kinds, len(drafts), True), rejected * ry)

    if drafting.depth == 0:
        close((), Fraction(1))
    else:
        walk((), (), Fraction(1))
    return out


def _discarding_round_distribution(
    prefix: Prefix, drafting: Drafting, q_fn: DistFn, p_fn: DistFn, eos: int | None
) -> dict[RoundOutcome, Fraction]:
    """One round under the whole-block discard: a fault at any row loses the block, then
    the round is target-only (the discard depends on drafts a rejection never reaches)."""
    out: dict[RoundOutcome, Fraction] = {}
    blocks: dict[Prefix | None, Fraction] = {}  # None: the block was lost

    def walk(drafts: Prefix, qs: tuple[Fraction, ...], mass: Fraction) -> None:
        lost = _lost(drafting, prefix, drafts)
        if lost:
            _add(blocks, None, mass * lost)
            mass *= 1 - lost
            if not mass:
                return
        for x, qx in enumerate(q_fn(prefix + drafts)):
            if not qx:
                continue
            drawn, qs_x = (*drafts, x), (*qs, qx)
            go = Fraction(0) if x == eos else _go(drafting, prefix, drawn, qs_x)
            if go:
                walk(drawn, qs_x, mass * qx * go)
            if go != 1:
                _add(blocks, drawn, mass * qx * (1 - go))

    walk((), (), Fraction(1))
    for block, mass in blocks.items():
        for outcome, m in _verified_outcomes(prefix, block or (), q_fn, p_fn, eos).items():
            _add(out, outcome, mass * m)
    return out


def _verified_outcomes(
    prefix: Prefix, drafts: Prefix, q_fn: DistFn, p_fn: DistFn, eos: int | None
) -> dict[RoundOutcome, Fraction]:
    """:func:`verify_block_distribution` with the outcomes' marks kept (raises as it does)."""
    out: dict[RoundOutcome, Fraction] = {}
    mass = Fraction(1)
    for i, x in enumerate(drafts):
        ctx = prefix + drafts[:i]
        p, q = list(p_fn(ctx)), list(q_fn(ctx))
        a = acceptance(p, q, x)
        if a != 1:
            kinds = (DRAFT,) * (i + 1)
            for y, ry in enumerate(residual(p, q)):
                _add(out, RoundOutcome((*drafts[:i], y), kinds, i, True), mass * (1 - a) * ry)
        mass *= a
        if not mass:
            return out
    if drafts and drafts[-1] == eos:
        _add(out, RoundOutcome(drafts, (DRAFT,) * len(drafts), len(drafts), False), mass)
        return out
    kinds = (DRAFT,) * len(drafts) + ((BONUS if drafts else TARGET),)
    for b, pb in enumerate(p_fn(prefix + drafts)):
        _add(out, RoundOutcome((*drafts, b), kinds, len(drafts), False), mass * pb)
    return out


def proposal_distribution(
    prefix: Prefix, drafting: Drafting, q_fn: DistFn, eos: int | None = None
) -> dict[tuple[Prefix, tuple[int, ...]], Fraction]:
    """Exact law of the rows a worker ships, ``(tokens, counts at the tokens)`` (a revoked
    position is not shipped).

    Raises:
        VerifyError: as :func:`adaptive_round_distribution`, or
            ``MALFORMED_PROPOSAL`` for a q that is not dyadic24.
    """
    _check_depth(drafting.depth)
    out: dict[tuple[Prefix, tuple[int, ...]], Fraction] = {}

    def ship(drafts: Prefix, qs: tuple[Fraction, ...], mass: Fraction) -> None:
        _add(out, (drafts, tuple(dyadic_count(v) for v in qs)), mass)

    def walk(drafts: Prefix, qs: tuple[Fraction, ...], mass: Fraction) -> None:
        for x, qx in enumerate(q_fn(prefix + drafts)):
            if not qx:
                continue
            drawn, qs_x = (*drafts, x), (*qs, qx)
            if drafting.revoke is not None and drafting.revoke(prefix, drawn, qs_x):
                ship(drafts, qs, mass * qx)
                continue
            go = Fraction(0) if x == eos else _go(drafting, prefix, drawn, qs_x)
            if go:
                walk(drawn, qs_x, mass * qx * go)
            if go != 1:
                ship(drawn, qs_x, mass * qx * (1 - go))

    if drafting.depth:
        walk((), (), Fraction(1))
    return out


def verify_block_distribution(
    prefix: Prefix, drafts: Prefix, q_fn: DistFn, p_fn: DistFn, eos: int | None = None
) -> dict[Prefix, Fraction]:
    """Exact law of the tokens the verifier commits for the shipped block ``drafts`` (an
    empty block commits one target-only token).

    Raises:
        VerifyError: ``MALFORMED_PROPOSAL`` for a draft with q(x) = 0.
    """
    out: dict[Prefix, Fraction] = {}
    for outcome, mass in _verified_outcomes(prefix, drafts, q_fn, p_fn, eos).items():
        _add(out, outcome.tokens, mass)
    return out


def adaptive_generate_distribution(
    prefix: Prefix,
    length: int,
    planner: Planner,
    q_fn: DistFn,
    p_fn: DistFn,
    eos: int | None = None,
) -> dict[tuple[Prefix, Marks], Fraction]:
    """Exact joint law of the first ``length`` committed tokens and their :data:`Marks`,
    each round planned by ``planner``.

    Raises:
        VerifyError: ``MALFORMED_PROPOSAL`` for a plan whose weights are not a
            law, or as :func:`adaptive_round_distribution`.
    """
    out: dict[tuple[Prefix, Marks], Fraction] = {}
    rounds: dict[tuple[Prefix, Drafting], dict[RoundOutcome, Fraction]] = {}

    def walk(
        generated: Prefix, marks: Marks, history: tuple[RoundOutcome, ...], mass: Fraction
    ) -> None:
        if len(generated) >= length or (generated and generated[-1] == eos):
            _add(out, (generated[:length], marks[:length]), mass)
            return
        ctx = prefix + generated
        plan = planner(ctx, history)
        weights = [Fraction(w) for w, _ in plan]
        if any(w < 0 for w in weights) or sum(weights) != 1:
            raise VerifyError(ErrorCode.MALFORMED_PROPOSAL, "a plan's weights must form a law")
        for w, (_, drafting) in zip(weights, plan, strict=True):
            if not w:
                continue
            key = (ctx, drafting)
            if key not in rounds:
                rounds[key] = adaptive_round_distribution(ctx, drafting, q_fn, p_fn, eos)
            for outcome, m in rounds[key].items():
                walk(
                    generated + outcome.tokens,
                    marks + tuple(enumerate(outcome.kinds)),
                    (*history, outcome),
                    mass * w * m,
                )

    walk((), (), (), Fraction(1))
    return out


def token_law(law: dict[tuple[Prefix, Marks], Fraction]) -> dict[Prefix, Fraction]:
    """The tokens' marginal of an :func:`adaptive_generate_distribution` law."""
    out: dict[Prefix, Fraction] = {}
    for (tokens, _), mass in law.items():
        _add(out, tokens, mass)
    return out


def conditional_laws(
    law: dict[tuple[Prefix, Marks], Fraction], with_marks: bool = True
) -> dict[tuple[Prefix, Marks], dict[int, Fraction]]:
    """Law of token k+1 given tokens 1..k (with marks: and the marks of tokens 1..k+1), keyed
    ``(tokens 1..k, marks)``; a correct scheme gives p(. | tokens 1..k) either way."""
    joint: dict[tuple[Prefix, Marks], dict[int, Fraction]] = {}
    for (tokens, marks), mass in law.items():
        for k in range(len(tokens)):
            cond = (tokens[:k], marks[: k + 1] if with_marks else ())
            row = joint.setdefault(cond, {})
            row[tokens[k]] = row.get(tokens[k], Fraction(0)) + mass
    out: dict[tuple[Prefix, Marks], dict[int, Fraction]] = {}
    for cond, row in joint.items():
        total = sum(row.values(), Fraction(0))
        out[cond] = {v: m / total for v, m in row.items()}
    return out


# -- FP32 weights: what a probabilities drafter hands over (docs/protocol.md §6.1) --

_FP32_MANTISSA = 24  # significand bits, the implicit one included
_FP32_MIN_EXP = -126  # exponent of the smallest normal
_FP32_LIMIT = Fraction(2**128)  # the first power of two beyond the largest finite value


def round_fp32(value: float | int | Fraction) -> Fraction | float:
    """``value`` rounded to binary32 (ties to even) as an exact rational; ``±inf`` beyond
    the largest finite value.

    Raises:
        ConstructionError: ``WEIGHT_NON_FINITE`` for NaN or infinities.
    """
    x = exact(value)
    if x == 0:
        return Fraction(0)
    sign = 1 if x > 0 else -1
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:  # 2**e <= a < 2**(e + 1)
        e -= 1
    unit = Fraction(2) ** (max(e, _FP32_MIN_EXP) - (_FP32_MANTISSA - 1))
    scaled = a / unit
    m = floor(scaled)
    rest = scaled - m
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and m % 2):
        m += 1
    rounded = m * unit
    if rounded >= _FP32_LIMIT:
        return sign * float("inf")
    return sign * rounded


def fp32_weights(weights: Sequence[float | int | Fraction]) -> Dist:
    """The exact normalization w / Σw of the weights rounded to FP32 (:func:`round_fp32`:
    beyond the range is refused, an underflow is a zero weight).

    Raises:
        ConstructionError: ``WEIGHT_NON_FINITE`` (NaN, infinity, or beyond the
            FP32 range), ``WEIGHT_NEGATIVE`` or ``ZERO_MASS``, in that order.
    """
    rounded: list[Fraction] = []
    for v in weights:
        r = round_fp32(v)
        if isinstance(r, float):
            raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "a weight beyond the FP32 range")
        rounded.append(r)
    return normalize(rounded)


def fp32_dyadic_counts(weights: Sequence[float | int | Fraction]) -> list[int]:
    """:func:`dyadic_counts` of :func:`fp32_weights`: what the binary64 rule of §6.1 approximates.

    Raises:
        ConstructionError: as :func:`fp32_weights`.
    """
    return dyadic_counts(fp32_weights(weights))
