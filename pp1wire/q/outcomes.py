"""What a round of verification commits, and the codes that mean the target failed:
the types :mod:`pp1wire.q.verify` returns (and re-exports), free of its numpy work."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pp1wire.errors import ErrorCode

TARGET_FAILURES = frozenset(
    {
        ErrorCode.TARGET_FAILED,
        ErrorCode.TARGET_NON_FINITE,
        ErrorCode.TARGET_NEGATIVE,
        ErrorCode.TARGET_ZERO_MASS,
        ErrorCode.SESSION_POISONED,
    }
)
"""The codes that mean the target (or a processor) failed: the request is poisoned."""


class Outcome(Enum):
    """How a round ended."""

    CORRECTION = "correction"
    BONUS = "bonus"
    EOS = "eos"
    TARGET = "target"


@dataclass(frozen=True)
class RoundResult:
    """What one round committed: the accepted drafts then ``extra`` (the correction, bonus or
    target-only token; ``None`` after an accepted terminal draft) as ``tokens``."""

    round_id: int
    accepted: int
    tokens: tuple[int, ...]
    extra: int | None
    outcome: Outcome
    finished: bool
    new_position: int
