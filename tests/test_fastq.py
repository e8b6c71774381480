"""The compiled construction and draw compute exactly what the numpy paths compute."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.errors import ErrorCode, ValidationError
from pp1wire.q import dyadic, rows

fastq = pytest.importorskip("pp1wire.q._fastq")


def test_dense_check_of_full_vocabulary_rows():
    rng = np.random.default_rng(0)
    counts = dyadic.counts_from_logits(rng.standard_normal(129_280) * 3)
    q = dyadic.counts_to_fp32(counts)
    token = int(np.argmax(counts))
    assert fastq.check_dense(q, 129_280, token) == 0
    q2 = q.copy()
    q2[17] = np.float32(2.0**-30)
    assert fastq.check_dense(q2, 129_280, token) == ErrorCode.NON_DYADIC
    ones = np.ones(129_280, dtype="<f4")  # 129,280 * M: the sum must not wrap to M
    assert fastq.check_dense(ones, 129_280, 0) == ErrorCode.MASS_MISMATCH


def _both_paths(weights: np.ndarray) -> tuple:
    """(compiled, numpy) outcome of QBuilder.allocate: counts, or the error's code."""
    out = []
    for compiled in (True, False):
        with pytest.MonkeyPatch.context() as m:
            if not compiled:
                m.setattr(dyadic, "_fastq", None)
            b = dyadic.QBuilder(weights.size)
            w = weights.astype(np.float64)
            try:
                out.append(b.allocate(w, dyadic.tree.total(w)).copy())
            except dyadic.ConstructionError as exc:
                out.append(exc.code)
    return tuple(out)


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


# Ties (repeated weights), zeros, huge dynamic ranges and subnormals stress the
# leftover-ticket choice; every case must be bit-equal to the numpy path.
weights_rows = st.lists(
    st.one_of(
        st.sampled_from([0.0, 1.0, 3.0, 1e-300, 5e-324, 2.0**-1022, 0.5, 1e300]),
        st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
    ),
    min_size=1,
    max_size=300,
)


@settings(max_examples=400, deadline=None)
@given(weights_rows)
def test_compiled_allocation_is_bit_equal_to_numpy(values):
    w = np.array(values, dtype=np.float64)
    if not w.sum() > 0 or not np.isfinite(dyadic.tree.total(w)):
        return  # refused before allocation by both paths
    compiled, numpy_path = _both_paths(w)
    assert _same(compiled, numpy_path), (compiled, numpy_path)


@pytest.mark.parametrize("seed", range(6))
def test_compiled_allocation_full_vocabulary_rows(seed):
    rng = np.random.default_rng(seed)
    rows = [
        np.exp(rng.standard_normal(129_280) * 3),
        np.round(rng.random(129_280) * 4),  # many exact ties, zeros
        np.ones(129_280),  # every remainder equal: ties to the lowest index
        np.where(rng.random(129_280) < 0.01, 1.0, 0.0),
    ]
    for w in rows:
        if not w.sum() > 0:
            continue
        compiled, numpy_path = _both_paths(w)
        assert isinstance(compiled, np.ndarray)
        assert _same(compiled, numpy_path)
        assert int(compiled.sum(dtype=np.int64)) == dyadic.M


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.one_of(st.floats(allow_nan=False), st.sampled_from([0.0, 5e-324, 1e308])),
        min_size=1,
        max_size=70,
    )
)
def test_compiled_canonical_total_is_the_tree_root_bit_for_bit(values):
    x = np.array(values, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # sums may overflow, as in C
        want = dyadic.tree.levels(x)[-1][0]
    got = fastq.tree_total(x)
    assert (np.isnan(want) and np.isnan(got)) or np.float64(got).tobytes() == want.tobytes()


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4096, 4097, 129_280])
def test_compiled_canonical_total_at_every_shape(n):
    rng = np.random.default_rng(n)
    x = np.exp(rng.standard_normal(n) * 5)
    x[rng.random(n) < 0.3] = 0.0
    assert np.float64(fastq.tree_total(x)).tobytes() == dyadic.tree.levels(x)[-1][0].tobytes()


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(st.integers(0, 50), min_size=1, max_size=300),
    u=st.integers(0, (1 << 24) - 1),
    spoil=st.sampled_from(["none", "negative", "mass"]),
)
def test_compiled_proposal_draw_equals_the_numpy_draw(weights, u, spoil):
    counts = dyadic.counts_from_weights(np.array(weights, dtype=np.float64) + 1e-3)
    counts = counts.astype(np.int32)
    if spoil == "negative":
        counts[len(counts) // 2] = -1
    elif spoil == "mass":
        counts[0] += 1
    results = []
    for fast in (dyadic._fastq, None):
        saved, dyadic._fastq = dyadic._fastq, fast
        try:
            results.append(dyadic.sample(counts, u))
        except ValidationError as exc:
            results.append(exc.code)
        finally:
            dyadic._fastq = saved
    assert results[0] == results[1]
    if spoil == "none":
        assert isinstance(results[0], int)
        assert int(np.cumsum(counts)[results[0]]) > u


# -- batches of rows: allocate_rows and the sparse candidates --------------------


def _rows_both_paths(w: np.ndarray, draws: list[int]) -> tuple:
    """(compiled, numpy) allocate_rows: counts and per-row token or error code."""
    out = []
    for compiled in (True, False):
        with pytest.MonkeyPatch.context() as m:
            if not compiled:
                m.setattr(dyadic, "_fastq", None)
            counts, picks = rows.allocate_rows(w, draws)
        out.append((counts, [p if isinstance(p, int) else p.code for p in picks]))
    return tuple(out)


def _boundary_draws(counts: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Draws at, just below and just above cumulative count boundaries (and the ends)."""
    cum = np.cumsum(counts, dtype=np.int64)
    picks = [0, dyadic.M - 1]
    for j in rng.integers(0, counts.size, size=6):
        c = int(cum[j])
        picks += [c - 1, c, c + 1]
    for j in range(4096 - 1, counts.size, 4096):  # the draw index's block ends
        picks.append(int(cum[j]))
    return [p for p in picks if 0 <= p < dyadic.M]


@settings(max_examples=200, deadline=None)
@given(st.lists(weights_rows, min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_allocate_rows_equals_allocate_then_sample(rows, rnd):
    n = len(rows[0])
    w = np.array([(r * n)[:n] for r in rows], dtype=np.float64)
    w = w[[bool(np.isfinite(dyadic.tree.total(x)) and x.sum() > 0) for x in w]]
    if not len(w):
        return
    rng = np.random.default_rng(rnd.getrandbits(32))
    ref = dyadic.counts_from_weights(w[0])
    draws = (_boundary_draws(ref, rng) * len(w))[: len(w)]
    (c1, p1), (c2, p2) = _rows_both_paths(w, draws)
    assert c1.dtype == c2.dtype == np.int32
    assert p1 == p2
    for r, pick in enumerate(p1):
        if isinstance(pick, int):
            assert np.array_equal(c1[r], c2[r])
            assert pick == dyadic.sample(dyadic.counts_from_weights(w[r]), draws[r])


@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 4097, 8193, 129_280])
def test_allocate_rows_at_block_boundaries_and_full_vocabulary(n):
    rng = np.random.default_rng(n)
    rows = [
        np.exp(rng.standard_normal(n) * 3),
        np.round(rng.random(n) * 4) + (np.arange(n) == 0),  # ties and zeros, not all zero
        np.ones(n),
        np.exp(rng.standard_normal(n) * 3) * 2.0**-1060,  # total / M subnormal
    ]
    for w in rows:
        counts = dyadic.counts_from_weights(w)
        draws = _boundary_draws(counts, rng)
        batch = np.repeat(w[None, :], len(draws), axis=0)
        (c1, p1), (c2, p2) = _rows_both_paths(batch, draws)
        assert p1 == p2 == [dyadic.sample(counts, u) for u in draws]
        assert (c1 == counts.astype(np.int32)).all()
        assert np.array_equal(c1, c2)


def test_allocate_rows_refuses_draws_outside_the_range_as_sample_does():
    w = np.ones((3, 5))
    for draws in ([dyadic.M, -1, 0],):
        (_, p1), (_, p2) = _rows_both_paths(w, draws)
        assert p1 == p2 == [ErrorCode.BAD_DRAW, ErrorCode.BAD_DRAW, 0]


def test_the_counts_pass_refuses_bad_buffers():
    w = np.ones(5)
    tokens, status = np.empty(1, np.int64), np.empty(1, np.int32)
    draws, work = np.zeros(1, np.int64), np.empty(10, np.float64)
    with pytest.raises(ValueError, match="fewer than n"):
        fastq.construct_rows([w], 5, draws, tokens, status, [np.empty(4, np.int32)], work, False)
    with pytest.raises(ValueError, match="sizes"):
        fastq.construct_rows([w], 0, draws, tokens, status, [np.empty(5, np.int32)], work, False)


logit_rows = st.lists(
    st.one_of(
        st.sampled_from([0.0, 1.0, -1.0, 3.5, -np.inf, 1e300, -1e300, 700.0, -745.0]),
        st.floats(-50, 50),
        st.integers(-3, 3).map(float),  # exact ties
    ),
    min_size=1,
    max_size=200,
)


def _sparse_reference(x: np.ndarray, temperature: float, k: int):
    with pytest.MonkeyPatch.context() as m, np.errstate(over="ignore"):
        m.setattr(dyadic, "_fastq", None)  # largest_indices over the full weights
        try:
            return dyadic.sparse_counts_from_logits(x, temperature, k)
        except dyadic.ConstructionError as exc:
            return exc.code


def _sparse_fast(x: np.ndarray, temperature: float, k: int):
    try:
        dyadic.check_k(k)
        dyadic.check_temperature(temperature)
        top = dyadic.check_top(float(x.max()))
        with np.errstate(over="ignore"):
            return dyadic.sparse_row_from_logits(x, top, temperature, k)
    except dyadic.ConstructionError as exc:
        return exc.code


def _same_sparse(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return all(p.dtype == q.dtype and np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    return a == b


@settings(max_examples=400, deadline=None)
@given(
    logit_rows,
    st.sampled_from([1.0, 0.5, 2.0, 1e-3, 1e3, 1e-300]),
    st.sampled_from([1, 2, 3, 8, 32, 500]),
)
def test_sparse_candidates_give_the_full_rows_support(values, temperature, k):
    x = np.array(values, dtype=np.float64)
    want = _sparse_reference(x, temperature, k)
    got = _sparse_fast(x, temperature, k)
    assert _same_sparse(got, want), (got, want)


@pytest.mark.parametrize("seed", range(4))
def test_sparse_candidates_on_full_vocabulary_rows(seed):
    rng = np.random.default_rng(seed)
    n = 129_280
    base = rng.standard_normal(n) * 3
    rows = [
        base,
        np.round(base),  # thousands of tied logits at the cut
        np.where(rng.random(n) < 0.5, -np.inf, base),
        np.zeros(n),  # flat: the candidates overflow, the full row decides
        base * 1e-9,  # nearly flat
        base * 40,  # very peaked
    ]
    for x in rows:
        for temperature, k in ((1.0, 32), (0.7, 32), (1.3, 1), (1.0, 1024)):
            want = _sparse_reference(x, temperature, k)
            assert isinstance(want, tuple)
            assert _same_sparse(_sparse_fast(x, temperature, k), want)


def test_sparse_candidates_gather_the_cut_and_the_largest_left_out():
    x = np.array([0.0, -1.0, -2.0, -0.05, -50.0, -np.inf, -0.5])
    idx = np.empty(16, dtype=np.int64)
    # Buckets of 1/16: the 2nd largest (-0.05) is in bucket 0; margin 16 -> distance < 17/16.
    count, out_max = fastq.sparse_candidates(x, 0.0, 16.0, 2, 16, idx)
    assert idx[:count].tolist() == [0, 1, 3, 6]
    assert out_max == -2.0
    # More candidates than room, or the k-th logit out of reach: no cut.
    assert fastq.sparse_candidates(x, 0.0, 16.0, 2, 16, np.empty(3, np.int64))[0] == -1
    assert fastq.sparse_candidates(x, 0.0, 16.0, 6, 16, idx) == (6, -np.inf)
    assert fastq.sparse_candidates(x, 0.0, 16.0, 7, 16, idx)[0] == -1  # the 7th is -inf
    assert fastq.sparse_candidates(x, 0.0, 16.0, 8, 16, idx)[0] == -1  # fewer than k
    for scale in (np.inf, 0.0, np.nan):  # temperatures whose distances could be NaN
        assert fastq.sparse_candidates(x, 0.0, scale, 2, 16, idx)[0] == -1


def test_sparse_candidates_fall_back_when_a_tie_is_left_out(monkeypatch):
    # Two logits one ulp apart straddle a bucket boundary and get the same
    # weight; the lower ID is outside the candidates (margin 0). Only the
    # proof (the largest logit left out has a weight below the k-th) catches it.
    x_out = -1.0 / 16
    x = np.array([0.0, x_out, np.nextafter(x_out, 0.0), -3.0])
    w = dyadic.weights_from_logits(x, 1.0)
    assert w[1] == w[2]  # the tie the support must break to ID 1
    want = _sparse_reference(x, 1.0, 2)
    assert want[0].tolist() == [0, 1]
    monkeypatch.setattr(dyadic, "_CANDIDATE_MARGIN", 0)
    idx = np.empty(8, dtype=np.int64)
    count, _ = fastq.sparse_candidates(x, 0.0, 16.0, 2, 0, idx)
    assert idx[:count].tolist() == [0, 2]  # ID 1 left out
    assert _same_sparse(_sparse_fast(x, 1.0, 2), want)
