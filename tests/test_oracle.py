"""Exact enumeration: the standard verifier reproduces p, by rational arithmetic."""

from __future__ import annotations

from fractions import Fraction
from itertools import product

import pytest

from pp1wire.errors import ConstructionError, VerifyError
from pp1wire.q import oracle
from pp1wire.q.dyadic import M


def grid(denominator: int, size: int = 3) -> list[list[Fraction]]:
    """Every distribution on ``size`` tokens with probabilities in multiples of 1/denominator."""
    out = []
    for parts in product(range(denominator + 1), repeat=size - 1):
        if sum(parts) <= denominator:
            last = denominator - sum(parts)
            out.append([Fraction(v, denominator) for v in (*parts, last)])
    return out


def test_grid_sizes():
    assert len(grid(4)) == 15
    assert len(grid(8)) == 45


@pytest.mark.parametrize(("denominator", "pairs"), [(4, 225), (8, 2025)])
def test_every_grid_pair_reproduces_p(denominator, pairs):
    dists = grid(denominator)
    seen = 0
    for p, q in product(dists, dists):
        out = oracle.step_distribution(p, q)
        assert out == p
        assert oracle.accepted_mass(p, q) == [min(a, b) for a, b in zip(p, q, strict=True)]
        assert oracle.rejection_mass(p, q) == sum(max(a - b, 0) for a, b in zip(p, q, strict=True))
        # Correction mass added to the accepted mass recovers p exactly.
        reject = oracle.rejection_mass(p, q)
        if reject:
            r = oracle.residual(p, q)
            assert all(r[v] == 0 for v in range(3) if p[v] <= q[v])
            assert [a + reject * b for a, b in zip(oracle.accepted_mass(p, q), r, strict=True)] == p
        seen += 1
    assert seen == pairs


def test_no_rejection_when_p_equals_q():
    p = [Fraction(1, 2), Fraction(1, 4), Fraction(1, 4)]
    assert oracle.rejection_mass(p, p) == 0
    with pytest.raises(VerifyError):
        oracle.residual(p, p)
    assert oracle.step_distribution(p, p) == p


def test_zero_q_draft_is_refused():
    with pytest.raises(VerifyError):
        oracle.acceptance([Fraction(1)], [Fraction(0)], 0)


def test_float_inputs_mean_their_binary_values():
    assert oracle.exact(0.1) == Fraction(3602879701896397, 36028797018963968)
    with pytest.raises(ConstructionError):
        oracle.exact(float("nan"))
    assert oracle.normalize([0.5, 0.5]) == [Fraction(1, 2)] * 2


def test_dyadic_counts_exact_known_answer():
    assert oracle.dyadic_counts([1, 1, 1]) == [5592406, 5592405, 5592405]
    assert sum(oracle.dyadic_counts([3, 1, 4, 1, 5])) == M


# Prefix-dependent three-token models used for the joint-distribution tests.
def _weights(prefix: tuple[int, ...], salt: int) -> list[int]:
    h = hash((prefix[-2:], salt)) & 0xFFFF
    return [1 + (h >> (3 * i)) % 7 for i in range(3)]


def p_fn(prefix: tuple[int, ...]) -> list[Fraction]:
    w = _weights(prefix, 1)
    if prefix and prefix[-1] == 2:
        w[1] = 0  # a prefix-dependent "grammar" forbids token 1 after token 2
    return oracle.normalize(w)


def q_fn(prefix: tuple[int, ...]) -> list[Fraction]:
    # The proposal is a dyadic24 q of an unrelated prefix-dependent law; it may
    # propose tokens the target forbids.
    return oracle.q_from_counts(oracle.dyadic_counts(_weights(prefix, 2)))


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("eos", [None, 0])
def test_joint_law_at_fixed_depth_equals_target_only(depth, eos):
    length = depth + 2  # spans at least two rounds
    got = oracle.generate_distribution((1,), length, depth, q_fn, p_fn, eos)
    want = oracle.target_only_distribution((1,), length, p_fn, eos)
    assert got == want
    assert sum(got.values()) == 1


def test_round_law_commits_between_one_and_depth_plus_one_tokens():
    law = oracle.round_distribution((1,), 3, q_fn, p_fn)
    assert sum(law.values()) == 1
    assert {len(k) for k in law} <= {1, 2, 3, 4}
    assert any(len(k) == 4 for k in law)


def test_selection_bias_regression():
    half = Fraction(1, 2)
    p = q = [half, half]
    biased = oracle.selective_admission_distribution(p, q, admit=lambda x: x == 0)
    assert biased == [Fraction(3, 4), Fraction(1, 4)]
    fixed = oracle.round_distribution((), 1, lambda _: q, lambda _: p)
    # Depth 1 commits two tokens; the first one's marginal is the target's.
    first = {v: sum(m for k, m in fixed.items() if k[0] == v) for v in (0, 1)}
    assert first == {0: half, 1: half}
