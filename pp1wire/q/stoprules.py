"""Stop rules for adaptive blocks (``pp1-stop-rules-v1``, defined in ``docs/adaptive.md`` §1):
integer decisions from each row's shipped count at its token, so the Spark side recomputes
and audits them; and a depth controller that sees only a request's earlier rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from enum import IntEnum
from fractions import Fraction

from pp1wire.errors import ErrorCode
from pp1wire.q.dyadic import M

MAX_DEPTH = 5
"""The longest block (PP1 v2's ``max_depth`` bound)."""

STOP_RULES = "pp1-stop-rules-v1"
"""Name of this rule set, negotiated at HELLO by exact match: a changed definition gets a
new name."""

_SHIFT = 24

__all__ = [
    "FIXED",
    "MAX_DEPTH",
    "STOP_RULES",
    "AcceptanceHistory",
    "DepthController",
    "DepthPolicy",
    "StopKind",
    "StopRule",
    "admits_next",
    "audit",
    "continues",
    "step_rule",
    "stop_after",
    "stopped_by_rule",
    "threshold_of",
]


class StopKind(IntEnum):
    """The rule kinds; the values are their wire codes."""

    FIXED = 0
    CONFIDENCE = 1
    JOINT = 2


_NAMES = {StopKind.FIXED: "fixed", StopKind.CONFIDENCE: "confidence", StopKind.JOINT: "joint"}
_KINDS = {name: kind for kind, name in _NAMES.items()}


_MAX_TEXT = 64
# Below 10**-30 every positive tau has T = 1 (1 / M is about 6e-8); deciding
# that from the exponent keeps Fraction from expanding 10**huge.
_TINY_EXPONENT = -30


def threshold_of(tau: Fraction | Decimal | int | float | str) -> int:
    """``ceil(tau * 2**24)`` for a rational ``tau`` in [0, 1], computed exactly: a float is
    its binary64 value, a string (at most 64 characters) a decimal or a fraction (``"3/10"``).

    Raises:
        ValueError: if ``tau`` is not a finite number in [0, 1].
    """
    if isinstance(tau, bool):
        raise ValueError("a threshold is a number, not a bool")
    if isinstance(tau, str):
        text = tau.strip()
        if len(text) > _MAX_TEXT:
            raise ValueError(f"threshold text longer than {_MAX_TEXT} characters")
        try:
            tau = Decimal(text)
        except InvalidOperation:
            try:
                tau = Fraction(text)
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"threshold {text!r} is not a number") from None
    if isinstance(tau, float) and not math.isfinite(tau):
        raise ValueError(f"threshold {tau!r} is not finite")
    if isinstance(tau, Decimal):
        if not tau.is_finite():
            raise ValueError(f"threshold {str(tau)!r} is not finite")
        if 0 < tau <= 1 and tau.adjusted() < _TINY_EXPONENT:
            return 1
        if not 0 <= tau <= 1:
            raise ValueError(f"threshold {str(tau)!r} outside [0, 1]")
    value = Fraction(tau)
    if not 0 <= value <= 1:
        raise ValueError(f"threshold {tau!r} outside [0, 1]")
    return math.ceil(value * M)


def _shortest_decimal(threshold: int) -> str:
    """The shortest decimal tau with ``ceil(tau * M) == threshold``."""
    if threshold == 0:
        return "0"
    if threshold == M:
        return "1"
    # The taus that map to T form the interval ((T - 1) / M, T / M]; the
    # largest k-digit decimal not above T / M is in it for some k <= 24.
    for digits in range(1, _SHIFT + 1):
        scale = 10**digits
        num = threshold * scale // M
        if num * M > (threshold - 1) * scale:
            text = f"{num:0{digits + 1}d}"
            return f"{text[:-digits]}.{text[-digits:]}".rstrip("0")
    raise AssertionError("unreachable: T / M has at most 24 decimal digits")


@dataclass(frozen=True)
class StopRule:
    """One stop rule: a kind and its integer threshold ``T`` in 0..2**24 (0 for ``FIXED``).

    Raises:
        ValueError: for an unknown kind, a threshold outside 0..2**24, or a
            FIXED rule with a non-zero threshold.
    """

    kind: StopKind = StopKind.FIXED
    threshold: int = 0

    def __post_init__(self) -> None:
        try:
            kind = StopKind(self.kind)
        except ValueError:
            raise ValueError(f"unknown stop rule kind {self.kind!r}") from None
        object.__setattr__(self, "kind", kind)
        if type(self.threshold) is not int or not 0 <= self.threshold <= M:
            raise ValueError(f"threshold {self.threshold!r} outside 0..{M}")
        if kind is StopKind.FIXED and self.threshold:
            raise ValueError("the fixed rule has no threshold")

    @classmethod
    def confidence(cls, tau: Fraction | Decimal | int | float | str) -> StopRule:
        """``confidence(tau)``: continue after row i iff ``c_i >= ceil(tau * 2**24)``.

        Raises:
            ValueError: as :func:`threshold_of`.
        """
        return cls(StopKind.CONFIDENCE, threshold_of(tau))

    @classmethod
    def joint(cls, tau: Fraction | Decimal | int | float | str) -> StopRule:
        """``joint(tau)``: continue while the product of the rows' q at their tokens is >= T/2**24.

        Raises:
            ValueError: as :func:`threshold_of`.
        """
        return cls(StopKind.JOINT, threshold_of(tau))

    @classmethod
    def parse(cls, text: str) -> StopRule:
        """Read ``fixed``, ``confidence:TAU`` or ``joint:TAU`` (TAU a decimal or a fraction).

        Raises:
            ValueError: naming what is wrong (kind, threshold).
        """
        name, sep, arg = text.strip().partition(":")
        kind = _KINDS.get(name.strip().lower())
        if kind is None:
            known = ", ".join(f"{n}:TAU" if k else n for k, n in _NAMES.items())
            raise ValueError(f"unknown stop rule {text!r} (known: {known})")
        if kind is StopKind.FIXED:
            if sep:
                raise ValueError(f"the fixed rule takes no threshold: {text!r}")
            return cls()
        if not arg.strip():
            raise ValueError(f"{name} needs a threshold in [0, 1], as in {name}:0.5")
        return cls(kind, threshold_of(arg))

    @property
    def tau(self) -> Fraction:
        """The threshold as a probability, ``T / 2**24``."""
        return Fraction(self.threshold, M)

    def __str__(self) -> str:
        """The text :meth:`parse` reads back to this rule (the shortest such decimal)."""
        if self.kind is StopKind.FIXED:
            return "fixed"
        return f"{_NAMES[self.kind]}:{_shortest_decimal(self.threshold)}"


FIXED = StopRule()
"""The default rule: only the depth or a terminal token ends a block."""


def step_rule(kind: int, threshold: int, negotiated: str) -> StopRule | ErrorCode:
    """The rule a STEP's ``stop`` and ``threshold`` fields name, or ``BAD_STOP_RULE``: an
    invalid rule, or one other than FIXED where HELLO did not negotiate it (``negotiated``:
    :data:`STOP_RULES` or ``""``)."""
    try:
        rule = StopRule(StopKind(kind), threshold)
    except ValueError:
        return ErrorCode.BAD_STOP_RULE
    if rule.kind is not StopKind.FIXED and negotiated != STOP_RULES:
        return ErrorCode.BAD_STOP_RULE
    return rule


def stopped_by_rule(depth: int, tokens: Sequence[int], eos: int | None) -> bool:
    """Whether a block of these drafted tokens ended before its depth without a terminal
    token: only a stop rule ends a block there (COMPLETION's ``stopped``)."""
    return len(tokens) < depth and not (tokens and eos is not None and tokens[-1] == eos)


def _check_block(depth: int, counts: Sequence[int], tokens: Sequence[int]) -> None:
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"depth {depth} outside 1..{MAX_DEPTH}")
    if len(tokens) != len(counts):
        raise ValueError(f"{len(counts)} counts for {len(tokens)} tokens")


def _check_counts(counts: Sequence[int]) -> None:
    if not counts:
        raise ValueError("a stop decision needs at least one drawn row")
    for c in counts:
        if not 0 <= c <= M:
            raise ValueError(f"count {c!r} outside 0..{M}")


def continues(rule: StopRule, counts: Sequence[int]) -> bool:
    """Whether the rule lets position i+1 be drawn after rows 1..i (``counts[j - 1]``: row j's
    count at its token); depth and terminal tokens are :func:`admits_next`'s business.

    Raises:
        ValueError: for no rows or a count outside 0..2**24.
    """
    _check_counts(counts)
    if rule.kind is StopKind.FIXED:
        return True
    if rule.kind is StopKind.CONFIDENCE:
        return counts[-1] >= rule.threshold
    # prod_j (c_j / M) >= T / M  <=>  prod_j c_j >= T * M**(i - 1), all integers.
    return math.prod(counts) >= rule.threshold << (_SHIFT * (len(counts) - 1))


def admits_next(
    rule: StopRule, depth: int, counts: Sequence[int], tokens: Sequence[int], eos: int | None
) -> bool:
    """Whether a worker that has drawn these rows draws another: not at the maximum depth,
    after a terminal token, or when the rule stops.

    Raises:
        ValueError: for a depth outside 1..5, rows and tokens of different
            lengths, more rows than the depth, or as :func:`continues`.
    """
    _check_block(depth, counts, tokens)
    if len(counts) > depth:
        raise ValueError(f"{len(counts)} rows for depth {depth}")
    _check_counts(counts)  # before tokens[-1]: no rows is a ValueError, not an IndexError
    if len(counts) == depth or (eos is not None and tokens[-1] == eos):
        return False
    return continues(rule, counts)


def stop_after(
    rule: StopRule, depth: int, counts: Sequence[int], tokens: Sequence[int], eos: int | None
) -> int | None:
    """After how many of these rows the rule ends the block (rows past the depth too); ``None``
    if the worker owed another row.

    Raises:
        ValueError: for a depth outside 1..5, no rows, rows and tokens of
            different lengths, or a count outside 0..2**24.
    """
    _check_block(depth, counts, tokens)
    _check_counts(counts)
    for i in range(1, min(len(counts), depth) + 1):
        if i == depth or (eos is not None and tokens[i - 1] == eos):
            return i
        if not continues(rule, counts[:i]):
            return i
    return None


def audit(
    rule: StopRule,
    depth: int,
    counts: Sequence[int],
    tokens: Sequence[int],
    eos: int | None,
    *,
    cut: bool = False,
) -> ErrorCode | None:
    """The Spark side's check of one received block: ``None`` if it stopped where the rule
    says, else ``STOP_RULE_VIOLATED`` (a row after the end, or an end where the rule
    continues; an empty block is early). A block ``cut`` by a fault may end early, never late.

    Raises:
        ValueError: for a depth outside 1..5, rows and tokens of different
            lengths, or a count outside 0..2**24 (rows are validated first).
    """
    if not counts and not tokens:
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"depth {depth} outside 1..{MAX_DEPTH}")
        return ErrorCode.STOP_RULE_VIOLATED
    end = stop_after(rule, depth, counts, tokens, eos)
    if end is None:
        return None if cut else ErrorCode.STOP_RULE_VIOLATED
    if end != len(counts):
        return ErrorCode.STOP_RULE_VIOLATED
    return None


@dataclass(frozen=True)
class AcceptanceHistory:
    """One request's last verified rounds, ``(accepted drafts, whether a draft was rejected)``;
    target-only rounds are not recorded."""

    rounds: tuple[tuple[int, bool], ...] = ()

    @property
    def accepted(self) -> int:
        """Drafts accepted over the remembered rounds."""
        return sum(a for a, _ in self.rounds)

    @property
    def rejected(self) -> int:
        """Drafts rejected over the remembered rounds (at most one per round)."""
        return sum(1 for _, r in self.rounds if r)


def _nonneg_fraction(value: Fraction | int | str, what: str) -> Fraction:
    out = Fraction(value)
    if out < 0:
        raise ValueError(f"{what} {value!r} is negative")
    return out


@dataclass(frozen=True)
class DepthPolicy:
    """The controller's exact constants: ``max_depth`` (1..5), ``window`` (rounds remembered),
    the acceptance estimate's pseudo-counts, and the costs of a drafted row and of one
    slot's verified row, in units of one target batch call.

    Raises:
        ValueError: for a max depth outside 1..5, a window below 1, negative
            costs or pseudo-counts, or pseudo-counts that are both zero.
    """

    max_depth: int = MAX_DEPTH
    window: int = 16
    prior_accepted: int = 1
    prior_rejected: int = 1
    draft_cost: Fraction = field(default_factory=lambda: Fraction(1, 20))
    row_cost: Fraction = field(default_factory=lambda: Fraction(1, 256))

    def __post_init__(self) -> None:
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"max depth {self.max_depth} outside 1..{MAX_DEPTH}")
        if self.window < 1:
            raise ValueError(f"window {self.window} below 1")
        if self.prior_accepted < 0 or self.prior_rejected < 0:
            raise ValueError("pseudo-counts must be >= 0")
        if self.prior_accepted + self.prior_rejected == 0:
            raise ValueError("pseudo-counts must not both be zero")
        object.__setattr__(self, "draft_cost", _nonneg_fraction(self.draft_cost, "draft cost"))
        object.__setattr__(self, "row_cost", _nonneg_fraction(self.row_cost, "row cost"))


@dataclass(frozen=True)
class DepthController:
    """Chooses a request's maximum depth for its next STEP from its :class:`AcceptanceHistory`
    and the load measured before the STEP, so no draw of the round can influence it.

    The chosen d in 1..max_depth maximizes ``E(d) / cost(d)`` exactly (smallest d on ties),
    with ``E(d) = 1 + alpha + ... + alpha**d`` for the :meth:`estimate` alpha and
    ``cost(d) = 1 + d * draft_cost + active_slots * (d + 1) * row_cost``.
    """

    policy: DepthPolicy = field(default_factory=DepthPolicy)

    def record(
        self, history: AcceptanceHistory, accepted: int, rejected: bool
    ) -> AcceptanceHistory:
        """The history after one more verified round (the last ``window`` kept); ``rejected``:
        whether it ended in a correction.

        Raises:
            ValueError: for ``accepted`` outside 0..5.
        """
        if not 0 <= accepted <= MAX_DEPTH:
            raise ValueError(f"accepted {accepted} outside 0..{MAX_DEPTH}")
        rounds = (*history.rounds, (accepted, bool(rejected)))
        return AcceptanceHistory(rounds[-self.policy.window :])

    def estimate(self, history: AcceptanceHistory) -> Fraction:
        """Per-draft acceptance estimate (accepted + a0) / (accepted + rejected + a0 + r0): a
        round that stopped without a rejection counts its undrawn positions as censored."""
        pol = self.policy
        a = history.accepted + pol.prior_accepted
        return Fraction(a, a + history.rejected + pol.prior_rejected)

    def choose(self, history: AcceptanceHistory, active_slots: int) -> int:
        """The maximum depth (1..max_depth) for this request's next STEP.

        Raises:
            ValueError: for ``active_slots`` below 1.
        """
        if active_slots < 1:
            raise ValueError(f"active slots {active_slots} below 1")
        pol = self.policy
        alpha = self.estimate(history)
        best, best_score = 1, Fraction(-1)
        expected, power = Fraction(1), Fraction(1)
        for d in range(1, pol.max_depth + 1):
            power *= alpha
            expected += power
            cost = 1 + d * pol.draft_cost + active_slots * (d + 1) * pol.row_cost
            score = expected / cost
            if score > best_score:
                best, best_score = d, score
        return best
