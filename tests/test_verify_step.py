"""A step decided on the engine's rows commits exactly what per-request verification commits.

verify_step takes the target's rows for every round of a step as one array and
decides them together (compiled, numpy, or torch on the rows' device); each
round must end exactly as RequestVerifier.verify / decode_target_only end it
for the same seeds and rows: the same tokens, the same error code and message,
the same state afterwards (committed prefix, spent round, poisoning) — also for
rows that are NaN, negative, without mass or of the wrong shape, and for rows a
round never reaches (which must not fail it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode, UsageError, VerifyError
from pp1wire.q import dyadic, targetrows, tree
from pp1wire.q.proposal import QRow, propose
from pp1wire.q.rng import (
    Domain,
    Role,
    RoundStreams,
    counter_for,
    key_for_seed,
    philox4x32_10,
    u53_int_from_block,
)
from pp1wire.q.verify import (
    RequestVerifier,
    accept_exact,
    proposal_from_rows,
    step_prefixes,
    verify_batch,
    verify_step,
)
from pp1wire.q.walk import Draw

M = 1 << 24
SPOILS = ["ok", "ok", "ok", "hole", "scale", "tiny", "nan", "neg", "zero", "inf", "huge"]


@dataclass
class Plan:
    depth: int  # 0: a target-only round
    support: int | None
    eos: bool  # the request has a terminal token (a likely one)
    qkind: str  # how the proposal's q travels: counts, int32 counts, FP32 values (the wire)
    spoil: list[str]  # what happens to each of the round's rows
    stale: bool  # the proposal's round was already spent: refused before any row is read
    processors: bool
    audit: bool


plans = st.builds(
    Plan,
    depth=st.integers(0, 5),
    support=st.sampled_from([None, 6]),
    eos=st.booleans(),
    qkind=st.sampled_from(["counts", "i32", "q32"]),
    spoil=st.lists(st.sampled_from(SPOILS), min_size=6, max_size=6),
    stale=st.sampled_from([False, False, False, True]),
    processors=st.sampled_from([False, False, False, True]),
    audit=st.sampled_from([False, False, True]),
)


def zero_token(prefix, p):
    q = np.array(p, dtype=np.float64)
    q[0] = 0.0
    return q


@functools.cache
def likely(vocab: int) -> int:
    """A token the draft model proposes often: the terminal token of the tests."""
    drafter = ToyLM(vocab, 3, draft=True)
    return int(np.argmax(sum(np.exp(drafter.logits([t])) for t in range(min(vocab, 20)))))


def make(k: int, vocab: int, plan: Plan) -> RequestVerifier:
    target = ToyLM(vocab, 3)
    eos = likely(vocab) if plan.eos else None
    last = (10 + k) % vocab
    if last == eos:
        last = (last + 1) % vocab  # the prefix must not have ended already
    return RequestVerifier(
        session=1,
        seed=1000 + k,
        vocab_size=vocab,
        prefix=[1 % vocab, last],
        target=target.probs,
        eos=eos,
        processors=(zero_token,) if plan.processors else (),
        audit=plan.audit,
    )


def recast(row: QRow, kind: str) -> QRow:
    counts = np.asarray(row.counts)
    if kind == "i32":
        return QRow(token=row.token, counts=counts.astype(np.int32), ids=row.ids)
    if kind == "q32":
        return QRow(token=row.token, q32=dyadic.counts_to_fp32(counts), ids=row.ids)
    return row


def draft(v: RequestVerifier, round_id: int, plan: Plan, vocab: int):
    streams = RoundStreams(Role.WORKER, v.seed, v.generation, round_id)
    rows = propose(
        v.committed,
        plan.depth,
        ToyLM(vocab, 3, draft=True).logits,
        streams,
        support=plan.support,
        eos=v.eos,
    )
    return proposal_from_rows(v, [recast(r, plan.qkind) for r in rows], round_id, plan.depth)


def spoiled(p: np.ndarray, how: str, token: int | None) -> np.ndarray:
    p = np.array(p, dtype=np.float64)
    if how == "hole" and token is not None:
        p[token] = 0.0  # p(x) = 0: never accepted, the correction never draws it
    elif how == "scale":
        p *= 7.3  # weights, not probabilities
    elif how == "tiny":
        p *= 1e-310  # subnormal weights
    elif how == "nan":
        p[len(p) // 2] = np.nan
    elif how == "neg":
        p[1] = -1e-9
    elif how == "zero":
        p[:] = 0.0
    elif how == "inf":
        p[0] = np.inf
    elif how == "huge":
        p[:] = 1e308  # finite values whose total overflows: no usable mass
    return p


def build(vocab: int, plans_: list[Plan]):
    """Two identical sets of verifiers and the step's rounds on each, and the rows."""
    sides = []
    for _ in range(2):
        vs = [make(k, vocab, plan) for k, plan in enumerate(plans_)]
        rounds = []
        for v, plan in zip(vs, plans_, strict=True):
            if plan.stale:
                v.decode_target_only(0)  # round 0 is spent
            if plan.depth:
                rounds.append((v, draft(v, 0, plan, vocab), 0))
            else:
                rounds.append((v, None, 0))
        sides.append(rounds)
    target = ToyLM(vocab, 3)
    rows = []
    spans = []
    for (v, proposal, round_id), plan in zip(sides[0], plans_, strict=True):
        prefixes = step_prefixes([(v, proposal, round_id)])
        spans.append((len(rows), len(prefixes)))
        tokens = [] if proposal is None else [r.token for r in proposal.rows]
        for i, prefix in enumerate(prefixes):
            token = tokens[i] if i < len(tokens) else None
            rows.append(spoiled(target.probs(prefix), plan.spoil[i], token))
    matrix = np.array(rows, dtype=np.float64).reshape(len(rows), vocab)
    return sides, matrix, spans


def state(v: RequestVerifier):
    return (list(v.committed), v.last_round, v.poisoned, v.finished, v.digest)


def outcome(r):
    if isinstance(r, VerifyError):
        return (r.code, str(r))
    return (r.round_id, r.accepted, r.tokens, r.extra, r.outcome, r.finished, r.new_position)


def reference(rounds, matrix, spans, commit: bool):
    out = []
    for (v, proposal, round_id), (first, count) in zip(rounds, spans, strict=True):
        scores = [matrix[i] for i in range(first, first + count)]
        try:
            if proposal is not None:
                out.append((v.verify if commit else v.evaluate)(proposal, scores))
            else:
                fn = v.decode_target_only if commit else v.evaluate_target_only
                out.append(fn(round_id, score=scores[0] if scores else None))
        except VerifyError as exc:
            out.append(exc)
    return out


@pytest.fixture(params=[True, False], ids=["simd", "portable"])
def simd(request):
    """The compiled step with its AVX2 path (where the CPU has it) and without."""
    fastq = targetrows._fastq
    if getattr(fastq, "step_simd", None) is None:
        pytest.skip("compiled fast path not built")
    was = fastq.step_simd(request.param)
    yield request.param
    fastq.step_simd(was)


@pytest.fixture(params=["compiled", "compiled-threads", "compiled-portable", "numpy"])
def step_path(request, monkeypatch):
    """Decide with the compiled step (when built; on one thread and on three, whatever
    the step's size; without its AVX2 path) and with the numpy walk."""
    fastq = targetrows._fastq
    if request.param == "numpy":
        monkeypatch.setattr(targetrows, "_fastq", None)
    elif getattr(fastq, "row_checks", None) is None:
        pytest.skip("compiled fast path not built")
    threads = 3 if request.param == "compiled-threads" else 1
    decide = targetrows.decide
    monkeypatch.setattr(targetrows, "decide", lambda jobs, rows, _: decide(jobs, rows, threads))
    was = fastq.step_simd(request.param != "compiled-portable") if fastq else None
    yield request.param
    if fastq is not None:
        fastq.step_simd(was)


def check_same(vocab, plans_, dtype=np.float64, commit=True):
    (mine, ref), matrix, spans = build(vocab, plans_)
    with np.errstate(over="ignore"):  # "huge" rows become infinities in FP32
        rows = matrix.astype(dtype)  # as an engine hands them over: both sides read these
    want = reference(ref, rows, spans, commit)
    got = verify_step(mine, rows, commit=commit)
    assert [outcome(g) for g in got] == [outcome(w) for w in want]
    assert [state(v) for v, _, _ in mine] == [state(v) for v, _, _ in ref]
    return got


step_cases = {
    "vocab": st.sampled_from([40, 300]),
    "plans_": st.lists(plans, min_size=1, max_size=6),
    "dtype": st.sampled_from([np.float64, np.float32]),
}


@settings(
    max_examples=60,
    deadline=None,
    # step_path patches the module for the whole test: the same for every example.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(**step_cases, commit=st.booleans())
def test_a_step_decides_what_each_request_decides(step_path, vocab, plans_, dtype, commit):
    check_same(vocab, plans_, dtype, commit)


def test_the_examples_reach_every_way_a_round_ends(step_path):
    # The hypothesis cases above are only as good as the paths they reach: a fixed
    # sample of them reaches every outcome and every refusal the step can give.
    seen = set()
    rng = np.random.default_rng(7)
    for trial in range(40):
        plans_ = [
            Plan(
                depth=int(rng.integers(0, 6)),
                support=[None, 6][int(rng.integers(0, 2))],
                eos=bool(rng.random() < 0.5),
                qkind=["counts", "i32", "q32"][int(rng.integers(0, 3))],
                spoil=[SPOILS[int(rng.integers(0, len(SPOILS)))] for _ in range(6)],
                stale=bool(rng.random() < 0.1),
                processors=bool(rng.random() < 0.2),
                audit=bool(rng.random() < 0.2),
            )
            for _ in range(6)
        ]
        dtype = [np.float64, np.float32][trial // 2 % 2]
        got = check_same([40, 300][trial % 2], plans_, dtype)
        seen |= {r.code if isinstance(r, VerifyError) else r.outcome.value for r in got}
    assert {"correction", "bonus", "eos", "target"} <= seen
    assert {
        ErrorCode.TARGET_NON_FINITE,
        ErrorCode.TARGET_NEGATIVE,
        ErrorCode.TARGET_ZERO_MASS,
        ErrorCode.ROUND_REUSED,
    } <= seen


def test_a_bad_row_no_round_reaches_fails_nothing(step_path):
    # Per request, rows after the one a round stops at are never read: NaN there
    # must not fail the round in a step either.
    checked = 0
    for k in range(8):
        plan = Plan(5, None, False, "counts", ["ok"] * 6, False, False, False)
        (mine, ref), matrix, spans = build(40, [plan] * (k + 1))
        want = reference(ref, matrix, spans, True)
        for w, (first, count) in zip(want, spans, strict=True):
            assert not isinstance(w, VerifyError)
            if w.accepted + 1 < count:
                matrix[first + w.accepted + 1 : first + count] = np.nan
                checked += 1
        got = verify_step(mine, matrix)
        assert [outcome(g) for g in got] == [outcome(w) for w in want]
    assert checked >= 8


@pytest.mark.parametrize("vocab", [1, 2, 64, 65, 129, 1000])
def test_every_tree_shape_decides_the_same(step_path, vocab):
    # Vocabularies at and around the compiled step's 64-leaf blocks.
    if vocab == 1:
        v, w = (
            RequestVerifier(session=1, seed=5, vocab_size=1, prefix=[0], target=lambda p: [1.0])
            for _ in range(2)
        )
        got = verify_step([(v, None, 0)], np.ones((1, 1)))
        assert outcome(got[0]) == outcome(w.decode_target_only(0, score=np.ones(1)))
        return
    plans_ = [
        Plan(d, s, False, q, ["ok"] * 6, False, False, False)
        for d, s, q in [(5, None, "q32"), (3, 2, "counts"), (0, None, "counts"), (2, None, "i32")]
    ]
    check_same(vocab, plans_)


def test_the_layout_is_checked_before_anything_changes():
    plan = Plan(3, None, False, "counts", ["ok"] * 6, False, False, False)
    (mine, _), matrix, _ = build(40, [plan, plan])
    before = [state(v) for v, _, _ in mine]
    for bad in (matrix[:-1], matrix[0], matrix[None], None):
        with pytest.raises(UsageError) as info:
            verify_step(mine, bad)
        assert "the step needs (8, V)" in str(info.value)
    assert [state(v) for v, _, _ in mine] == before


def test_two_rounds_of_one_request_in_a_step_are_misuse():
    v = make(0, 40, Plan(0, None, False, "counts", [], False, False, False))
    rounds = [(v, None, 0), (v, None, 1)]
    before = state(v)
    with pytest.raises(UsageError):
        step_prefixes(rounds)
    with pytest.raises(UsageError):
        verify_step(rounds, np.ones((2, 40)))
    with pytest.raises(UsageError):
        verify_batch(rounds, lambda ps: [np.ones(40)] * len(ps))
    assert state(v) == before


def test_the_layout_is_the_rounds_own_and_a_refused_rounds_rows_are_never_read():
    # An engine scores every round it has; a round its checks refuse keeps its rows
    # in the layout, and they are never read (NaN there poisons nothing).
    stale = make(0, 40, Plan(0, None, False, "counts", [], False, False, False))
    stale.decode_target_only(0)
    fresh = make(1, 40, Plan(0, None, False, "counts", [], False, False, False))
    rounds = [(stale, None, 0), (fresh, None, 0)]
    prefixes = step_prefixes(rounds)
    assert [list(p) for p in prefixes] == [stale.committed, fresh.committed]
    probs = np.stack([ToyLM(40, 3).probs(p) for p in prefixes])
    probs[0] = np.nan
    got = verify_step(rounds, probs)
    assert isinstance(got[0], VerifyError)
    assert got[0].code is ErrorCode.ROUND_REUSED
    assert not stale.poisoned
    assert not isinstance(got[1], VerifyError)


def test_verify_batch_with_an_engine_that_returns_one_array_is_one_step():
    target = ToyLM(300, 3)
    plans_ = [Plan(d, None, False, "q32", ["ok"] * 6, False, False, False) for d in (5, 0, 2)]
    (mine, ref), _, _ = build(300, plans_)
    calls = []

    def engine(prefixes):
        calls.append(len(prefixes))
        return target.probs_batch(prefixes)

    got = verify_batch(mine, engine)
    want = verify_batch(ref, lambda ps: [target.probs(p) for p in ps])
    assert calls == [5 + 1 + 1 + 2 + 1]
    assert [outcome(g) for g in got] == [outcome(w) for w in want]


# -- the compiled pieces, qualified one by one -------------------------------------------


compiled = pytest.mark.skipif(
    getattr(targetrows._fastq, "row_checks", None) is None, reason="compiled path not built"
)


@compiled
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, (1 << 64) - 1),
    generation=st.integers(0, 0xFFFFFFFF),
    round_id=st.integers(0, 0xFFFFFFFF),
    position=st.integers(0, 0xFFFFFFFF),
    domain=st.sampled_from([Domain.ACCEPTANCE, Domain.CORRECTION, Domain.TARGET]),
)
def test_the_compiled_draw_is_the_rng_abis(seed, generation, round_id, position, domain):
    block = philox4x32_10(counter_for(generation, round_id, position, domain), key_for_seed(seed))
    got = targetrows._fastq.philox_u53(seed, generation, round_id, position, int(domain))
    assert got == u53_int_from_block(block)


def test_the_acceptance_test_at_its_boundary():
    # p exactly u * count / 2**77: not accepted; one ulp above: accepted.
    for u, count in [(1, 1), ((1 << 53) - 1, 1 << 24), (12345, 678)]:
        p = u * count / 2.0**77
        assert float(u * count) == u * count  # p is exact
        assert not accept_exact(u, count, p)
        assert accept_exact(u, count, np.nextafter(p, 2.0))


values = st.floats(0, 1e30) | st.sampled_from([0.0, 5e-324, 1e-300, 1.0, 0.25])


@st.composite
def long_rows(draw):
    """A row of any length around the compiled step's blocks (64 and 256 leaves), of
    values of every scale, and FP32 or FP64."""
    n = draw(st.sampled_from([1, 3, 63, 64, 65, 255, 256, 257, 700, 1024, 1500]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1.0, 1e-300, 1e300, 1e-310]))
    row = rng.random(n) ** draw(st.sampled_from([1, 8])) * scale
    row[rng.random(n) < draw(st.sampled_from([0.0, 0.3]))] = 0.0
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    with np.errstate(over="ignore", under="ignore"):
        return row.astype(dtype)


@compiled
@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # simd: one setting per test
)
@given(long_rows(), st.sampled_from([None, -1e-9, -0.0, np.nan]))
def test_the_compiled_total_and_check_are_check_targets(simd, row, poison):
    # What the compiled step reads from a row is exactly what check_target reads.
    row = row.copy()
    if poison is not None:
        row[len(row) // 2] = poison
    x = row.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = tree.total(x)
    for threads in (1, 3):  # the whole row in one piece, and split into pieces
        (total,) = targetrows._fastq.row_checks([row], threads)
        if (x < 0).any() or not (np.isfinite(want) and want > 0):  # check_target's refusals
            assert total is None
        else:
            assert total == want


@compiled
@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # simd: one setting per test
)
@given(long_rows(), st.sampled_from(["none", "q32", "i32", "i64", "sparse"]), st.integers(0, 2**32))
def test_the_compiled_draw_total_is_the_residuals(simd, row, qkind, seed):
    # The tree a compiled draw descends has the per-request residual's total, bit for bit.
    x = row.astype(np.float64)
    total = tree.total(x)
    if not total > 0 or not np.isfinite(total):
        return
    vocab = len(row)
    rng = np.random.default_rng(seed)
    w = rng.random(vocab)
    counts = dyadic.counts_from_weights(w) if vocab > 1 else np.array([M])
    q: object = None
    ids = None
    if qkind == "q32":
        q = dyadic.counts_to_fp32(counts)
    elif qkind == "i32":
        q = counts.astype(np.int32)
    elif qkind == "i64":
        q = counts.astype(np.int64)
    elif qkind == "sparse":
        ids = np.flatnonzero(counts).astype(np.int32)
        q = counts[ids].astype(np.int64)
    p = x / total
    want_w = p if q is None else targetrows.residual(p, counts)
    want = tree.total(want_w)
    got = targetrows._fastq.draw_total(row, total, q, ids)
    assert got == want


# -- the row-batched tree of the device path -------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(0, 1e30) | st.sampled_from([0.0, 5e-324]), min_size=5, max_size=5),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.integers(0, (1 << 53) - 1), min_size=4, max_size=4),
)
def test_row_levels_and_descents_are_each_rows_own(values, draws):
    torch = pytest.importorskip("torch")
    from pp1wire.q import torch_ops

    x = np.array(values)
    levels = torch_ops.row_levels(torch.from_numpy(x))
    for i, row in enumerate(x):
        own = tree.levels(row)
        assert all(a[i].tolist() == b.tolist() for a, b in zip(levels, own, strict=True))
    totals = torch_ops.row_totals(torch.from_numpy(x)).numpy()
    assert totals.tolist() == [tree.total(r) for r in x]
    t = np.array([d / 2.0**53 for d in draws[: len(x)]]) * totals
    got = torch_ops.descend_rows(levels, torch.from_numpy(t))
    for i, row in enumerate(x):
        if totals[i] > 0:
            assert int(got[i]) == tree.descend(tree.levels(row), float(t[i]))


def test_draws_from_no_mass_are_refused_by_every_backend():
    # q equal to p leaves no residual: -1 (EMPTY_RESIDUAL), on the host, compiled,
    # on a device and per prefix.
    p = np.array([0.25, 0.75, 0.0])
    q = QRow(token=1, counts=np.array([M // 4, 3 * (M // 4), 0]))
    empty, full = Draw(0, q, 123, 3), Draw(0, None, 123, 3)
    step = targetrows.StepRows.of_matrix(p[None])
    backends: list = [
        targetrows.HostRows(step),
        targetrows.PrefixRows([0], (), lambda prefix: p, (), 3),
    ]
    if getattr(targetrows._fastq, "row_checks", None) is not None:
        backends.append(targetrows.CompiledRows(step, 1))
    torch = pytest.importorskip("torch")
    from pp1wire.q import torch_ops

    backends.append(torch_ops.DeviceStep(torch.from_numpy(p[None]), [(0, 1)]))
    for ops in backends:
        assert ops.check([(0, 3)]) == [True]
        assert ops.p_at([(0, 1)]) == [0.75]
        assert ops.draw([empty, full])[0] == -1
        assert ops.draw([full]) != [-1]


# -- torch rows: viewed on the CPU, kept on their device otherwise -----------------------


@pytest.mark.parametrize("device_path", [False, True])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**step_cases)
def test_torch_rows_decide_the_same(device_path, vocab, plans_, dtype):
    torch = pytest.importorskip("torch")
    with pytest.MonkeyPatch.context() as mp:
        if device_path:
            # The device path on CPU tensors: the same torch code a GPU runs.
            mp.setattr(targetrows, "_on_device", lambda x: isinstance(x, torch.Tensor))
        (mine, ref), matrix, spans = build(vocab, plans_)
        with np.errstate(over="ignore"):
            rows = torch.from_numpy(matrix.astype(dtype))
        want = reference(ref, rows.numpy(), spans, True)
        got = verify_step(mine, rows)
    assert [outcome(g) for g in got] == [outcome(w) for w in want]
    assert [state(v) for v, _, _ in mine] == [state(v) for v, _, _ in ref]


def test_a_cpu_tensor_is_viewed_not_copied():
    torch = pytest.importorskip("torch")
    rows = torch.rand(3, 40, dtype=torch.float64)
    view = targetrows.StepRows.of_matrix(rows).host(1, 40)
    assert view is not None
    assert view.ctypes.data == rows[1].data_ptr()


def boundary_case(vocab: int):
    """A target-only round whose draw lands exactly on the root's left sum (§6.6: go
    right): p = (a, 0, ..., 1 - a, 0, ...) with a the draw itself; the token to expect."""
    v = RequestVerifier(session=1, seed=9, vocab_size=vocab, prefix=[0], target=lambda p: None)
    u = RoundStreams(Role.SPARK, v.seed, v.generation, 0).u53_int(Domain.TARGET, v.position)
    p = np.zeros((1, vocab))
    right = 1 if vocab == 2 else 128  # the first ID under the root's right child
    p[0, 0], p[0, right] = u / 2.0**53, 1.0 - u / 2.0**53
    return v, p, right


@pytest.mark.parametrize("vocab", [2, 200])
def test_a_draw_that_lands_on_a_boundary_goes_right(step_path, vocab):
    v, p, right = boundary_case(vocab)
    got = verify_step([(v, None, 0)], p)[0]
    assert not isinstance(got, VerifyError)
    assert got.tokens == (right,)


@pytest.mark.parametrize("vocab", [2, 200])
def test_a_draw_on_a_boundary_goes_right_on_the_device_path(monkeypatch, vocab):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(targetrows, "_on_device", lambda x: isinstance(x, torch.Tensor))
    v, p, right = boundary_case(vocab)
    got = verify_step([(v, None, 0)], torch.from_numpy(p))[0]
    assert not isinstance(got, VerifyError)
    assert got.tokens == (right,)


def test_rows_of_another_float_type_are_widened_as_per_request(step_path):
    plans_ = [Plan(d, None, False, "q32", ["ok"] * 6, False, False, False) for d in (4, 0)]
    check_same(300, plans_, np.float16)


def test_per_prefix_rows_on_a_device_are_decided_there(monkeypatch):
    # A per-prefix target whose rows live on one device: stacked there, not copied out.
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(targetrows, "_on_device", lambda x: isinstance(x, torch.Tensor))
    stacked = []
    step_rows = targetrows.StepRows.of_rows

    def spy(rows):
        out = step_rows(rows)
        stacked.append(out.device is not None)
        return out

    monkeypatch.setattr(targetrows.StepRows, "of_rows", spy)
    target = ToyLM(300, 3)
    plans_ = [Plan(d, None, False, "counts", ["ok"] * 6, False, False, False) for d in (5, 0, 3)]
    (mine, ref), _, _ = build(300, plans_)
    got = verify_batch(mine, lambda ps: [torch.from_numpy(target.probs(p)) for p in ps])
    want = verify_batch(ref, lambda ps: [target.probs(p) for p in ps])
    assert stacked == [True, False]  # the tensors stay together; numpy rows stay on the host
    assert [outcome(g) for g in got] == [outcome(w) for w in want]


def test_a_process_on_one_core_decides_on_one_thread(monkeypatch):
    monkeypatch.setattr(targetrows.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert targetrows.step_threads() == 1
    monkeypatch.setattr(targetrows.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert targetrows.step_threads() == 2


@pytest.mark.parametrize("status", [-2, -3])
def test_a_draw_the_compiled_backend_could_not_make_is_numpys(monkeypatch, status):
    # -2 (out of memory for the draw's tree) and -3 (a sparse q it does not take)
    # hand that draw to numpy: the step still decides what each request decides.
    fastq = targetrows._fastq
    if getattr(fastq, "row_checks", None) is None:
        pytest.skip("compiled fast path not built")
    failed = []

    def draw_rows(specs, threads):
        out = fastq.draw_rows(specs, threads)
        out[0] = status
        failed.append(len(specs))
        return out

    compiled = {"row_checks": staticmethod(fastq.row_checks), "draw_rows": staticmethod(draw_rows)}
    monkeypatch.setattr(targetrows, "_fastq", type("Compiled", (), compiled))
    plans_ = [Plan(d, None, False, "counts", ["ok"] * 6, False, False, False) for d in (4, 0, 2)]
    check_same(300, plans_)
    assert sum(failed) == 3  # the step's three draws, the first of each call numpy's


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_tensor_rows_decide_alike_in_every_form(step_path, dtype):
    # numpy cannot view bf16: the step widens it (and float16) to float32, which
    # holds every such value, so it decides what each request decides on those
    # values. One conversion for every form of a step's rows: a bf16 matrix was
    # widened exactly, while a per-prefix target's bf16 rows (and the per-request
    # verifier's) were unreadable, so every round failed TARGET_FAILED.
    torch = pytest.importorskip("torch")
    plans_ = [
        Plan(d, None, False, q, ["ok"] * 6, False, False, False)
        for d, q in ((4, "q32"), (0, "counts"), (3, "i32"))
    ]
    (as_matrix, per_request), matrix, spans = build(300, plans_)
    (per_prefix, _), _, _ = build(300, plans_)
    rows = torch.from_numpy(matrix).to(getattr(torch, dtype))

    def target(prefixes):
        assert len(prefixes) == len(rows)
        return list(rows)  # one 1-D tensor per prefix, as a per-prefix plugin gives them

    want = [outcome(w) for w in reference(per_request, rows.double().numpy(), spans, True)]
    assert not any(isinstance(w[0], ErrorCode) for w in want)
    assert [outcome(g) for g in verify_step(as_matrix, rows)] == want
    assert [state(v) for v, _, _ in as_matrix] == [state(v) for v, _, _ in per_request]
    assert [outcome(g) for g in verify_batch(per_prefix, target)] == want
    (each, _), _, _ = build(300, plans_)
    assert [outcome(g) for g in reference(each, rows, spans, True)] == want
