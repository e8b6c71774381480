"""Stop rules and adaptive depth: integer rules, the audit, the exact conditional-frequency suite.

The suite (``exactness_failures``) enumerates, in rationals, the joint law of
the first n committed tokens together with each token's mark (its index in
its round and whether it came from a drafted position, a bonus or a
target-only draw), and compares it with the target: the token law must equal
target-only sampling exactly, and the law of token k+1 given tokens 1..k and
the marks of tokens 1..k+1 must be p(. | tokens 1..k) exactly
(``docs/adaptive.md``, theorem 1). The same suite must fail on a worker that
revokes a position after seeing its draw.
"""

from __future__ import annotations

import re
from fractions import Fraction
from itertools import product

import pytest

from pp1wire.errors import ErrorCode, VerifyError
from pp1wire.q import oracle
from pp1wire.q.dyadic import M
from pp1wire.q.stoprules import (
    STOP_RULES,
    AcceptanceHistory,
    DepthController,
    DepthPolicy,
    StopKind,
    StopRule,
    admits_next,
    audit,
    continues,
    stop_after,
    threshold_of,
)

# -- models ----------------------------------------------------------------------
# Prefix-dependent p and q on three and four tokens. q is dyadic24 counts (so
# the integer rules apply), with zeros where p is positive and mass where p is
# zero, point masses (so tau = 1 binds), exact halves and quarters (so joint:0.25
# lands exactly on its boundary) and a non-dyadic split.


def _q(counts: list[int]) -> list[Fraction]:
    assert sum(counts) == M
    return oracle.q_from_counts(counts)


def p3(ctx: tuple[int, ...]) -> list[Fraction]:
    last = ctx[-1] if ctx else 0
    w = [[3, 2, 1], [1, 1, 2], [2, 0, 3]][last]  # token 1 is forbidden after token 2
    if len(ctx) >= 2 and ctx[-2] == 1:
        w = [w[0] + 2, w[1], w[2]]
    return oracle.normalize(w)


def q3(ctx: tuple[int, ...]) -> list[Fraction]:
    last = ctx[-1] if ctx else 0
    if last == 0 and len(ctx) >= 2 and ctx[-2] == 2:
        return _q(oracle.dyadic_counts([1, 1, 1]))
    return _q([[M // 2, M // 4, M // 4], [0, 0, M], [M // 4, 3 * M // 4, 0]][last])


EOS4 = 3


def p4(ctx: tuple[int, ...]) -> list[Fraction]:
    last = ctx[-1] if ctx else 0
    w = [[1, 2, 3, 1], [0, 2, 1, 1], [3, 0, 1, 2], [1, 1, 1, 1]][last]
    if len(ctx) >= 2 and ctx[-2] == 0:
        w = [w[0], w[1] + 1, w[2], w[3]]
    return oracle.normalize(w)


def q4(ctx: tuple[int, ...]) -> list[Fraction]:
    last = ctx[-1] if ctx else 0
    rows = [
        [M // 2, 0, M // 4, M // 4],
        oracle.dyadic_counts([5, 1, 1, 1]),
        [0, M // 2, M // 2, 0],
        [M, 0, 0, 0],
    ]
    return _q(rows[last])


MODELS = {
    "V3": ((0,), q3, p3, None),
    "V4-eos": ((0,), q4, p4, EOS4),
}

RULES = [
    "fixed",
    "confidence:0",
    "confidence:0.3",
    "confidence:0.5",
    "confidence:1",
    "joint:0",
    "joint:0.25",
    "joint:0.3",
    "joint:1",
]


# -- the suite -------------------------------------------------------------------


def exactness_failures(
    law: dict[tuple[oracle.Prefix, oracle.Marks], Fraction],
    prefix: oracle.Prefix,
    length: int,
    p_fn: oracle.DistFn,
    eos: int | None,
) -> list[str]:
    """Every way ``law`` differs from the target's: joint token law, then conditionals."""
    failures = []
    assert sum(law.values()) == 1
    tokens = oracle.token_law(law)
    want = oracle.target_only_distribution(prefix, length, p_fn, eos)
    if tokens != want:
        diff = {k: tokens.get(k, 0) - want.get(k, 0) for k in set(tokens) | set(want)}
        worst = max(diff, key=lambda k: abs(diff[k]))
        failures.append(f"joint law of {worst}: {tokens.get(worst, 0)} != {want.get(worst, 0)}")
    for with_marks in (False, True):
        for (seen, marks), got in oracle.conditional_laws(law, with_marks).items():
            p = p_fn(prefix + seen)
            expected = {v: pv for v, pv in enumerate(p) if pv}
            if got != expected:
                failures.append(f"next after {seen} {marks}: {got} != {expected}")
    return failures


def planner_for(drafting: oracle.Drafting) -> oracle.Planner:
    return lambda _ctx, _history: [(Fraction(1), drafting)]


def rule_drafting(rule: str, depth: int) -> oracle.Drafting:
    return oracle.Drafting(depth, oracle.rule_admission(StopRule.parse(rule)))


# -- the exact suite on every rule ---------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_every_rule_commits_exactly_the_target_law(model, rule, depth):
    prefix, q_fn, p_fn, eos = MODELS[model]
    length = 4 if depth < 3 else 5  # spans several rounds whatever the rule stops at
    planner = planner_for(rule_drafting(rule, depth))
    law = oracle.adaptive_generate_distribution(prefix, length, planner, q_fn, p_fn, eos)
    assert exactness_failures(law, prefix, length, p_fn, eos) == []
    # Several rounds really happen: some sequence holds a second round's first token.
    assert any(mark in marks[1:] for _, marks in law for mark in [(0, "d"), (0, "b"), (0, "t")])


def _stop_masses(rule: str, depth: int, model: str) -> tuple[Fraction, Fraction]:
    """Over a few contexts: mass of blocks the rule cut short, and of blocks where it continued."""
    prefix, q_fn, _, eos = MODELS[model]
    short = continued = Fraction(0)
    for ctx in [prefix, *((*prefix, v) for v in range(len(q_fn(prefix))))]:
        law = oracle.proposal_distribution(ctx, rule_drafting(rule, depth), q_fn, eos)
        for (tokens, _), mass in law.items():
            if len(tokens) > 1:
                continued += mass
            if len(tokens) < depth and tokens[-1] != eos:
                short += mass
    return short, continued


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rule", [r for r in RULES if not r.endswith(":0") and r != "fixed"])
def test_each_binding_rule_both_stops_and_continues_in_the_suite(model, rule):
    # Otherwise the exact suite above would only re-test the fixed depth.
    short, continued = _stop_masses(rule, 3, model)
    assert short > 0
    assert continued > 0


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rule", ["fixed", "confidence:0", "joint:0"])
def test_rules_that_never_bind_ship_full_blocks(model, rule):
    short, _ = _stop_masses(rule, 3, model)
    assert short == 0


@pytest.mark.parametrize("model", MODELS)
def test_a_randomized_rule_with_independent_coins_is_exact(model):
    # Continue with probability 1/3 after a token 1 draw, 3/4 after a point
    # mass, else always: randomness independent of the future draws.
    def admit(_ctx, drafts, qs):
        if drafts[-1] == 1:
            return Fraction(1, 3)
        return Fraction(3, 4) if qs[-1] == 1 else True

    prefix, q_fn, p_fn, eos = MODELS[model]
    planner = planner_for(oracle.Drafting(3, admit))
    law = oracle.adaptive_generate_distribution(prefix, 5, planner, q_fn, p_fn, eos)
    assert exactness_failures(law, prefix, 5, p_fn, eos) == []


@pytest.mark.parametrize("model", MODELS)
def test_depth_from_history_and_load_is_exact(model):
    # The depth controller plans each round from the request's earlier rounds
    # (acceptances are not a function of the committed tokens) and a load drawn
    # before the round; a joint rule then stops inside the block.
    controller = DepthController(
        DepthPolicy(max_depth=3, window=2, draft_cost=Fraction(1, 10), row_cost=Fraction(1, 64))
    )
    admit = oracle.rule_admission(StopRule.parse("joint:0.3"))
    chosen = set()

    def planner(_ctx, outcomes):
        history = AcceptanceHistory()
        for o in outcomes:
            if o.kinds[0] != oracle.TARGET:
                history = controller.record(history, o.accepted, o.rejected)
        plan = []
        for load in (1, 64):
            depth = controller.choose(history, load)
            chosen.add(depth)
            plan.append((Fraction(1, 2), oracle.Drafting(depth, admit)))
        return plan

    prefix, q_fn, p_fn, eos = MODELS[model]
    law = oracle.adaptive_generate_distribution(prefix, 5, planner, q_fn, p_fn, eos)
    assert exactness_failures(law, prefix, 5, p_fn, eos) == []
    assert len(chosen) >= 2  # the depth really varies with history and load


# -- cross-check with the fixed-depth oracle -------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_fixed_rule_reduces_to_the_fixed_depth_oracle(model, depth):
    prefix, q_fn, p_fn, eos = MODELS[model]
    for ctx in [prefix, (*prefix, 1), (*prefix, 2)]:
        fixed = oracle.round_distribution(ctx, depth, q_fn, p_fn, eos)
        for drafting in (oracle.Drafting(depth), rule_drafting("fixed", depth)):
            adaptive = oracle.adaptive_round_distribution(ctx, drafting, q_fn, p_fn, eos)
            tokens: dict[tuple[int, ...], Fraction] = {}
            for outcome, mass in adaptive.items():
                tokens[outcome.tokens] = tokens.get(outcome.tokens, Fraction(0)) + mass
            assert tokens == fixed
    planner = planner_for(rule_drafting("fixed", depth))
    law = oracle.adaptive_generate_distribution(prefix, 4, planner, q_fn, p_fn, eos)
    assert oracle.token_law(law) == oracle.generate_distribution(prefix, 4, depth, q_fn, p_fn, eos)


def test_round_outcomes_record_acceptance_and_kinds():
    law = oracle.adaptive_round_distribution((0,), rule_drafting("fixed", 2), q3, p3)
    assert sum(law.values()) == 1
    for o in law:
        assert o.kinds[: o.accepted] == (oracle.DRAFT,) * o.accepted
        assert len(o.tokens) == o.accepted + 1
        assert o.kinds[-1] == (oracle.DRAFT if o.rejected else oracle.BONUS)
    assert {o.accepted for o in law} == {0, 1, 2}
    target_only = oracle.adaptive_round_distribution((0,), oracle.Drafting(0), q3, p3)
    assert target_only == {
        oracle.RoundOutcome((v,), (oracle.TARGET,), 0, False): pv for v, pv in enumerate(p3((0,)))
    }


# -- the anticipating worker fails the same suite ---------------------------------------

HALF = Fraction(1, 2)


def uniform2(_ctx):
    return [HALF, HALF]


def test_toy_revocation_fails_with_three_quarters():
    # q = p uniform on two tokens; the first draw is kept only when it is token
    # 0, else dropped and the token drawn target-only: 3/4 on token 0.
    toy = oracle.Drafting(1, revoke=lambda _ctx, drafts, _qs: drafts[-1] != 0)
    law = oracle.adaptive_round_distribution((), toy, uniform2, uniform2)
    first = {v: sum(m for o, m in law.items() if o.tokens[0] == v) for v in (0, 1)}
    assert first == {0: Fraction(3, 4), 1: Fraction(1, 4)}
    # The same number as the oracle's one-token selection-bias toy.
    biased = oracle.selective_admission_distribution([HALF, HALF], [HALF, HALF], lambda x: x == 0)
    assert biased == [first[0], first[1]]
    generated = oracle.adaptive_generate_distribution((), 3, planner_for(toy), uniform2, uniform2)
    failures = exactness_failures(generated, (), 3, uniform2, None)
    assert any(f.startswith("joint law") for f in failures)
    # Conditional on coming from a drafted position, the token is always 0.
    assert any("(0, 'd')" in f and "{0: Fraction(1, 1)}" in f for f in failures)
    # The legal version of the same round passes.
    honest = oracle.adaptive_generate_distribution(
        (), 3, planner_for(oracle.Drafting(1)), uniform2, uniform2
    )
    assert exactness_failures(honest, (), 3, uniform2, None) == []


def _drop_unlikely(rule: StopRule) -> oracle.Revoke:
    """A hostile worker: it draws x_(i+1) where the rule continues, and drops it when q is small."""

    def revoke(_ctx, drafts, qs):
        return len(drafts) > 1 and qs[-1] < Fraction(1, 2)

    return revoke


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rule", ["fixed", "joint:0.25"])
def test_revoking_after_the_draw_fails_on_the_rich_models(model, rule):
    prefix, q_fn, p_fn, eos = MODELS[model]
    parsed = StopRule.parse(rule)
    hostile = oracle.Drafting(3, oracle.rule_admission(parsed), _drop_unlikely(parsed))
    law = oracle.adaptive_generate_distribution(prefix, 4, planner_for(hostile), q_fn, p_fn, eos)
    failures = exactness_failures(law, prefix, 4, p_fn, eos)
    assert any(f.startswith("joint law") for f in failures)
    assert any(f.startswith("next after") for f in failures)


# -- the audit ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rule", RULES)
def test_audit_passes_every_block_an_honest_worker_ships(model, rule):
    prefix, q_fn, _, eos = MODELS[model]
    parsed = StopRule.parse(rule)
    for depth, ctx in product([1, 2, 3], [prefix, (*prefix, 1), (*prefix, 2)]):
        law = oracle.proposal_distribution(ctx, rule_drafting(rule, depth), q_fn, eos)
        assert sum(law.values()) == 1
        for tokens, counts in law:
            assert audit(parsed, depth, counts, tokens, eos) is None, (tokens, counts)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rule", ["fixed", "confidence:0.3", "joint:0.25"])
def test_audit_flags_exactly_the_blocks_a_revoking_worker_cut(model, rule):
    prefix, q_fn, _, eos = MODELS[model]
    parsed = StopRule.parse(rule)
    honest_drafting = rule_drafting(rule, 3)
    hostile_drafting = oracle.Drafting(3, honest_drafting.admit, _drop_unlikely(parsed))
    flagged = Fraction(0)
    for ctx in [prefix, (*prefix, 1), (*prefix, 2)]:
        honest = oracle.proposal_distribution(ctx, honest_drafting, q_fn, eos)
        hostile = oracle.proposal_distribution(ctx, hostile_drafting, q_fn, eos)
        for (tokens, counts), mass in hostile.items():
            verdict = audit(parsed, 3, counts, tokens, eos)
            # A block only a revocation produces is refused; every other passes.
            assert (verdict is None) == ((tokens, counts) in honest), (tokens, counts)
            if verdict is not None:
                assert verdict is ErrorCode.STOP_RULE_VIOLATED
                flagged += mass
    assert flagged > 0


def test_verify_block_matches_the_round_law():
    # Drafting first and verifying the shipped block gives the interleaved law.
    drafting = rule_drafting("joint:0.3", 3)
    for ctx in [(0,), (0, 1), (2, 0)]:
        want = oracle.adaptive_round_distribution(ctx, drafting, q4, p4, EOS4)
        got: dict[tuple[int, ...], Fraction] = {}
        for (tokens, _), mass in oracle.proposal_distribution(ctx, drafting, q4, EOS4).items():
            for block, m in oracle.verify_block_distribution(ctx, tokens, q4, p4, EOS4).items():
                got[block] = got.get(block, Fraction(0)) + mass * m
        projected: dict[tuple[int, ...], Fraction] = {}
        for outcome, mass in want.items():
            projected[outcome.tokens] = projected.get(outcome.tokens, Fraction(0)) + mass
        assert got == projected


def test_audit_detects_but_its_discards_do_not_undo_a_selection():
    # q = p uniform, depth 2; the worker drops x_2 whenever it is 1. The audit
    # refuses every cut block (decoded target-only), yet the second committed
    # token is 0 with probability 3/4: detection, not repair (adaptive.md §2).
    rule = StopRule()
    cut = oracle.Drafting(2, revoke=lambda _ctx, drafts, _qs: len(drafts) == 2 and drafts[1] == 1)

    def audited_round(ctx):
        law: dict[tuple[int, ...], Fraction] = {}
        for (tokens, counts), mass in oracle.proposal_distribution(ctx, cut, uniform2).items():
            if audit(rule, 2, counts, tokens, None) is None:
                committed = oracle.verify_block_distribution(ctx, tokens, uniform2, uniform2)
            else:
                committed = {(v,): pv for v, pv in enumerate(uniform2(ctx))}
            for block, m in committed.items():
                law[block] = law.get(block, Fraction(0)) + mass * m
        return law

    second = {0: Fraction(0), 1: Fraction(0)}
    for block, mass in audited_round(()).items():
        if len(block) >= 2:
            second[block[1]] += mass
        else:
            for nxt, m in audited_round(block).items():
                second[nxt[0]] += mass * m
    assert second == {0: Fraction(3, 4), 1: Fraction(1, 4)}


def test_audit_flags_a_worker_that_ignores_the_rule():
    # A fixed-depth worker audited against confidence:0.5 drew past a stop.
    rule = StopRule.parse("confidence:0.5")
    law = oracle.proposal_distribution((0,), oracle.Drafting(3), q3)
    late = [b for b in law if audit(rule, 3, b[1], b[0], None) is not None]
    assert late
    for tokens, counts in late:
        assert stop_after(rule, 3, counts, tokens, None) < len(tokens)


# -- the integer rules --------------------------------------------------------------------


def test_rule_set_name_is_versioned():
    assert STOP_RULES == "pp1-stop-rules-v1"
    assert [int(k) for k in StopKind] == [0, 1, 2]


@pytest.mark.parametrize(
    ("text", "kind", "threshold", "shown"),
    [
        ("fixed", StopKind.FIXED, 0, "fixed"),
        (" Fixed ", StopKind.FIXED, 0, "fixed"),
        ("confidence:0", StopKind.CONFIDENCE, 0, "confidence:0"),
        ("confidence:1", StopKind.CONFIDENCE, M, "confidence:1"),
        ("confidence:0.5", StopKind.CONFIDENCE, M // 2, "confidence:0.5"),
        ("confidence:0.3", StopKind.CONFIDENCE, 5033165, "confidence:0.3"),  # ceil(5033164.8)
        ("joint:3/10", StopKind.JOINT, 5033165, "joint:0.3"),
        ("joint:0.25", StopKind.JOINT, M // 4, "joint:0.25"),
        ("joint:1e-7", StopKind.JOINT, 2, "joint:0.0000001"),  # ceil(1.6777216)
        ("joint:1.0", StopKind.JOINT, M, "joint:1"),
    ],
)
def test_parse_and_round_trip(text, kind, threshold, shown):
    rule = StopRule.parse(text)
    assert (rule.kind, rule.threshold) == (kind, threshold)
    assert str(rule) == shown
    assert StopRule.parse(str(rule)) == rule


def test_every_threshold_round_trips_through_its_text():
    for t in [*range(40), *range(M - 40, M + 1), 1 << 23, 5033165, 12345678]:
        for kind in (StopKind.CONFIDENCE, StopKind.JOINT):
            rule = StopRule(kind, t)
            assert StopRule.parse(str(rule)) == rule, t


def test_threshold_is_the_exact_ceiling():
    assert threshold_of(Fraction(1, 3)) == 5592406  # 5592405.33...
    assert threshold_of(Fraction(5592405, M)) == 5592405  # exact: no rounding up
    assert threshold_of(0.1) == 1677722  # binary64 0.1 is just above 1/10
    assert threshold_of("0.1") == 1677722
    assert threshold_of(1) == M
    # Extreme exponents are decided without expanding them.
    assert threshold_of("1e-999999999") == 1
    assert threshold_of("0e-999999999") == 0
    with pytest.raises(ValueError, match="outside"):
        threshold_of("1e999999999")
    with pytest.raises(ValueError, match="longer than"):
        threshold_of("0." + "1" * 80)
    assert StopRule.joint("0.25") == StopRule(StopKind.JOINT, M // 4)
    assert StopRule.confidence(Fraction(1, 2)).tau == HALF


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("greedy", "unknown stop rule"),
        ("fixed:0.5", "takes no threshold"),
        ("confidence", "needs a threshold"),
        ("joint:", "needs a threshold"),
        ("joint:abc", "not a number"),
        ("joint:1/0", "not a number"),
        ("confidence:nan", "not finite"),
        ("confidence:inf", "not finite"),
        ("confidence:1.5", "outside [0, 1]"),
        ("joint:-0.1", "outside [0, 1]"),
    ],
)
def test_parse_refuses_with_a_clear_message(text, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        StopRule.parse(text)


def test_rule_construction_refuses_bad_fields():
    with pytest.raises(ValueError, match="unknown stop rule kind"):
        StopRule(3, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside"):
        StopRule(StopKind.JOINT, M + 1)
    with pytest.raises(ValueError, match="outside"):
        StopRule(StopKind.JOINT, -1)
    with pytest.raises(ValueError, match="no threshold"):
        StopRule(StopKind.FIXED, 1)
    with pytest.raises(ValueError, match="not a bool"):
        threshold_of(True)
    assert StopRule(1, 7).kind is StopKind.CONFIDENCE  # a wire integer becomes the enum


def test_confidence_compares_the_last_count_only():
    rule = StopRule(StopKind.CONFIDENCE, 1000)
    assert continues(rule, [1000])
    assert not continues(rule, [999])
    assert continues(rule, [1, 1000])
    assert not continues(rule, [M, 999])
    assert not continues(StopRule(StopKind.CONFIDENCE, M), [M - 1])
    assert continues(StopRule(StopKind.CONFIDENCE, M), [M])
    assert continues(StopRule(StopKind.CONFIDENCE, 0), [0])


def test_joint_is_the_exact_integer_product():
    quarter = StopRule.joint("0.25")
    assert continues(quarter, [M // 2, M // 2])  # exactly 1/4: continue
    assert not continues(quarter, [M // 2, M // 2 - 1])
    assert continues(quarter, [M // 4])
    assert not continues(quarter, [M // 2, M // 2, M - 1])
    # A product far below 2**-53 and one just at the threshold of 2**-72.
    tiny = StopRule(StopKind.JOINT, 1)
    assert continues(tiny, [1])
    assert continues(tiny, [M, 1, M])
    assert not continues(tiny, [0])
    assert not continues(StopRule(StopKind.JOINT, 2), [1, M, M, M, M])
    assert continues(StopRule(StopKind.JOINT, 2), [2, M, M, M, M])
    assert not continues(StopRule.joint(1), [M, M, M - 1])
    assert continues(StopRule.joint(1), [M, M, M])
    assert continues(StopRule(), [0, 0])


def test_continues_refuses_bad_counts():
    with pytest.raises(ValueError, match="at least one"):
        continues(StopRule(), [])
    with pytest.raises(ValueError, match="outside"):
        continues(StopRule(), [M + 1])
    with pytest.raises(ValueError, match="outside"):
        continues(StopRule.joint("0.5"), [M, -1])


def test_admits_next_and_stop_after_handle_depth_and_the_terminal_token():
    rule = StopRule.confidence("0.5")
    assert admits_next(rule, 3, [M], [1], eos=2)
    assert not admits_next(rule, 3, [M], [2], eos=2)  # terminal token
    assert not admits_next(rule, 1, [M], [1], eos=None)  # depth reached
    assert not admits_next(rule, 3, [M // 4], [1], eos=None)  # the rule stops
    assert stop_after(rule, 3, [M, M, M], [0, 0, 0], None) == 3
    assert stop_after(rule, 3, [M, M // 4], [0, 0], None) == 2
    assert stop_after(rule, 3, [M, M], [0, 0], None) is None
    assert stop_after(rule, 3, [M, M, M], [0, 2, 0], 2) == 2
    assert stop_after(rule, 2, [M, M, M], [0, 0, 0], None) == 2  # rows past the depth
    with pytest.raises(ValueError, match="depth"):
        admits_next(rule, 6, [M], [0], None)
    with pytest.raises(ValueError, match="counts for"):
        stop_after(rule, 3, [M], [0, 0], None)
    with pytest.raises(ValueError, match="rows for depth"):
        admits_next(rule, 1, [M, M], [0, 0], None)


@pytest.mark.parametrize(
    ("depth", "counts", "tokens", "ok"),
    [
        (3, [M, M, M // 4], [0, 1, 0], True),  # ran to the depth
        (3, [M, M // 4], [0, 1], True),  # the rule stopped after row 2
        (3, [M, M], [0, 1], False),  # early: the rule continues after row 2
        (3, [M // 4, M], [0, 1], False),  # late: the rule stopped after row 1
        (3, [M, M, M, M], [0, 0, 0, 0], False),  # past the depth
        (3, [M, M], [0, 2], True),  # a terminal token ends it
        (3, [M, M, M], [2, 0, 0], False),  # a row after the terminal token
        (3, [], [], False),  # position 1 is always drawn
    ],
)
def test_audit_decisions(depth, counts, tokens, ok):
    rule = StopRule.confidence("0.5")
    verdict = audit(rule, depth, counts, tokens, eos=2)
    assert verdict is (None if ok else ErrorCode.STOP_RULE_VIOLATED)


def test_stop_rule_violation_code_is_a_row_validation_code():
    assert int(ErrorCode.STOP_RULE_VIOLATED) == 77


def test_oracle_refuses_a_non_dyadic_q_for_an_integer_rule():
    admit = oracle.rule_admission(StopRule.joint("0.5"))
    with pytest.raises(VerifyError):
        admit((), (0,), (Fraction(1, 3),))
    with pytest.raises(VerifyError):
        oracle.adaptive_round_distribution((), oracle.Drafting(6), q3, p3)
    with pytest.raises(VerifyError):
        oracle.adaptive_round_distribution((), oracle.Drafting(2, lambda *_: 2), q3, p3)


# -- the depth controller ---------------------------------------------------------------------


def test_controller_estimates_acceptance_from_recorded_rounds_only():
    c = DepthController(DepthPolicy(window=3))
    h = AcceptanceHistory()
    assert c.estimate(h) == HALF  # the prior
    h = c.record(h, 2, True)  # two accepted, then a rejection
    h = c.record(h, 3, False)  # a bonus: no failure, further positions never drawn
    assert c.estimate(h) == Fraction(2 + 3 + 1, 2 + 3 + 1 + 1 + 1)
    for _ in range(3):
        h = c.record(h, 0, True)
    assert h.rounds == ((0, True),) * 3  # the window forgets older rounds
    assert c.estimate(h) == Fraction(1, 5)
    with pytest.raises(ValueError, match="accepted"):
        c.record(h, 6, False)


def test_controller_depth_follows_acceptance_and_load():
    c = DepthController()
    good = AcceptanceHistory(((5, False),) * 16)
    poor = AcceptanceHistory(((0, True),) * 16)
    assert c.choose(good, 1) == 5
    assert c.choose(poor, 1) == 1
    # Heavier load makes each verified row dearer: never deeper.
    depths = [c.choose(good, n) for n in (1, 8, 64, 512, 4096)]
    assert depths == sorted(depths, reverse=True)
    assert depths[-1] < depths[0]
    assert c.choose(AcceptanceHistory(), 1) in range(1, 6)
    capped = DepthController(DepthPolicy(max_depth=2))
    assert capped.choose(good, 1) == 2
    with pytest.raises(ValueError, match="active slots"):
        c.choose(good, 0)


def test_controller_choice_is_the_exact_argmax():
    pol = DepthPolicy(draft_cost=Fraction(1, 10), row_cost=Fraction(1, 100))
    c = DepthController(pol)
    for rounds, load in product([((1, True),), ((2, True), (4, False)), ((0, True),) * 3], [1, 16]):
        h = AcceptanceHistory(rounds)
        a = c.estimate(h)
        cost = {d: 1 + d * pol.draft_cost + load * (d + 1) * pol.row_cost for d in range(1, 6)}
        scores = {d: sum(a**k for k in range(d + 1)) / cost[d] for d in range(1, 6)}
        best = max(scores.values())
        assert c.choose(h, load) == min(d for d, s in scores.items() if s == best)


def test_controller_breaks_ties_toward_the_shallower_depth():
    # alpha = 0 and free drafting: every depth commits one token at the same cost.
    c = DepthController(DepthPolicy(prior_accepted=0, draft_cost=0, row_cost=0))
    h = AcceptanceHistory(((0, True),))
    assert c.estimate(h) == 0
    assert c.choose(h, 1) == 1


def test_depth_policy_refuses_bad_constants():
    for kwargs, words in (
        ({"max_depth": 0}, "max depth"),
        ({"max_depth": 6}, "max depth"),
        ({"window": 0}, "window"),
        ({"prior_accepted": -1}, "pseudo-counts"),
        ({"prior_accepted": 0, "prior_rejected": 0}, "pseudo-counts"),
        ({"draft_cost": Fraction(-1)}, "draft cost"),
        ({"row_cost": -1}, "row cost"),
    ):
        with pytest.raises(ValueError, match=words):
            DepthPolicy(**kwargs)
