"""Verify an engine step's rounds on the target rows the engine already computed.

An engine scores every round of a step in one forward pass and holds the
result as one ``[N, V]`` array or tensor. :func:`step_prefixes` lists the
prefixes it must score, in order; :func:`verify_step` decides every round from
those rows. Each round is decided exactly as
:func:`pp1wire.q.verify.verify_batch` decides it (the same tokens for the same
seeds): this module only maps the engine's rows onto its rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy.typing as npt

from pp1wire.errors import ErrorCode, UsageError, VerifyError
from pp1wire.q.proposal import Proposal
from pp1wire.q.verify import RequestVerifier, RoundResult, verify_batch

StepRound = tuple[RequestVerifier, Proposal | None, int]
"""One round of a step: ``(verifier, proposal, round_id)``; a ``None`` proposal
decodes ``round_id`` target-only."""


def _row_count(round_: StepRound) -> int:
    proposal = round_[1]
    return 1 if proposal is None else len(proposal.rows) + 1


def step_prefixes(rounds: Sequence[StepRound]) -> list[Sequence[int]]:
    """The prefixes to score for ``rounds``, in order: for a round with a proposal
    of d drafts its committed prefix extended by the first 0, 1, …, d drafts
    (d + 1 rows), for a target-only round its committed prefix (one row)."""
    out: list[Sequence[int]] = []
    for verifier, proposal, _ in rounds:
        if proposal is None:
            out.append(verifier.committed)
        else:
            out.extend(verifier.prefixes(proposal))
    return out


def verify_step(
    rounds: Sequence[StepRound], probs: Any, *, commit: bool = True
) -> list[RoundResult | VerifyError]:
    """Decide a step's rounds (of distinct requests) from the engine's target rows.

    ``probs`` is a ``[N, V]`` numpy array or tensor (torch, any device) whose
    rows are the target's probabilities (or non-negative weights) for
    :func:`step_prefixes` of ``rounds``, in that order. Each round gets its
    :class:`RoundResult` (committed to its verifier unless ``commit`` is False)
    or the :class:`VerifyError` that decided it, as :func:`verify_batch` says:
    a refused proposal changes nothing, a bad target row poisons its request.

    Raises:
        UsageError: ``BAD_ARGUMENT`` if ``probs`` does not have one row per
            prefix (nothing is decided then).
    """
    counts = [_row_count(r) for r in rounds]
    expected = sum(counts)
    shape = getattr(probs, "shape", None)
    if shape is None or len(shape) != 2 or int(shape[0]) != expected:
        raise UsageError(
            ErrorCode.BAD_ARGUMENT, f"probs has shape {shape}, expected {expected} rows"
        )
    out: list[RoundResult | VerifyError] = []
    start = 0
    for round_, count in zip(rounds, counts, strict=True):
        block = probs[start : start + count]
        start += count

        def given(prefixes: Sequence[Sequence[int]], block: Any = block) -> Sequence[npt.ArrayLike]:
            return list(block)  # called only with this round's own prefixes, in order

        out.extend(verify_batch([round_], given, commit=commit))
    return out


__all__ = ["StepRound", "step_prefixes", "verify_step"]
