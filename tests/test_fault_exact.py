"""Faults that depend on the drafts: exact laws with the stopping rule and without it.

``docs/adaptive.md`` §7: a row lost to a fault (a drafter that fails for some
contexts, a row missing at the reply deadline, a row refused on arrival) ends
the block before it, and the rows before it are verified. The suite enumerates
the law of the committed tokens and their marks, in rationals, exactly as
``tests/test_adaptive_exact.py`` does for stop rules, and checks:

- under the rule, the token law is the target's and every conditional law is
  p(. | tokens so far), for faults that depend on the drafts, whatever the
  stop rule and depth;
- the rule pp1wire used to follow (discard the whole block on any fault) is
  biased by the same faults — the suite catches it — and exact only for a
  fault that no draft can influence (one at the first row);
- the two-token toy: q = p uniform, a drafter that fails after drafting token
  1 gives the first token 0 with probability 3/4 under the discard, 1/2
  under the rule.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from pp1wire.apps.models import toy_drafter, toy_target
from pp1wire.q import dyadic, oracle

from .test_adaptive_exact import (
    HALF,
    MODELS,
    exactness_failures,
    planner_for,
    rule_drafting,
    uniform2,
)


def after_token(token: int) -> oracle.Fault:
    """A drafter that always fails on a context ending in a draft of ``token``."""
    return lambda _ctx, drafts: bool(drafts) and drafts[-1] == token


def slow_on_long_blocks(_ctx: oracle.Prefix, drafts: oracle.Prefix) -> Fraction:
    """A row more likely to miss the deadline the longer the block and the rarer its
    context: its arrival time depends on every draft before it (never on its own)."""
    if not drafts:
        return Fraction(0)
    return Fraction(len(drafts), 4) if drafts[-1] == 1 else Fraction(1, 9)


def first_row_only(ctx: oracle.Prefix, drafts: oracle.Prefix) -> Fraction:
    """A fault no draft can influence: the first row, from the committed context alone."""
    return Fraction(1, 3) if not drafts and ctx[-1] == 0 else Fraction(0)


FAULTS = {"after-token-1": after_token(1), "slow": slow_on_long_blocks}


def drafting(rule: str, depth: int, fault: oracle.Fault, *, discard: bool) -> oracle.Drafting:
    base = rule_drafting(rule, depth)
    return oracle.Drafting(depth, base.admit, fault=fault, discard_on_fault=discard)


def law_of(model: str, plan: oracle.Drafting, length: int = 4):
    prefix, q_fn, p_fn, eos = MODELS[model]
    law = oracle.adaptive_generate_distribution(prefix, length, planner_for(plan), q_fn, p_fn, eos)
    return exactness_failures(law, prefix, length, p_fn, eos)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rule", ["fixed", "confidence:0.3", "joint:0.25"])
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_that_depends_on_the_drafts_keeps_the_law_when_it_stops_the_block(
    model, rule, depth, fault
):
    assert law_of(model, drafting(rule, depth, FAULTS[fault], discard=False)) == []


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fault", FAULTS)
def test_discarding_the_whole_block_on_the_same_faults_is_biased(model, fault):
    failures = law_of(model, drafting("fixed", 3, FAULTS[fault], discard=True))
    assert any(f.startswith("joint law") for f in failures), failures


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("discard", [False, True])
def test_a_fault_no_draft_can_influence_is_exact_either_way(model, discard):
    assert law_of(model, drafting("fixed", 3, first_row_only, discard=discard)) == []


def test_the_fault_really_fires_in_the_suite():
    # Not a fixed-depth test in disguise: with the fault, some rounds end early
    # (a bonus after one draft at depth 3) that never do without it.
    prefix, q_fn, p_fn, eos = MODELS["V3"]
    faulty = oracle.adaptive_round_distribution(
        prefix, drafting("fixed", 3, after_token(1), discard=False), q_fn, p_fn, eos
    )
    clean = oracle.adaptive_round_distribution(prefix, oracle.Drafting(3), q_fn, p_fn, eos)

    def short_bonus(law):
        return sum(m for o, m in law.items() if o.kinds[-1] == oracle.BONUS and len(o.tokens) < 4)

    assert short_bonus(faulty) > 0 == short_bonus(clean)


def test_two_token_toy_three_quarters_under_discard_one_half_under_the_rule():
    # q = p uniform on {0, 1}, depth 2, a drafter that cannot continue after token 1.
    first = {}
    for discard in (True, False):
        plan = oracle.Drafting(2, fault=after_token(1), discard_on_fault=discard)
        law = oracle.adaptive_round_distribution((), plan, uniform2, uniform2)
        first[discard] = sum(m for o, m in law.items() if o.tokens[0] == 0)
    assert first == {True: Fraction(3, 4), False: HALF}
    # The same number as the design's selection-bias toy: a discard chosen by a draw.
    biased = oracle.selective_admission_distribution([HALF, HALF], [HALF, HALF], lambda x: x == 0)
    assert biased[0] == first[True]


def toy_pair(vocab: int, seed: int):
    """The daemons' default pair as the oracle sees it: q the worker's dyadic counts
    from the toy drafter's logits, p the toy target's row (exact binary values,
    normalized)."""
    drafter, target = toy_drafter(vocab, seed), toy_target(vocab, seed)

    def q_fn(ctx):
        counts = dyadic.counts_from_logits(drafter.logits(list(ctx)))
        return [Fraction(int(c), 1 << 24) for c in counts]

    def p_fn(ctx):
        row = [Fraction(float(x)) for x in target.probs(list(ctx))]
        total = sum(row)
        return [x / total for x in row]

    return q_fn, p_fn


def test_the_daemon_tests_faults_move_the_first_token_by_what_they_claim():
    # tests/test_fault_law.py's models and faults (V = 8, seed 0, prompt [1, 2, 3],
    # depth 2): the figures its tolerance is sized against, computed exactly. Under
    # the rule the first token follows p; under the whole-block discard a drafter
    # failing after a drafted 4 moves P(4) from 0.674 to 0.477, and one failing (or
    # too slow) after a drafted 0 moves P(0) from 0.173 to 0.059.
    q_fn, p_fn = toy_pair(8, 0)
    prompt = (1, 2, 3)
    want = p_fn(prompt)
    first = {}
    for token in (4, 0):
        for discard in (False, True):
            plan = drafting("fixed", 2, after_token(token), discard=discard)
            law = oracle.adaptive_generate_distribution(
                prompt, 1, planner_for(plan), q_fn, p_fn, None
            )
            first[token, discard] = oracle.token_law(law).get((token,), Fraction(0))
        assert first[token, False] == want[token]
    assert round(float(want[4]), 3) == 0.674
    assert round(float(first[4, True]), 3) == 0.477
    assert round(float(want[0]), 3) == 0.173
    assert round(float(first[0, True]), 3) == 0.059


def test_a_fault_probability_outside_zero_one_is_refused():
    plan = oracle.Drafting(2, fault=lambda _c, _d: Fraction(3, 2))
    with pytest.raises(oracle.VerifyError):
        oracle.adaptive_round_distribution((), plan, uniform2, uniform2)
