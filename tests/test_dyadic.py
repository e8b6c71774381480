"""dyadic24 construction, sampling and one test per receive-validation error class."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.errors import ConstructionError, ErrorCode, ValidationError
from pp1wire.q import dyadic, oracle, validate
from pp1wire.q.dyadic import M

V = 1000


def _valid_dense(vocab=V, seed=0):
    rng = np.random.default_rng(seed)
    counts = dyadic.counts_from_weights(rng.random(vocab) ** 4)
    return counts, dyadic.counts_to_fp32(counts)


# -- construction -----------------------------------------------------------


def test_names():
    assert M == 1 << 24
    assert dyadic.SEMANTIC_ID == "dyadic24-standard-v1"


def test_known_answer_three_equal_weights():
    assert dyadic.counts_from_weights([1.0, 1.0, 1.0]).tolist() == [5592406, 5592405, 5592405]


def test_ties_go_to_the_lowest_id():
    # Eleven equal shares leave 2**24 mod 11 = 5 tickets: IDs 0..4 get them.
    out = dyadic.counts_from_weights([1.0] * 11).tolist()
    base = M // 11
    assert out == [base + 1] * 5 + [base] * 6
    # Equal remainders at non-adjacent IDs: still lowest IDs first.
    out = dyadic.counts_from_weights([1.0, 2.0, 1.0, 2.0, 1.0]).tolist()
    assert sum(out) == M
    assert out == oracle.dyadic_counts([1, 2, 1, 2, 1])


def test_tiny_weights_become_zero():
    out = dyadic.counts_from_weights([1.0, 1e-12, 1e-300, 0.0])
    assert out.tolist() == [M, 0, 0, 0]


def test_result_dtype_and_sum():
    counts, _ = _valid_dense()
    assert counts.dtype == np.int64
    assert int(counts.sum()) == M
    assert (counts >= 0).all()


@pytest.mark.parametrize(
    ("weights", "code"),
    [
        ([1.0, float("nan")], ErrorCode.WEIGHT_NON_FINITE),
        ([1.0, float("inf")], ErrorCode.WEIGHT_NON_FINITE),
        ([1.0, -0.5], ErrorCode.WEIGHT_NEGATIVE),
        ([0.0, 0.0], ErrorCode.ZERO_MASS),
        ([1e308, 1e308], ErrorCode.WEIGHT_NON_FINITE),
        ([], ErrorCode.BAD_SHAPE),
        ([[1.0]], ErrorCode.BAD_SHAPE),
    ],
)
def test_weight_refusals(weights, code):
    with pytest.raises(ConstructionError) as info:
        dyadic.counts_from_weights(weights)
    assert info.value.code is code


def test_logits_with_masked_entries():
    out = dyadic.counts_from_logits([0.0, -np.inf, 0.0, -np.inf], temperature=1.0)
    assert out.tolist() == [M // 2, 0, M // 2, 0]


def test_logits_temperature():
    logits = np.array([0.0, np.log(3.0)])
    assert dyadic.counts_from_logits(logits, 1.0).tolist() == [M // 4, 3 * M // 4]
    # Temperature 2 takes the square root of the weight ratio.
    assert dyadic.counts_from_logits(2 * logits, 2.0).tolist() == [M // 4, 3 * M // 4]


@pytest.mark.parametrize(
    ("logits", "temperature", "code"),
    [
        ([0.0, float("nan")], 1.0, ErrorCode.WEIGHT_NON_FINITE),
        ([0.0, float("inf")], 1.0, ErrorCode.WEIGHT_NON_FINITE),
        ([-np.inf, -np.inf], 1.0, ErrorCode.ZERO_MASS),
        ([0.0, 1.0], 0.0, ErrorCode.BAD_TEMPERATURE),
        ([0.0, 1.0], -1.0, ErrorCode.BAD_TEMPERATURE),
        ([0.0, 1.0], float("nan"), ErrorCode.BAD_TEMPERATURE),
    ],
)
def test_logit_refusals(logits, temperature, code):
    with pytest.raises(ConstructionError) as info:
        dyadic.counts_from_logits(logits, temperature)
    assert info.value.code is code


def test_allocation_refuses_inconsistent_remainder(monkeypatch):
    # Force floors above the shares, as a broken binary64 normalization would:
    # the allocation must refuse rather than clip.
    real_copyto = np.copyto

    def broken_copyto(dst, src, **kwargs):
        real_copyto(dst, src, **kwargs)
        if dst.dtype.kind == "i":
            dst += 1

    monkeypatch.setattr(dyadic.np, "copyto", broken_copyto)
    monkeypatch.setattr(dyadic, "_fastq", None)  # the numpy path is the one broken here
    with pytest.raises(ConstructionError) as info:
        dyadic.counts_from_weights([1.0, 1.0, 1.0])
    assert info.value.code is ErrorCode.ALLOCATION_INCONSISTENT


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_allocation_refuses_a_total_that_does_not_match_the_weights(monkeypatch, path):
    # A total below the weights' sum gives more than M tickets in floors alone;
    # one far above leaves more tickets over than there are entries.
    if path == "numpy":
        monkeypatch.setattr(dyadic, "_fastq", None)
    elif dyadic._fastq is None:
        pytest.skip("compiled fast path not built")
    w = np.array([1.0, 1.0, 1.0])
    for total in (1.0, 3.0 * 2**30):
        with pytest.raises(ConstructionError) as info:
            dyadic.QBuilder(3).allocate(w, total)
        assert info.value.code is ErrorCode.ALLOCATION_INCONSISTENT


class _Recorded:
    """A backend that records the pieces allocate_with asks for, around the numpy row's."""

    def __init__(self, w: np.ndarray, total: float) -> None:
        self.inner = dyadic._NumpyRow(dyadic.QBuilder(w.size), w, total)
        self.n = w.size
        self.asked: list[str] = []
        self.where = self.inner.where

    def __getattr__(self, name):
        piece = getattr(self.inner, name)

        def asked(*args):
            self.asked.append(name)
            return piece(*args)

        return asked


@pytest.mark.parametrize(
    ("weights", "total", "status"),
    [
        ([1.0, 1.0, 1.0], 3.0, 0),  # tickets left over, ties to the lowest ID
        ([1.0, 1.0], 2.0, 0),  # none left over
        ([1.0, 1.0, 1.0], 1.0, 1),  # more than M in floors alone
        ([1.0, 1.0, 1.0], 3.0 * 2**30, 1),  # more tickets left than entries
    ],
)
def test_the_allocation_rule_asks_for_every_piece_in_its_order(weights, total, status):
    # Every piece, once and in the rule's order, whatever the row: a sharded backend's
    # collectives are then the same on every rank.
    rows = _Recorded(np.array(weights), total)
    assert dyadic.allocate_with(rows) == status
    assert rows.asked == ["floors", "threshold", "above", "assign"]
    if status == 0:
        assert rows.inner.b.out.tolist() == oracle.dyadic_counts(weights)


def _exact_cut_gap(weights) -> Fraction:
    """Gap between the exact remainders just inside and just outside the ticket cut."""
    q = oracle.normalize(weights)
    rems = sorted((v * M - (v * M).__floor__() for v in q), reverse=True)
    remaining = M - sum((v * M).__floor__() for v in q)
    if remaining in (0, len(rems)):
        return Fraction(1)
    return rems[remaining - 1] - rems[remaining]


# The binary64 allocation rounds each share once, so it can only differ from
# the exact rational allocation where two exact remainders at the cut are
# within a few ulps of each other (an exact tie broken by rounding). Bound
# asserted: identical counts when the exact cut gap exceeds 2**-30 (far above
# binary64 error on shares below 2**24); otherwise at most one ticket per entry.
@pytest.mark.usefixtures("dyadic_path")  # each backend against the exact oracle
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.lists(st.integers(0, 50), min_size=1, max_size=12).filter(any),
        st.lists(
            st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False),
            min_size=1,
            max_size=12,
        ).filter(lambda w: sum(w) > 0),
    )
)
def test_float_allocation_qualified_against_exact(weights):
    got = dyadic.counts_from_weights(weights)
    want = np.array(oracle.dyadic_counts(weights))
    assert int(got.sum()) == M
    if _exact_cut_gap(weights) > Fraction(1, 2**30):
        assert got.tolist() == want.tolist()
    else:
        assert np.abs(got - want).max() <= 1


def test_sparse_topk_support_and_ties():
    w = [0.1, 0.3, 0.3, 0.0, 0.3, 0.2]
    ids, counts = dyadic.sparse_counts_from_weights(w, 2)
    assert ids.dtype == np.int32
    assert counts.dtype == np.int64
    assert ids.tolist() == [1, 2]
    assert counts.tolist() == [M // 2, M // 2]
    ids, counts = dyadic.sparse_counts_from_weights(w, 4)
    assert ids.tolist() == [1, 2, 4, 5]
    assert int(counts.sum()) == M


def test_sparse_never_selects_zero_weights_and_drops_zero_counts():
    ids, counts = dyadic.sparse_counts_from_weights([0.0, 1.0, 0.0, 1e-300], 4)
    assert ids.tolist() == [1]
    assert counts.tolist() == [M]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=10).filter(any),
    st.integers(1, 6),
)
def test_sparse_matches_exact(weights, k):
    # Same bound as the dense qualification, applied within the chosen support
    # (support selection itself compares integers, so it is exact).
    ids, counts = dyadic.sparse_counts_from_weights(weights, k)
    want = oracle.sparse_dyadic_counts(weights, k)
    assert set(ids.tolist()) <= set(range(len(weights)))
    assert (np.diff(ids) > 0).all()
    assert int(counts.sum()) == M
    support = sorted(
        sorted((i for i, w in enumerate(weights) if w), key=lambda i: (-weights[i], i))[:k]
    )
    if _exact_cut_gap([weights[i] for i in support]) > Fraction(1, 2**30):
        assert dict(zip(ids.tolist(), counts.tolist(), strict=True)) == want
    else:
        got = dict(zip(ids.tolist(), counts.tolist(), strict=True))
        assert all(abs(got.get(i, 0) - want.get(i, 0)) <= 1 for i in support)


def test_sparse_k_must_be_positive():
    with pytest.raises(ConstructionError):
        dyadic.sparse_counts_from_weights([1.0], 0)


def test_point_mass():
    pm = dyadic.point_mass(5, 3)
    assert pm.tolist() == [0, 0, 0, M, 0]
    with pytest.raises(ConstructionError):
        dyadic.point_mass(5, 5)


def test_fp32_encoding_is_exact():
    counts, q = _valid_dense()
    assert q.dtype == np.dtype("<f4")
    assert np.array_equal((q.astype(np.float64) * M).astype(np.int64), counts)
    assert [Fraction(float(v)) for v in q[:5]] == [Fraction(int(c), M) for c in counts[:5]]


# -- sampling ----------------------------------------------------------------


def test_sample_first_cumulative_strictly_greater():
    counts = [0, 3, 0, M - 3]
    assert dyadic.sample(counts, 0) == 1
    assert dyadic.sample(counts, 2) == 1
    assert dyadic.sample(counts, 3) == 3
    assert dyadic.sample(counts, M - 1) == 3


def test_sample_never_picks_zero_counts():
    counts = np.array([5, 0, 0, M - 10, 0, 5], dtype=np.int64)
    for u in [0, 4, 5, 6, M - 6, M - 5, M - 1]:
        assert counts[dyadic.sample(counts, u)] > 0


@pytest.mark.parametrize("u", [-1, M])
def test_sample_refuses_out_of_range_draws(u):
    with pytest.raises(ValidationError) as info:
        dyadic.sample([M], u)
    assert info.value.code is ErrorCode.BAD_DRAW


def test_sample_refuses_bad_counts():
    with pytest.raises(ValidationError) as info:
        dyadic.sample([1, 2], 0)
    assert info.value.code is ErrorCode.MASS_MISMATCH
    with pytest.raises(ValidationError) as info:
        dyadic.sample([M + 1, -1], 0)
    assert info.value.code is ErrorCode.NEGATIVE


def test_sample_law_is_exact():
    # Enumerate every u on a reduced scale: the number of u mapping to v is c_v.
    counts = np.array([3, 0, 5, M - 8])
    hits = np.bincount([dyadic.sample(counts, u) for u in range(10)], minlength=4)
    assert hits[:3].tolist() == [3, 0, 5]


# -- dense validation: one test per class (compiled and numpy paths) -----------

dense_paths = pytest.mark.usefixtures("dyadic_path")


def _code(fn, *args, **kwargs):
    with pytest.raises(ValidationError) as info:
        fn(*args, **kwargs)
    return info.value.code


@dense_paths
def test_dense_valid_row_round_trips():
    counts, q = _valid_dense()
    token = int(np.flatnonzero(counts)[0])
    assert np.array_equal(validate.validate_dense(q.tobytes(), V, token), counts)
    assert np.array_equal(validate.validate_dense(q, V, token), counts)


@dense_paths
def test_dense_point_mass_validates():
    q = dyadic.counts_to_fp32(dyadic.point_mass(V, 7))
    assert validate.validate_dense(q, V, 7)[7] == M


@dense_paths
def test_dense_wrong_length():
    _, q = _valid_dense()
    assert _code(validate.validate_dense, q[:-1], V, 0) is ErrorCode.ROW_LENGTH
    assert _code(validate.validate_dense, q.tobytes()[:-2], V, 0) is ErrorCode.ROW_LENGTH


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@dense_paths
def test_dense_non_finite(bad):
    counts, q = _valid_dense()
    q = q.copy()
    q[5] = bad
    assert _code(validate.validate_dense, q, V, int(np.argmax(counts))) is ErrorCode.NON_FINITE


@pytest.mark.parametrize("bad", [-0.0, -(2.0**-24)])
@dense_paths
def test_dense_negative_including_negative_zero(bad):
    counts, q = _valid_dense()
    q = q.copy()
    z = int(np.flatnonzero(counts == 0)[0]) if (counts == 0).any() else 0
    q[z] = bad
    assert _code(validate.validate_dense, q, V, int(np.argmax(counts))) is ErrorCode.NEGATIVE


@pytest.mark.parametrize("bad", [2.0**-25, 0.1, 1e-40, 1.5])
@dense_paths
def test_dense_non_dyadic(bad):
    counts, q = _valid_dense()
    q = q.copy()
    q[3] = np.float32(bad)
    assert _code(validate.validate_dense, q, V, int(np.argmax(counts))) is ErrorCode.NON_DYADIC


@dense_paths
def test_dense_total_mass():
    counts, q = _valid_dense()
    q = q.copy()
    i = int(np.argmax(counts))
    q[i] = np.float32((counts[i] + 1) / M)
    assert _code(validate.validate_dense, q, V, i) is ErrorCode.MASS_MISMATCH
    q[i] = np.float32((counts[i] - 1) / M)
    assert _code(validate.validate_dense, q, V, i) is ErrorCode.MASS_MISMATCH


@dense_paths
def test_dense_total_mass_is_exact_with_large_excess():
    # Every entry at 1.0: a float32 sum would saturate, the exact sum does not.
    q = np.ones(V, dtype="<f4")
    assert _code(validate.validate_dense, q, V, 0) is ErrorCode.MASS_MISMATCH


@dense_paths
def test_dense_zero_q_at_proposed():
    _counts, q = _valid_dense()
    q = dyadic.counts_to_fp32(dyadic.point_mass(V, 4))
    assert _code(validate.validate_dense, q, V, 5) is ErrorCode.ZERO_Q_AT_PROPOSED


@pytest.mark.parametrize("token", [-1, V])
@dense_paths
def test_dense_proposed_out_of_range(token):
    _, q = _valid_dense()
    assert _code(validate.validate_dense, q, V, token) is ErrorCode.PROPOSED_OUT_OF_RANGE


@dense_paths
def test_dense_padding_must_be_positive_zero():
    counts, q = _valid_dense()
    padded = np.zeros(V + 24, dtype="<f4")
    padded[:V] = q
    token = int(np.argmax(counts))
    validate.validate_dense(padded, V, token, row_entries=V + 24)
    for bad in (-0.0, 2.0**-24):
        padded[V + 3] = bad
        assert (
            _code(validate.validate_dense, padded, V, token, row_entries=V + 24)
            is ErrorCode.DENSE_PADDING_NONZERO
        )


@dense_paths
def test_dense_validator_rejects_wrong_dtype():
    _counts, q = _valid_dense()
    assert _code(validate.validate_dense, q.astype(np.float64), V, 0) is ErrorCode.ROW_LENGTH


@dense_paths
def test_dense_full_vocabulary_row():
    vocab = 129_280
    counts, q = _valid_dense(vocab, seed=3)
    token = int(np.argmax(counts))
    assert np.array_equal(validate.validate_dense(q.tobytes(), vocab, token), counts)
    q = q.copy()
    q[vocab - 1] = np.float32(q[vocab - 1] + np.float32(2.0**-24))
    assert _code(validate.validate_dense, q, vocab, token) is ErrorCode.MASS_MISMATCH


@settings(max_examples=150, deadline=None)
@given(st.data())
@dense_paths
def test_dense_validation_agrees_with_exact_definition(data):
    # Arbitrary float32 rows: the validator accepts iff every value is c/2**24
    # with integer c >= 0 (and +0.0 for zeros) and the counts sum to 2**24.
    n = data.draw(st.integers(1, 8))
    values = data.draw(st.lists(st.floats(width=32), min_size=n, max_size=n))
    q = np.array(values, dtype="<f4")
    counts = []
    ok = True
    for v in q.tolist():
        if not np.isfinite(v) or np.signbit(v) or v > 1:
            ok = False
            break
        f = Fraction(v) * M
        if f.denominator != 1:
            ok = False
            break
        counts.append(int(f))
    ok = ok and sum(counts) == M
    proposed = int(np.argmax(q)) if ok else 0
    if ok:
        assert validate.validate_dense(q, n, proposed).tolist() == counts
    else:
        with pytest.raises(ValidationError):
            validate.validate_dense(q, n, proposed)


# -- sparse validation: one test per class -----------------------------------


def _sparse(ids, values):
    return np.array(ids, dtype="<i4").tobytes(), np.array(values, dtype="<f4").tobytes()


HALF = 0.5
QUARTER = 0.25


def test_sparse_valid_row():
    ids, q = _sparse([2, 7, 9], [HALF, QUARTER, QUARTER])
    got_ids, counts = validate.validate_sparse(ids, q, V, 32, 7)
    assert got_ids.tolist() == [2, 7, 9]
    assert counts.tolist() == [M // 2, M // 4, M // 4]


@pytest.mark.parametrize(
    ("ids", "values", "proposed", "max_k", "code"),
    [
        ([2, 7], [HALF], 2, 32, ErrorCode.ROW_LENGTH),
        ([], [], 2, 32, ErrorCode.MISSING_Q),
        ([1, 2, 3], [HALF, QUARTER, QUARTER], 2, 2, ErrorCode.SUPPORT_TOO_LARGE),
        ([2, 7], [HALF, HALF], V, 32, ErrorCode.PROPOSED_OUT_OF_RANGE),
        ([2, V], [HALF, HALF], 2, 32, ErrorCode.SPARSE_ID_OUT_OF_RANGE),
        ([-1, 2], [HALF, HALF], 2, 32, ErrorCode.SPARSE_ID_OUT_OF_RANGE),
        ([2, 2], [HALF, HALF], 2, 32, ErrorCode.SPARSE_DUPLICATE_ID),
        ([2, 5, 5], [1.0, 0.0, 0.0], 2, 32, ErrorCode.SPARSE_DUPLICATE_ID),
        ([5, 2, 5], [0.0, 1.0, 0.0], 2, 32, ErrorCode.SPARSE_DUPLICATE_ID),
        ([7, 2], [HALF, HALF], 2, 32, ErrorCode.SPARSE_UNSORTED),
        ([2, 7], [HALF, float("nan")], 2, 32, ErrorCode.NON_FINITE),
        ([2, 7], [1.0, -0.0], 2, 32, ErrorCode.NEGATIVE),
        ([2, 7], [1.5, -0.5], 2, 32, ErrorCode.NEGATIVE),
        ([2, 7], [HALF, 0.1], 2, 32, ErrorCode.NON_DYADIC),
        ([2, 7], [1.0, 0.0], 2, 32, ErrorCode.SPARSE_ZERO_ENTRY),
        ([2, 7], [HALF, QUARTER], 2, 32, ErrorCode.MASS_MISMATCH),
        ([2, 7], [HALF, HALF], 3, 32, ErrorCode.ZERO_Q_AT_PROPOSED),
    ],
)
def test_sparse_error_classes(ids, values, proposed, max_k, code):
    ids_buf, q_buf = _sparse(ids, values)
    assert _code(validate.validate_sparse, ids_buf, q_buf, V, max_k, proposed) is code


def test_sparse_odd_byte_lengths():
    assert _code(validate.validate_sparse, b"\0" * 5, b"\0" * 4, V, 4, 0) is ErrorCode.ROW_LENGTH
    assert _code(validate.validate_sparse, b"\0" * 4, b"\0" * 3, V, 4, 0) is ErrorCode.ROW_LENGTH


def test_sparse_constructed_rows_validate():
    rng = np.random.default_rng(5)
    w = rng.random(V) ** 6
    ids, counts = dyadic.sparse_counts_from_weights(w, 32)
    q = dyadic.counts_to_fp32(counts)
    got_ids, got = validate.validate_sparse(
        ids.astype("<i4").tobytes(), q.tobytes(), V, 32, int(ids[0])
    )
    assert np.array_equal(got_ids, ids)
    assert np.array_equal(got, counts)
