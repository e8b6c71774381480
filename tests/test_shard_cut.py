"""A vocabulary-sharded Spark group verifies the rows every rank holds (``docs/adaptive.md`` §7).

Each rank's link may receive a different number of rows when a fault hits one
link (a late row, a corrupt one). The group verifies the block of the rows all
ranks hold, cut by the fault, and every rank decides the same tokens as one
rank verifying that cut block. Under a stop rule the group audits the block
from each row's count at its token, gathered from the rank that owns the
token: a block that runs past the rule's stop is cut there, one that ends
before it is refused, as one rank decides. Two ranks as threads of this
process, gloo.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pp1wire.apps.models import ToyLM  # noqa: E402
from pp1wire.errors import ErrorCode, VerifyError  # noqa: E402
from pp1wire.q import dyadic  # noqa: E402
from pp1wire.q.layout import ShardLayout  # noqa: E402
from pp1wire.q.proposal import Proposal, QRow  # noqa: E402
from pp1wire.q.rng import Domain, Role, RoundStreams  # noqa: E402
from pp1wire.q.stoprules import FIXED, StopRule  # noqa: E402
from pp1wire.q.verify import RequestVerifier, RoundResult, batched  # noqa: E402
from pp1wire.tp.coordinator import GroupCoordinator  # noqa: E402
from pp1wire.tp.shard_spark import ShardedVerifyGroup, ShardRound  # noqa: E402

from .groups import run_in_threads  # noqa: E402

V = 64
SEED = 21
PREFIX = [1, 2, 3]
LAYOUT = ShardLayout.even(V, 2)


def whole_rows(depth: int) -> list[QRow]:
    """An honest block of ``depth`` dense rows from the toy drafter."""
    drafter = ToyLM(V, 3, draft=True)
    streams = RoundStreams(Role.WORKER, SEED, 0, 0)
    rows, context = [], list(PREFIX)
    for i in range(depth):
        counts = dyadic.counts_from_logits(drafter.logits(context), 1.0)
        token = dyadic.sample(counts, streams.u24(Domain.PROPOSAL, len(PREFIX) + i))
        rows.append(QRow(token=token, counts=counts))
        context.append(token)
    return rows


def verifier() -> RequestVerifier:
    return RequestVerifier(
        session=0, seed=SEED, vocab_size=V, prefix=PREFIX, target=ToyLM(V, 3).probs
    )


def proposal(
    rows: list[QRow], *, shard=None, cut=None, depth: int = 3, stop: StopRule = FIXED
) -> Proposal:
    v = verifier()
    return Proposal(
        0, 0, 0, v.position, v.digest, depth, tuple(rows), 0, shard, stop=stop, cut=cut
    )


def stops_after_row_1(rows: list[QRow]) -> StopRule:
    """A confidence rule that continues after no row whose count is row 1's or less."""
    first = rows[0].count_at(rows[0].token)
    assert first < dyadic.M
    return StopRule.confidence(f"{first + 1}/{dyadic.M}")


def lenient() -> StopRule:
    """A rule that always continues: only the depth ends a block."""
    return StopRule.confidence(0)


def shard_of(row: QRow, rank: int) -> QRow:
    lo, hi = LAYOUT.range(rank)
    q = row.dense_q(V).astype(np.float32)
    return QRow(token=row.token, q32=np.ascontiguousarray(q[lo:hi]))


# Each scenario: per rank, the rows its link got (the first n of the block) and the
# fault that cut them; None for a link that got no row (a fault before row 0).
SCENARIOS = {
    "one link cut": [(3, None), (1, ErrorCode.ROW_CHECKSUM_MISMATCH)],
    "two links cut, the later one first": [
        (2, ErrorCode.REPLY_TIMEOUT),
        (1, ErrorCode.ROW_CHECKSUM_MISMATCH),
    ],
    "every link whole": [(3, None), (3, None)],
    "one link empty": [(3, None), None],
    "two lengths, no fault": [(3, None), (2, None)],
}
# Under a stop rule (the rule, then per rank as above): the rule stops after row 1.
RULED = {
    "stopped where the rule stops": ("strict", [(1, None), (1, None)]),
    "run past the rule's stop": ("strict", [(3, None), (3, None)]),
    "run past it, one link cut later": ("strict", [(3, None), (2, ErrorCode.REPLY_TIMEOUT)]),
    "ended before the rule's stop": ("lenient", [(2, None), (2, None)]),
    "cut before the rule's stop": ("lenient", [(2, None), (1, ErrorCode.REPLY_TIMEOUT)]),
}


@pytest.fixture(scope="module")
def outcomes():
    """Every scenario's outcome on each rank, decided by one group (one gloo start)."""
    rows = whole_rows(3)

    def body(coord: GroupCoordinator):
        group = ShardedVerifyGroup(coord)
        target = batched(ToyLM(V, 3).probs)
        span = LAYOUT.range(coord.rank)
        out = {}
        for name, per_rank in SCENARIOS.items():
            got = per_rank[coord.rank]
            if got is None:
                r = ShardRound(verifier(), 0, None, ErrorCode.REPLY_TIMEOUT)
            else:
                n, cut = got
                shards = [shard_of(x, coord.rank) for x in rows[:n]]
                r = ShardRound(verifier(), 0, proposal(shards, shard=span, cut=cut))
            (out[name],) = group.decide([r], target)
            out[name, "cut"] = None if r.proposal is None else r.proposal.cut
        rules = {"strict": stops_after_row_1(rows), "lenient": lenient()}
        for name, (rule, per_rank) in RULED.items():
            n, cut = per_rank[coord.rank]
            shards = [shard_of(x, coord.rank) for x in rows[:n]]
            p = proposal(shards, shard=span, cut=cut, stop=rules[rule])
            (out[name],) = group.decide([ShardRound(verifier(), 0, p)], target)
        return out

    results = run_in_threads(2, body, layout=LAYOUT, timeout=20.0)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    names = [*SCENARIOS, *RULED, *((name, "cut") for name in SCENARIOS)]
    return rows, {name: [r[name] for r in results] for name in names}


def test_the_group_verifies_the_rows_every_rank_holds_as_one_rank_verifies_them(outcomes):
    rows, outs = outcomes[0], outcomes[1]["one link cut"]
    assert all(isinstance(o, RoundResult) for o in outs), outs
    assert outs[0] == outs[1]
    one = verifier().verify(proposal(rows[:1], cut=ErrorCode.ROW_CHECKSUM_MISMATCH))
    assert outs[0] == one
    assert len(one.tokens) <= 2  # the cut block: one draft and its correction or bonus


def test_a_block_cut_on_two_links_is_cut_for_the_reason_of_the_shorter_one(outcomes):
    # Rank 0's link lost row 2 to the deadline, rank 1's refused row 1: the group
    # verifies row 0 alone, and what ended it there is rank 1's checksum fault.
    rows, results = outcomes
    outs = results["two links cut, the later one first"]
    cuts = results["two links cut, the later one first", "cut"]
    assert cuts == [ErrorCode.ROW_CHECKSUM_MISMATCH] * 2
    one = verifier().verify(proposal(rows[:1], cut=ErrorCode.ROW_CHECKSUM_MISMATCH))
    assert outs == [one, one]


def test_every_link_whole_verifies_the_whole_block(outcomes):
    rows, outs = outcomes[0], outcomes[1]["every link whole"]
    assert outs[0] == outs[1] == verifier().verify(proposal(rows))


def test_a_link_with_no_row_discards_the_round_on_every_rank(outcomes):
    outs = outcomes[1]["one link empty"]
    assert all(isinstance(o, VerifyError) and o.code is ErrorCode.REPLY_TIMEOUT for o in outs)


def test_whole_blocks_of_different_lengths_are_not_one_block(outcomes):
    # Two links that both say their block ended, at different rows: a worker group
    # that drew two different blocks for one STEP; nothing of it is used.
    outs = outcomes[1]["two lengths, no fault"]
    assert all(isinstance(o, VerifyError) for o in outs)
    assert {o.code for o in outs} == {ErrorCode.GROUP_SHARD_MISMATCH}


def test_the_cut_block_keeps_its_key():
    rows = whole_rows(3)
    cut = dataclasses.replace(proposal(rows), rows=tuple(rows[:2]), cut=ErrorCode.REPLY_TIMEOUT)
    verifier().check_proposal(cut)  # a fault may end a block anywhere before its depth


def test_a_block_that_stops_where_the_rule_stops_is_verified_as_one_rank_verifies_it(outcomes):
    rows, outs = outcomes[0], outcomes[1]["stopped where the rule stops"]
    one = verifier().verify(proposal(rows[:1], stop=stops_after_row_1(rows)))
    assert outs[0] == outs[1] == one


@pytest.mark.parametrize("name", ["run past the rule's stop", "run past it, one link cut later"])
def test_a_block_past_the_rules_stop_is_cut_there_as_one_rank_cuts_it_on_arrival(outcomes, name):
    # One rank refuses row 2 on arrival (STOP_RULE_VIOLATED), so its block is row 1,
    # cut there; no rank of the group holds row 1's count but its owner, and the
    # group, from the owner's word, cuts the same block whatever came after.
    rows, outs = outcomes[0], outcomes[1][name]
    cut = proposal(rows[:1], stop=stops_after_row_1(rows), cut=ErrorCode.STOP_RULE_VIOLATED)
    assert outs[0] == outs[1] == verifier().verify(cut)


def test_a_block_that_ends_before_the_rules_stop_is_refused_on_every_rank(outcomes):
    outs = outcomes[1]["ended before the rule's stop"]
    assert all(isinstance(o, VerifyError) for o in outs), outs
    assert {o.code for o in outs} == {ErrorCode.STOP_RULE_VIOLATED}
    with pytest.raises(VerifyError) as one:
        verifier().verify(proposal(whole_rows(3)[:2], stop=lenient()))
    assert one.value.code is ErrorCode.STOP_RULE_VIOLATED


def test_a_fault_may_end_a_ruled_block_before_the_rules_stop(outcomes):
    rows, outs = outcomes[0], outcomes[1]["cut before the rule's stop"]
    one = verifier().verify(proposal(rows[:1], stop=lenient(), cut=ErrorCode.REPLY_TIMEOUT))
    assert outs[0] == outs[1] == one
