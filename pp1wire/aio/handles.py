"""What an engine's sampler holds and converts: a request open on a slot, a step's
proposals, the client's error types, and the flat batch layout serving engines use."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ErrorCode, Pp1Error, UsageError, VerifyError
from pp1wire.q.arrays import host_array
from pp1wire.q.proposal import Proposal
from pp1wire.q.verify import RequestVerifier, StepRound

_Rows = TypeVar("_Rows", bound=Any)  # numpy rows, or an engine tensor sliced the same way


class _Client(Protocol):
    """What a request needs of the client it is open on (an ``AsyncClient``)."""

    def release(self, proposal: Proposal) -> None: ...


class ProposalUnavailableError(Pp1Error):
    """No usable proposal this round (``code`` says why: ``docs/embedding.md`` §3);
    decode it target-only."""


class RefusedError(Pp1Error):
    """The worker refused a request (``code`` says why), or this side cancelled it
    (``CANCELLED``): reopen the slot (``AsyncClient.reopen``; ``docs/embedding.md`` §3)."""


class ConnectionLostError(Pp1Error):
    """The connection is gone (``code`` says why): connect again and reopen the slots."""


def scored_by_the_engine(prefix: Sequence[int]) -> npt.NDArray[np.float64]:
    """The target of a request the engine scores itself: never to be called.

    Raises:
        VerifyError: ``TARGET_FAILED`` always (the request is poisoned).
    """
    raise VerifyError(
        ErrorCode.TARGET_FAILED,
        "this request has no target of its own: pass the engine's rows (verify_step)",
    )


class Request:
    """A request open on one slot of a client: what an engine's sampler holds per request.

    ``verifier`` (:class:`~pp1wire.q.verify.RequestVerifier`) holds its state and the
    round counter, the only source of round IDs; ``client`` is the ``AsyncClient``.
    """

    __slots__ = ("client", "prompt_length", "slot", "verifier")

    def __init__(
        self, client: _Client, slot: int, verifier: RequestVerifier, prompt_length: int
    ) -> None:
        """Prefer ``AsyncClient.open_request``."""
        self.client = client
        self.slot = slot
        self.verifier = verifier
        self.prompt_length = prompt_length

    @property
    def tokens(self) -> list[int]:
        """The tokens committed after the prompt."""
        return self.verifier.committed[self.prompt_length :]

    @property
    def finished(self) -> bool:
        """True once a round committed the terminal token (``eos``)."""
        return self.verifier.finished

    def round_for(self, outcome: Proposal | Exception | None) -> StepRound:
        """This request's round of a step, for :func:`~pp1wire.verify_step`: a proposal
        (whole or cut) under its own round; anything else (the error, or None for a
        round planned target-only before its STEP) target-only under the next round
        ID. Never pass None for a proposal that arrived late (``docs/adaptive.md`` §7).

        Raises:
            UsageError: a proposal of another request.
        """
        v = self.verifier
        if isinstance(outcome, Proposal):
            if outcome.slot != self.slot or outcome.releaser != self.client.release:
                raise UsageError(ErrorCode.BAD_ARGUMENT, "a proposal of another request")
            return (v, outcome, outcome.round_id)
        return (v, None, v.take_round())

    def __repr__(self) -> str:
        """Slot, generation and committed length."""
        v = self.verifier
        return f"Request(slot={self.slot}, generation={v.generation}, position={v.position})"


class ProposalBatch(list[Proposal | ProposalUnavailableError]):
    """``AsyncClient.propose_many``'s outcome per request, in order: a proposal or the
    error that says why there is none; as a context manager, released at the end."""

    def release(self) -> None:
        """Release every proposal (idempotent)."""
        for outcome in self:
            if isinstance(outcome, Proposal):
                outcome.release()

    def __enter__(self) -> ProposalBatch:
        """The batch itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Release every proposal."""
        self.release()


# -- flat layout helpers (vLLM / SGLang style) ----------------------------------------


def flatten_drafts(
    proposals: Sequence[Proposal | None],
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Draft token IDs ``[num_tokens]`` and draft counts ``[batch]`` (None: 0 drafts)."""
    counts = np.array([0 if p is None else len(p.rows) for p in proposals], dtype=np.int32)
    ids = [t for p in proposals if p is not None for t in p.tokens]
    return np.asarray(ids, dtype=np.int32), counts


def pack_outputs(outputs: Sequence[Sequence[int]], max_depth: int) -> npt.NDArray[np.int32]:
    """Accepted tokens per request as ``[batch, max_depth + 1]``, padded with -1.

    Raises:
        ValueError: if a request has more than ``max_depth + 1`` tokens.
    """
    out = np.full((len(outputs), max_depth + 1), -1, dtype=np.int32)
    for i, tokens in enumerate(outputs):
        row = host_array(tokens)  # a list, a numpy array or an engine tensor
        if len(row) > max_depth + 1:
            raise ValueError(f"request {i} has {len(row)} tokens > {max_depth + 1}")
        out[i, : len(row)] = row
    return out


def target_rows(target_probs: _Rows, draft_counts: npt.ArrayLike) -> list[_Rows]:
    """Split engine-layout target probabilities ``[num_tokens + batch, V]`` (each
    request's draft positions then its bonus one) into per-request blocks: slices of
    the same type (numpy, or an engine's tensor on any device), no copy.

    Raises:
        ValueError: if the row count does not match ``sum(draft_counts) + batch``.
    """
    counts = [int(n) for n in host_array(draft_counts).tolist()]
    expected = sum(counts) + len(counts)
    if target_probs.shape[0] != expected:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, expected {expected}")
    blocks = []
    start = 0
    for n in counts:
        blocks.append(target_probs[start : start + n + 1])
        start += n + 1
    return blocks


__all__ = [
    "ConnectionLostError",
    "ProposalBatch",
    "ProposalUnavailableError",
    "RefusedError",
    "Request",
    "flatten_drafts",
    "pack_outputs",
    "target_rows",
]
