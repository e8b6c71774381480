"""Vocabulary-sharded kernels equal their unsharded counterparts for every split.

Exhaustive on small vocabularies (every split of V = 1..7 into 1..V shards and
of V = 8 into 1..4, empty shards included), hypothesis on extreme inputs, the exact output law of
the sharded verifier on the quarter grid, and deliberately broken kernels
that these checks must catch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.errors import ConstructionError, Pp1Error
from pp1wire.q import dyadic, sharding, tree, verify
from pp1wire.q.dyadic import M

U53 = 1 << 53
U53_GRID = [0, 1, 2, 3, U53 // 3, U53 // 2 - 1, U53 // 2, 2 * U53 // 3, U53 - 2, U53 - 1]


def splits(v: int, parts: int) -> Iterator[list[int]]:
    """Every way to cut range(v) into `parts` contiguous pieces (empty ones included)."""
    for cuts in itertools.combinations_with_replacement(range(v + 1), parts - 1):
        yield list(cuts)


def all_splits(v: int) -> Iterator[list[int]]:
    """Every split of range(v) into 1..v shards; at V = 8 into 1..4 (220 of the 6,435:
    V = 7's 1,716 already include every shape of more shards than a group has ranks
    here, empty ones included, and the whole set took a tenth of the suite's time)."""
    for parts in range(1, (4 if v >= 8 else v) + 1):
        yield from splits(v, parts)


def cut(x: np.ndarray, cuts: Sequence[int]) -> list[np.ndarray]:
    return np.split(x, list(cuts))


def outcome(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)`` as plain lists, or the error code it raised (both must agree)."""
    try:
        out = fn(*args)
    except Pp1Error as exc:
        return exc.code
    if isinstance(out, tuple):
        return tuple(np.asarray(a).tolist() for a in out)
    if isinstance(out, list):
        return np.concatenate(out).tolist()
    if isinstance(out, np.ndarray):
        return out.tolist()
    return out


def weight_vectors(v: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Ties, a zero weight, spread-out and sparse random weights, subnormals.

    Above V = 5 the number of splits grows fast (1,716 at V = 7), so there only
    the vector that mixes ties, zeros and spread-out values is kept.
    """
    mixed = rng.random(v) ** 8
    mixed[rng.random(v) < 0.3] = 0.0
    mixed[: v // 2] = mixed[0]  # ties across shard borders
    mixed[-1] = 0.0
    vectors = [mixed]
    if v <= 5:
        vectors.append(np.arange(v, dtype=np.float64))
        for power in (1, 40):
            w = rng.random(v) ** power
            w[rng.random(v) < 0.3] = 0.0
            vectors.append(w)
        vectors += [np.ones(v), np.full(v, 5e-324)]
    return vectors


@pytest.mark.parametrize("v", range(1, 9))
def test_construction_equals_unsharded_for_every_split(v):
    rng = np.random.default_rng(v)
    for w in weight_vectors(v, rng):
        logits = np.where(w > 0, np.log(np.where(w > 0, w, 1.0)), -np.inf)
        want_dense = outcome(dyadic.counts_from_weights, w)
        want_logits = outcome(dyadic.counts_from_logits, logits, 0.7)
        ks = (1, 2, v) if v <= 5 else (2,)
        want_sparse = {k: outcome(dyadic.sparse_counts_from_weights, w, k) for k in ks}
        for cuts in all_splits(v):
            assert outcome(sharding.counts_from_weights, cut(w, cuts)) == want_dense
            assert outcome(sharding.counts_from_logits, cut(logits, cuts), 0.7) == want_logits
            for k, want in want_sparse.items():
                got = outcome(sharding.sparse_counts_from_weights, cut(w, cuts), k)
                assert got == want, (cuts, k)


def _breakpoints(counts: np.ndarray) -> list[int]:
    # Both samplers are step functions of u24 that can change value only where
    # the global cumulative count does (the sharded one's shard totals and
    # local sums are cumulative counts too): checking 0, every cumulative count
    # c and c - 1 covers every u24 in [0, 2**24).
    edges = {0, M - 1}
    for c in np.cumsum(counts).tolist():
        edges.update(x for x in (c - 1, c) if 0 <= x < M)
    return sorted(edges)


@pytest.mark.parametrize("v", range(1, 9))
def test_samplers_equal_unsharded_for_every_split(v):
    rng = np.random.default_rng(100 + v)
    for w in weight_vectors(v, rng):
        if not (w > 0).any():
            continue
        counts = dyadic.counts_from_weights(w)
        draws = _breakpoints(counts)
        want = [dyadic.sample(counts, u) for u in draws]
        p = verify.check_target(rng.random(v) * (rng.random(v) < 0.7) + 1e-300, v)
        grid = U53_GRID if v <= 5 else [0, U53 // 3, U53 - 1]
        want_r = [outcome(verify.residual_sample, p, counts, u) for u in grid]
        for cuts in all_splits(v):
            shards = cut(counts, cuts)
            assert [sharding.sample(shards, u) for u in draws] == want, cuts
            got_r = [outcome(sharding.residual_sample, cut(p, cuts), shards, u) for u in grid]
            assert got_r == want_r, cuts


def test_a_zero_mass_shard_is_never_chosen():
    counts = [np.zeros(3, dtype=np.int64), np.array([0, M], dtype=np.int64), np.zeros(0, np.int64)]
    assert {sharding.sample(counts, u) for u in (0, 1, M // 2, M - 1)} == {4}
    p = [np.zeros(3), np.array([0.0, 1.0]), np.zeros(0)]
    q = [np.zeros(3, dtype=np.int64), np.zeros(2, dtype=np.int64), np.zeros(0, np.int64)]
    assert {sharding.residual_sample(p, q, u) for u in U53_GRID} == {4}


finite = st.floats(min_value=0.0, max_value=1e300, allow_subnormal=True)
tiny = st.floats(min_value=0.0, max_value=1e-300, allow_subnormal=True)
weights_st = st.lists(st.one_of(finite, tiny, st.just(0.0), st.just(1.0)), min_size=1, max_size=24)


def random_cuts(data: st.DataObject, v: int) -> list[int]:
    parts = data.draw(st.integers(1, 4))
    return sorted(data.draw(st.lists(st.integers(0, v), min_size=parts - 1, max_size=parts - 1)))


@settings(max_examples=150, deadline=None)
@given(weights_st, st.data())
def test_hypothesis_construction(values, data):
    w = np.array(values, dtype=np.float64)
    cuts = random_cuts(data, w.size)
    k = data.draw(st.integers(1, w.size + 1))
    assert outcome(sharding.counts_from_weights, cut(w, cuts)) == outcome(
        dyadic.counts_from_weights, w
    )
    assert outcome(sharding.sparse_counts_from_weights, cut(w, cuts), k) == outcome(
        dyadic.sparse_counts_from_weights, w, k
    )


logit_st = st.lists(
    st.one_of(st.floats(-1e4, 1e4), st.just(-np.inf), st.just(0.0)), min_size=1, max_size=24
)


@settings(max_examples=150, deadline=None)
@given(logit_st, st.floats(0.05, 20.0), st.data())
def test_hypothesis_logits(values, temperature, data):
    x = np.array(values, dtype=np.float64)
    cuts = random_cuts(data, x.size)
    assert outcome(sharding.counts_from_logits, cut(x, cuts), temperature) == outcome(
        dyadic.counts_from_logits, x, temperature
    )
    k = data.draw(st.integers(1, 4))
    assert outcome(sharding.sparse_counts_from_logits, cut(x, cuts), temperature, k) == outcome(
        dyadic.sparse_counts_from_logits, x, temperature, k
    )


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.one_of(finite, tiny, st.just(0.0)), min_size=1, max_size=24),
    st.data(),
)
def test_hypothesis_residual(values, data):
    raw = np.array(values, dtype=np.float64)
    cuts = random_cuts(data, raw.size)
    p_want = outcome(verify.check_target, raw, raw.size)
    assert outcome(sharding.normalize_target, cut(raw, cuts)) == p_want
    if not isinstance(p_want, list):
        return
    p = np.array(p_want)
    # q: equal to p (no residual), disjoint from p, or an unrelated draft.
    mode = data.draw(st.sampled_from(["equal", "disjoint", "random"]))
    if mode == "equal" and (p > 0).sum() == 1:
        q = dyadic.point_mass(p.size, int(np.argmax(p)))
    elif mode == "disjoint" and (p == 0).any():
        q = dyadic.point_mass(p.size, int(np.flatnonzero(p == 0)[0]))
    else:
        q = dyadic.counts_from_weights(
            np.array(data.draw(st.lists(st.floats(0.0, 1.0), min_size=p.size, max_size=p.size)))
            + 1e-9
        )
    u = data.draw(st.one_of(st.sampled_from(U53_GRID), st.integers(0, U53 - 1)))
    assert outcome(sharding.residual_sample, cut(p, cuts), cut(q, cuts), u) == outcome(
        verify.residual_sample, p, q, u
    )


# -- the exact law through the sharded draws ----------------------------------------

QUARTERS = [
    tuple(Fraction(c, 4) for c in combo)
    for combo in itertools.product(range(5), repeat=3)
    if sum(combo) == 4
]


def _draw_law(draw: Callable[[int], int], n: int) -> list[Fraction]:
    # The draw is monotone in u53: each ID's draws form one interval.
    def first_reaching(index: int) -> int:
        lo, hi = 0, U53
        while lo < hi:
            mid = (lo + hi) // 2
            if draw(mid) >= index:
                hi = mid
            else:
                lo = mid + 1
        return lo

    edges = [first_reaching(i) for i in range(n)] + [U53]
    return [Fraction(edges[i + 1] - edges[i], U53) for i in range(n)]


@pytest.mark.parametrize("cuts", [[1], [1, 2]])
def test_sharded_verifier_law_is_p_on_the_quarter_grid(cuts):
    # For all 225 (p, q) pairs of the three-token quarter grid, split into 2 and
    # 3 shards: accepting x with probability min(1, p/q) (the exact integer
    # test, which sharding does not touch) and otherwise drawing the correction
    # through the sharded residual draw gives each token p, with the
    # correction's law read exactly off the draw's u53 intervals. Tolerance
    # declared: the residual weights and their tree sums are exact here (quarter
    # values), but the target u * total is rounded once per draw and the
    # descent subtracts in binary64, so each token's mass is within
    # (2L + 4) * 2**-52 (L = 2 for three tokens) times the rejected mass, the
    # qualification bound of the unsharded draw.
    for p_frac in QUARTERS:
        for q_frac in QUARTERS:
            p = np.array([float(x) for x in p_frac])
            counts = np.array([int(x * M) for x in q_frac], dtype=np.int64)
            accepted = [min(a, b) for a, b in zip(p_frac, q_frac, strict=True)]
            rejected = sum(max(a - b, Fraction(0)) for a, b in zip(p_frac, q_frac, strict=True))
            law = list(accepted)
            bound = rejected * Fraction(2 * 2 + 4, 1 << 52)
            if rejected:
                correction = _draw_law(
                    lambda u, p=p, counts=counts: sharding.residual_sample(
                        cut(p, cuts), cut(counts, cuts), u
                    ),
                    3,
                )
                law = [a + rejected * c for a, c in zip(accepted, correction, strict=True)]
            for got, want in zip(law, p_frac, strict=True):
                assert abs(got - want) <= bound, (p_frac, q_frac)


# -- deliberately broken kernels: the checks above must catch each ------------------


def _mismatch(
    broken: Callable[[list[np.ndarray]], object], reference: Callable[[np.ndarray], object]
) -> bool:
    rng = np.random.default_rng(7)
    for v in range(1, 7):
        for w in weight_vectors(v, rng):
            want = outcome(reference, w)
            for cuts in all_splits(v):
                if outcome(broken, cut(w, cuts)) != want:
                    return True
    return False


def test_broken_local_normalization_is_caught():
    def local(shards):
        # Each shard normalized on its own and given M times its share: not global.
        total = sum(float(s.sum()) for s in shards)
        out = []
        for s in shards:
            if s.size == 0 or not s.sum() > 0:
                out.append(np.zeros(s.size, dtype=np.int64))
                continue
            c = dyadic.counts_from_weights(s)
            out.append((c * (float(s.sum()) / total)).astype(np.int64))
        return out

    assert _mismatch(local, dyadic.counts_from_weights)


def test_broken_top_k_tie_to_highest_id_is_caught():
    def highest(shards, k=2):
        w = np.concatenate(shards)
        if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
            raise ConstructionError(dyadic.ErrorCode.ZERO_MASS, "")
        ids = np.lexsort((-np.arange(w.size), -w))[:k]
        ids = np.sort(ids[w[ids] > 0])
        counts = dyadic.counts_from_weights(w[ids])
        keep = counts > 0
        return ids[keep].astype(np.int32), counts[keep]

    assert _mismatch(highest, lambda w: dyadic.sparse_counts_from_weights(w, 2))


def test_broken_residual_that_skips_ids_outside_the_sparse_support_is_caught():
    rng = np.random.default_rng(11)
    caught = False
    for v in range(2, 7):
        p = verify.check_target(rng.random(v), v)
        ids, counts = dyadic.sparse_counts_from_weights(rng.random(v), 1)
        dense = np.zeros(v, dtype=np.int64)
        dense[ids] = counts
        for cuts in all_splits(v):

            def skipping(u, cuts=cuts, p=p, dense=dense):
                shards_p, shards_q = cut(p, cuts), cut(dense, cuts)
                # Residual formed only on the sparse support: IDs outside it get 0.
                masked = [
                    np.where(q > 0, pp, 0.0) for pp, q in zip(shards_p, shards_q, strict=True)
                ]
                return outcome(sharding.residual_sample, masked, shards_q, u)

            want = [outcome(verify.residual_sample, p, dense, u) for u in U53_GRID]
            if [skipping(u) for u in U53_GRID] != want:
                caught = True
    assert caught


def test_canonical_tree_is_the_same_for_every_split():
    rng = np.random.default_rng(5)
    for v in range(1, 9):
        x = rng.random(v) ** 20
        whole = tree.levels(x)
        for cuts in all_splits(v):
            t = tree.ShardedTree.build(cut(x, cuts))
            assert t.total == whole[-1][0]
            for u in U53_GRID:
                target = (u / float(U53)) * t.total
                assert t.descend(target) == tree.descend(whole, target)


def test_descent_never_enters_a_zero_child():
    # Rounding can leave a target at or past a child's value; the descent rule
    # (docs/protocol.md section 6.6) still never steps into a zero-weight subtree.
    levels = tree.levels([0.5, 0.0])
    assert tree.descend(levels, 0.5) == 0  # t >= a, but b = 0: left
    assert tree.descend(levels, 0.75) == 0
    levels = tree.levels([0.0, 0.5])
    assert tree.descend(levels, 0.0) == 1  # a = 0: right, whatever t
    levels = tree.levels([0.0, 0.25, 0.0, 0.0])
    for t in (0.0, 0.25, 0.3, 1.0):
        assert tree.descend(levels, t) == 1
        assert tree.ShardedTree.build([[0.0], [0.25, 0.0], [0.0]]).descend(t) == 1
