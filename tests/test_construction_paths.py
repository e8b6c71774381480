"""Every construction path gives the same q and the same draw for the same FP32 weights.

A probabilities drafter's row (``docs/protocol.md`` §6.1, ``kind = "probs"``)
is built by the numpy rule (``dyadic.counts_from_weights`` of the values
widened to binary64), by the compiled pass that writes the wire values
(``_fastq.construct_rows``, ``rows.construct_rows``), and by the torch
kernels on CPU tensors (``torch_ops.build_position``). They must agree bit
for bit: the counts (as FP32 wire values), the drawn index, or the refusal's
code, for dense and sparse rows, zeros, subnormals, huge and tiny values and a
single nonzero weight. The binary64 rule is then qualified against the exact
rational normalization of the same FP32 values (``oracle.fp32_weights``) with
the rounding bounds the protocol states.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error
from pp1wire.q import dyadic, oracle, rng, rows, tree

fastq = pytest.importorskip("pp1wire.q._fastq")

# -- strategies -------------------------------------------------------------------

special = st.sampled_from(
    [0.0, -0.0, 1.0, 2.0**-149, 2.0**-126, 3.0e38, 3.4028234663852886e38, 1e-45, 0.5, 7.0]
)
positive = st.floats(0.0, float(np.float32(3.4e38)), width=32, allow_subnormal=True)
tiny = st.floats(0.0, float(np.float32(1e-37)), width=32, allow_subnormal=True)
bad = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -2.0**-149])


@st.composite
def fp32_rows(draw, max_size: int = 70):
    """A row of FP32 weights: mixtures of everything, one nonzero, or all equal."""
    style = draw(st.integers(0, 5))
    n = draw(st.integers(1, max_size))
    if style == 0:
        values = draw(st.lists(st.one_of(positive, tiny, special), min_size=n, max_size=n))
    elif style == 1:  # a single nonzero weight
        values = [0.0] * n
        values[draw(st.integers(0, n - 1))] = draw(st.one_of(positive, tiny, special))
    elif style == 2:  # all equal: ties everywhere
        values = [draw(st.one_of(positive, special))] * n
    elif style == 3:  # powers of two: shares on the grid of the key boundaries
        values = [2.0 ** draw(st.integers(-149, 127)) for _ in range(n)]
    elif style == 4:  # small integers: exact ties of remainders
        values = [float(draw(st.integers(0, 5))) for _ in range(n)]
    else:  # a refused value somewhere
        values = draw(st.lists(st.one_of(positive, special), min_size=n, max_size=n))
        values[draw(st.integers(0, n - 1))] = draw(bad)
    return np.array(values, dtype=np.float32)


# -- the paths ------------------------------------------------------------------------


@pytest.fixture(params=["avx512", "portable"])
def simd(request):
    """Each test on the AVX-512 path of the compiled pass (where the CPU has it) and on
    the path every CPU takes."""
    was = fastq.construct_simd(request.param == "avx512")
    if request.param == "avx512" and not fastq.construct_simd(True):
        fastq.construct_simd(was)
        pytest.skip("this CPU has no AVX-512")
    yield request.param
    fastq.construct_simd(was)



def numpy_rule(w32: np.ndarray, u: int):
    """The reference: the numpy rule alone (compiled module off), then the draw."""
    saved = (dyadic._fastq, tree._fastq)
    dyadic._fastq = tree._fastq = None
    try:
        counts = dyadic.counts_from_weights(w32.astype(np.float64))
        return counts, dyadic.sample(counts, u)
    except Pp1Error as exc:
        return exc.code
    finally:
        dyadic._fastq, tree._fastq = saved


def compiled(ws: list[np.ndarray], us: list[int], entries: int):
    payloads, picks = rows.construct_rows(ws, us, entries)
    return [
        pick.code if isinstance(pick, Pp1Error) else (payload, pick)
        for payload, pick in zip(payloads, picks, strict=True)
    ]


def assert_row(got, want, n: int, entries: int) -> None:
    if isinstance(want, ErrorCode):
        assert got == want
        return
    counts, token = want
    assert not isinstance(got, ErrorCode), (got, want)
    payload, pick = got
    assert pick == token
    assert payload.dtype == np.dtype("<f4")
    assert payload.shape == (entries,)
    wire = dyadic.counts_to_fp32(counts)
    assert np.array_equal(payload[:n].view(np.uint32), wire.view(np.uint32))
    assert not payload[n:].view(np.uint32).any()  # +0.0 padding


@pytest.mark.usefixtures("simd")
@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(fp32_rows(), min_size=1, max_size=4), st.data())
def test_compiled_pass_equals_the_numpy_rule(batch, data):
    n = batch[0].size
    batch = [np.resize(w, n).astype(np.float32) for w in batch]  # one length per call
    us = [data.draw(st.integers(0, dyadic.M - 1)) for _ in batch]
    entries = n + data.draw(st.integers(0, 3))
    for got, w, u in zip(compiled(batch, us, entries), batch, us, strict=True):
        assert_row(got, numpy_rule(w, u), n, entries)
    # The same values as binary64 rows (what weights_rows hands over from logits).
    wide = [w.astype(np.float64) for w in batch]
    for got, w, u in zip(compiled(wide, us, entries), batch, us, strict=True):
        assert_row(got, numpy_rule(w, u), n, entries)


@pytest.mark.usefixtures("simd")
@pytest.mark.parametrize("n", [1, 63, 64, 65, 4095, 4096, 4097, 129_280])
def test_compiled_pass_at_block_boundaries_and_full_vocabulary(n):
    gen = np.random.default_rng(n)
    logits = gen.standard_normal(n) * 3.0
    probs = np.exp(logits - logits.max())
    ws = [
        (probs / probs.sum()).astype(np.float32),
        (gen.random(n) ** 8).astype(np.float32),
        np.full(n, 1.0, dtype=np.float32),
    ]
    us = [int(u) for u in gen.integers(0, dyadic.M, len(ws))]
    for got, w, u in zip(compiled(ws, us, n + 128), ws, us, strict=True):
        assert_row(got, numpy_rule(w, u), n, n + 128)


@st.composite
def long_rows(draw):
    """Rows long enough for the sampled bracket of the leftover tickets (AVX-512)."""
    n = draw(st.integers(4096, 20_000))
    seed = draw(st.integers(0, 2**32 - 1))
    gen = np.random.default_rng(seed)
    style = draw(st.integers(0, 5))
    if style == 0:
        w = gen.random(n) ** float(draw(st.sampled_from([1.0, 8.0, 60.0])))
    elif style == 1:  # every remainder in a few key buckets
        w = np.full(n, 1.0) + gen.integers(0, 3, n) * 2.0**-20
    elif style == 2:  # tiny weights beside a few large: most keys 0
        w = np.where(gen.random(n) < 0.01, 1.0, 2.0**-60)
    elif style == 3:  # powers of two: shares on the key grid
        w = 2.0 ** gen.integers(-30, 5, n).astype(np.float64)
    elif style == 4:  # zeros and -0.0 among them
        w = gen.random(n) * (gen.random(n) < 0.5)
        w[gen.random(n) < 0.1] = -0.0
    else:
        w = np.exp(gen.standard_normal(n) * 3.0)
    return w.astype(np.float32)


# The bracket as built, then centred far below and far above the ticket bucket (it misses);
# and long rows on the path every CPU takes.
@pytest.mark.usefixtures("simd")
@pytest.mark.parametrize("bias", [1.0, 0.2, 5.0])
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(long_rows(), st.integers(0, dyadic.M - 1))
def test_the_sampled_bracket_and_its_way_back_give_the_same_rows(bias, w, u):
    was = fastq.bracket_bias(bias)
    try:
        (got,) = compiled([w], [u], w.size)
    finally:
        fastq.bracket_bias(was)
    assert_row(got, numpy_rule(w, u), w.size, w.size)


@pytest.mark.usefixtures("simd")
def test_binary64_weights_that_overflow_the_total_are_refused_in_order():
    big = np.array([1e308, 1e308, 1.0])
    assert compiled([big], [0], 3) == [ErrorCode.WEIGHT_NON_FINITE]
    both = np.array([1e308, 1e308, -1.0])  # finite but negative: NEGATIVE comes first
    assert compiled([both], [0], 3) == [ErrorCode.WEIGHT_NEGATIVE]
    assert numpy_rule(both, 0) is ErrorCode.WEIGHT_NEGATIVE


def test_compiled_pass_refuses_malformed_batches():
    w = np.ones(4, dtype=np.float32)
    with pytest.raises(ConstructionError) as err:
        rows.construct_rows([w, np.ones(5, dtype=np.float32)], [0, 0], 8)
    assert err.value.code is ErrorCode.BAD_SHAPE
    with pytest.raises(ConstructionError):
        rows.construct_rows([w, w.astype(np.float64)], [0, 0], 8)  # two dtypes
    with pytest.raises(ConstructionError):
        rows.construct_rows([w], [0], 3)  # entries below the row
    with pytest.raises(ConstructionError):
        rows.construct_rows([w], [0, 1], 4)
    tokens, status = np.empty(1, np.int64), np.empty(1, np.int32)
    with pytest.raises(ValueError, match="sizes"):
        fastq.construct_rows(
            [w], 4, np.zeros(1, np.int64), tokens, status, [w.copy()], bytearray(8)
        )
    with pytest.raises(ValueError, match="fewer than n"):
        fastq.construct_rows(
            [w], 4, np.zeros(1, np.int64), tokens, status, [np.empty(2, np.float32)],
            np.empty(8, np.float64),
        )  # fmt: skip


@pytest.mark.usefixtures("simd")
def test_a_draw_outside_the_range_is_refused_as_sample_refuses_it():
    w = np.ones(5, dtype=np.float32)
    assert compiled([w, w], [-1, dyadic.M], 5) == [ErrorCode.BAD_DRAW] * 2


def test_without_the_compiled_module_the_same_rows(monkeypatch):
    gen = np.random.default_rng(5)
    ws = [(gen.random(300) ** 6).astype(np.float32) for _ in range(3)]
    ws[1][7] = np.nan
    us = [1, 99, 2**23]
    want = compiled(ws, us, 301)
    monkeypatch.setattr(dyadic, "_fastq", None)
    got = compiled(ws, us, 301)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, ErrorCode):
            assert g == w
        else:
            assert g[1] == w[1]
            assert np.array_equal(g[0].view(np.uint32), w[0].view(np.uint32))


@pytest.mark.usefixtures("simd")
def test_a_negative_zero_weight_never_takes_a_leftover_ticket():
    """2**17 weights of 2**-41 beside 1.0: every remainder falls in the lowest key
    bucket, and the one ticket left must go to a positive remainder, not to the
    -0.0 weight (whose remainder's bits would order above every positive one)."""
    w = np.array([1.0] + [2.0**-41] * 2**17 + [-0.0])
    want = numpy_rule(w.astype(np.float32), 0)
    b = dyadic.QBuilder(w.size)
    counts = b.allocate(w, tree.total(w))  # the compiled allocation of binary64 weights
    assert counts[-1] == 0
    assert np.array_equal(counts, numpy_rule(w, 0)[0])
    got = compiled([w], [0], w.size)[0]
    assert got[0][-1] == 0.0
    assert isinstance(want, tuple)


# -- sparse ----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(fp32_rows(max_size=300), st.integers(1, 80))
def test_compiled_sparse_support_equals_the_numpy_rule(w, k):
    def outcome(fn):
        try:
            return fn()
        except Pp1Error as exc:
            return exc.code

    got = outcome(lambda: dyadic.sparse_counts_from_fp32(w, k))
    saved = dyadic._fastq
    dyadic._fastq = None
    try:
        want = outcome(lambda: dyadic.sparse_counts_from_weights(w.astype(np.float64), k))
    finally:
        dyadic._fastq = saved
    if isinstance(want, ErrorCode):
        assert got == want
        return
    assert got[0].dtype == want[0].dtype
    assert got[1].dtype == want[1].dtype
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(got[1], want[1])


def test_sparse_support_of_equal_weights_over_many_chunks_falls_back_exactly():
    w = np.ones(100_000, dtype=np.float32)  # every chunk ties: more candidates than kept
    ids, counts = dyadic.sparse_counts_from_fp32(w, 32)
    assert ids.tolist() == list(range(32))
    assert counts.sum() == dyadic.M


def test_sparse_support_on_a_full_vocabulary_row():
    gen = np.random.default_rng(9)
    x = gen.standard_normal(129_280) * 3.0
    w = np.exp(x - x.max()).astype(np.float32)
    ids, counts = dyadic.sparse_counts_from_fp32(w, 32)
    want_ids, want_counts = dyadic.sparse_counts_from_weights(w.astype(np.float64), 32)
    assert np.array_equal(ids, want_ids)
    assert np.array_equal(counts, want_counts)


# -- torch on CPU tensors ---------------------------------------------------------------


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(fp32_rows(max_size=60), min_size=1, max_size=4), st.data())
def test_torch_position_equals_the_host_paths(batch, data):
    torch = pytest.importorskip("torch")
    from pp1wire.q import torch_ops

    n = batch[0].size
    x = np.stack([np.resize(w, n).astype(np.float32) for w in batch])
    specs = [data.draw(st.sampled_from([(1.0, 0), (1.0, 0), (0.0, 0), (1.0, 3), (0.0, 2)]))
             for _ in batch]  # fmt: skip
    us = [data.draw(st.integers(0, dyadic.M - 1)) for _ in batch]
    entries = n + data.draw(st.integers(0, 2))
    got = torch_ops.build_position(torch.from_numpy(x), specs, us, entries)
    from pp1wire.q.proposal import build_row

    for r, (temperature, support) in enumerate(specs):
        try:
            counts, ids = build_row(x[r], temperature, support or None, kind="probs")
            token = dyadic.sample(counts, us[r])
            want = (counts, ids, token if ids is None else int(ids[token]))
        except Pp1Error as exc:
            refused = exc.code
        else:
            refused = None
        row = got[r]
        if refused is not None:
            assert isinstance(row, Pp1Error), row
            assert row.code is refused
            continue
        assert not isinstance(row, Pp1Error), row
        counts, ids, token = want
        if temperature == 0:  # greedy: the point mass at the first maximal weight
            assert row.token == (int(ids[0]) if ids is not None else int(np.argmax(counts)))
        else:
            assert row.token == token
        if ids is not None:
            assert row.ids.dtype == ids.dtype
            assert np.array_equal(row.ids, ids)
            assert np.array_equal(row.counts, counts)
            assert row.counts.dtype == counts.dtype
        elif row.q32 is not None:
            assert row.q32.shape == (entries,)
            assert np.array_equal(row.q32[:n].view(np.uint32),
                                  dyadic.counts_to_fp32(counts).view(np.uint32))  # fmt: skip
            assert not row.q32[n:].view(np.uint32).any()
        else:
            assert np.array_equal(row.counts, counts)


def test_torch_refusals_come_in_the_hosts_order():
    torch = pytest.importorskip("torch")
    from pp1wire.q import torch_ops

    x = torch.tensor([[1.0, math.nan, -1.0], [1.0, 0.0, -1.0], [0.0, -0.0, 0.0], [1, 2, 3]])
    specs = [(1.0, 0), (1.0, 2), (0.0, 0), (0.5, 0)]
    got = torch_ops.build_position(x, specs, [0, 0, 0, 0], 3)
    assert [g.code for g in got] == [  # type: ignore[union-attr]
        ErrorCode.WEIGHT_NON_FINITE,
        ErrorCode.WEIGHT_NEGATIVE,
        ErrorCode.ZERO_MASS,
        ErrorCode.BAD_TEMPERATURE,
    ]


def test_staging_buffers_are_reused_only_when_no_row_refers_to_them():
    torch = pytest.importorskip("torch")
    from pp1wire.q import torch_ops

    x = torch.rand((3, 50), dtype=torch.float32)
    first = torch_ops.build_position(x, [(1.0, 0)] * 3, [1, 2, 3], 64)
    kept = first[0].q32.copy()  # type: ignore[union-attr]
    second = torch_ops.build_position(x * 0 + 1, [(1.0, 0)] * 3, [1, 2, 3], 64)
    assert not np.shares_memory(first[0].q32, second[0].q32)  # type: ignore[union-attr]
    assert np.array_equal(first[0].q32, kept)  # type: ignore[union-attr]
    first_buffer = id(first[0].q32.base)  # type: ignore[union-attr]
    del first
    third = torch_ops.build_position(x, [(1.0, 0)] * 3, [1, 2, 3], 64)
    assert id(third[0].q32.base) == first_buffer  # type: ignore[union-attr]
    from pp1wire.wire.replies import row_payload

    payload, entries = row_payload(third[1], 64)  # type: ignore[arg-type]
    assert entries == 64
    assert np.shares_memory(np.frombuffer(payload, dtype="<f4"), third[1].q32)  # sent from there
    del second


# -- against the exact law ------------------------------------------------------------

U = Fraction(1, 2**53)


@settings(max_examples=300, deadline=None)
@given(fp32_rows(max_size=40))
def test_the_binary64_rule_against_the_exact_normalization(w):
    """What ``oracle.fp32_weights`` checks of the rule (``docs/protocol.md`` §6.1):
    the canonical total within L·u of the exact sum, every share within (L + 2)·u of
    M·q*, every count within 1 of M·q*, zero counts exactly where q* is 0, and the
    exact oracle's counts wherever no exact share or remainder is within the bound of
    a decision."""
    got = numpy_rule(w, 0)
    try:
        exact_q = oracle.fp32_weights([float(v) for v in w])
    except ConstructionError as exc:
        refused = exc.code
    else:
        refused = None
    if refused is not None:  # the same refusals, in the same order
        assert got is refused
        return
    if isinstance(got, ErrorCode):  # the rule refused what the exact law accepts
        assert got is ErrorCode.ALLOCATION_INCONSISTENT
        return
    counts, _ = got
    wide = w.astype(np.float64)
    depth = tree.depth_for(w.size)
    gamma = depth * U / (1 - depth * U)
    exact_sum = sum((Fraction(float(v)) for v in wide), Fraction(0))
    total = Fraction(tree.total(wide))
    assert abs(total - exact_sum) <= gamma * exact_sum
    bound = (depth + 2) * U * (1 + gamma)
    shares = [Fraction(float(v)) / (Fraction(tree.total(wide)) / dyadic.M) for v in wide]
    for v, share in enumerate(shares):
        want = exact_q[v] * dyadic.M
        assert abs(Fraction(float(np.float64(float(share)))) - want) <= bound * want + U * want
        assert abs(int(counts[v]) - want) < 1 + bound * dyadic.M
        assert (counts[v] == 0) or exact_q[v] > 0
    exact_counts = oracle.fp32_dyadic_counts([float(v) for v in w])
    eps = [bound * q * dyadic.M for q in exact_q]
    rems = [q * dyadic.M - math.floor(q * dyadic.M) for q in exact_q]
    near_floor = any(
        r < e or 1 - r < e for r, e, q in zip(rems, eps, exact_q, strict=True) if q > 0
    )
    left = dyadic.M - sum(math.floor(q * dyadic.M) for q in exact_q)
    ranked = sorted(rems, reverse=True)
    near_ticket = 0 < left < len(ranked) and ranked[left - 1] - ranked[left] <= 2 * max(eps)
    if not (near_floor or near_ticket):
        assert [int(c) for c in counts] == exact_counts


def test_the_fp32_oracle_rounds_as_ieee_binary32():
    gen = np.random.default_rng(3)
    values = gen.standard_normal(500) * 10.0 ** gen.integers(-50, 45, 500)
    edges = [3.4028235e38, 3.4028236e38, 2.0**-149 * 1.5, 2.0**-149 * 2.5, 1e-46, -1e-46]
    for v in [*values.tolist(), *edges]:
        with np.errstate(over="ignore"):
            f = np.float32(v)
        got = oracle.round_fp32(v)
        if np.isinf(f):
            assert got == math.copysign(math.inf, v)
        else:
            assert got == Fraction(float(f))
    with pytest.raises(ConstructionError) as err:
        oracle.fp32_weights([1.0, 1e39])  # beyond the FP32 range: infinite
    assert err.value.code is ErrorCode.WEIGHT_NON_FINITE
    assert oracle.fp32_weights([1e-46, 1.0]) == [0, 1]  # underflows: a zero weight


# -- the proposal draw's Philox rounds, compiled ---------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.tuples(*[st.integers(0, 2**32 - 1)] * 4), st.tuples(*[st.integers(0, 2**32 - 1)] * 2)
)
def test_compiled_philox_rounds_equal_the_python_rounds(counter, key):
    compiled_block = rng.philox4x32_10(counter, key)
    saved = rng._fastq
    rng._fastq = None
    try:
        assert rng.philox4x32_10(counter, key) == compiled_block
        streams = rng.RoundStreams(rng.Role.WORKER, key[0] | key[1] << 32, counter[2], counter[1])
        python_draw = streams.u24(rng.Domain.PROPOSAL, counter[0])
    finally:
        rng._fastq = saved
    streams = rng.RoundStreams(rng.Role.WORKER, key[0] | key[1] << 32, counter[2], counter[1])
    assert streams.u24(rng.Domain.PROPOSAL, counter[0]) == python_draw
