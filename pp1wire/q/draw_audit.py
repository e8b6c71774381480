"""The audit of a shipped proposal against the worker's own draw (``docs/protocol.md`` §6.5):
a worker that sampled from another q than it shipped, or with other noise, is caught wherever
the two disagree. Nothing here draws in the Spark side's domains.
"""

from __future__ import annotations

from pp1wire.q import dyadic
from pp1wire.q.proposal import Proposal
from pp1wire.q.rng import proposal_u24


def audit_mismatch(proposal: Proposal, seed: int, vocab_size: int) -> int | None:
    """The first draft that is not what the recomputed PROPOSAL draw (§6.3) selects from its
    row's q (§6.4), else None."""
    for i, row in enumerate(proposal.rows):
        u24 = proposal_u24(seed, proposal.generation, proposal.round_id, proposal.position + i)
        counts = row.dense_counts(vocab_size)
        if row.ids is None:
            chosen = dyadic.sample(counts, u24)
        else:
            chosen = int(row.ids[dyadic.sample(counts[row.ids], u24)])
        if chosen != row.token:
            return i
    return None


__all__ = ["audit_mismatch"]
