"""The compiled dense-row scan computes exactly what the numpy path computes."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.errors import ValidationError
from pp1wire.q import dyadic

fastq = pytest.importorskip("pp1wire.q._fastq")


def reference(q: np.ndarray) -> tuple[int, int, int]:
    bits = q.view(np.uint32)
    mx = int(bits.max())
    if mx > 0x3F800000:
        return mx, -1, -1  # the other results are unspecified then
    total = 0
    bad = 0
    for v in q.tolist():
        f = Fraction(v) * dyadic.M
        total += int(f)
        bad |= f.denominator != 1
    return mx, total, bad


@settings(max_examples=400, deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=40))
def test_scan_matches_exact_reference(values):
    q = np.array(values, dtype="<f4")
    mx, total, bad = fastq.scan_dense(q)
    want = reference(q)
    assert mx == want[0]
    if want[1] >= 0:
        assert (total, bad) == want[1:]


def test_scan_full_vocabulary_rows():
    rng = np.random.default_rng(0)
    counts = dyadic.counts_from_logits(rng.standard_normal(129_280) * 3)
    q = dyadic.counts_to_fp32(counts)
    assert fastq.scan_dense(q) == (int(q.view(np.uint32).max()), dyadic.M, 0)
    q2 = q.copy()
    q2[17] = np.float32(2.0**-30)
    assert fastq.scan_dense(q2)[2] == 1
    ones = np.ones(129_280, dtype="<f4")
    assert fastq.scan_dense(ones)[1] == 129_280 * dyadic.M  # no overflow in the sum


def test_scan_refuses_odd_lengths():
    with pytest.raises(ValueError, match="multiple of 4"):
        fastq.scan_dense(b"\x00" * 5)


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
