"""The accept/resample walk is written once, and every path decides through it.

:func:`pp1wire.q.walk.walk` alone decides a block; the paths differ only in the
row operations they hand it. Checked here: the order of its questions (only
the rows a round reaches, one level at a time, every draw in one call), that
each path's decisions are those of a plain reading of ``docs/protocol.md``
§6.5 (the reference below, written independently of the package's walk), that
every path goes through the one walk, and that a vocabulary-sharded step keeps
its collectives (``docs/tp.md``, "Collectives per step, Spark group").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode, VerifyError
from pp1wire.q import dyadic, targetrows, walk
from pp1wire.q.proposal import Proposal, QRow, propose
from pp1wire.q.rng import Domain, Role, RoundStreams
from pp1wire.q.verify import (
    Outcome,
    RequestVerifier,
    RoundResult,
    accept_exact,
    check_target,
    proposal_from_rows,
    residual_sample,
    sample_weights,
    verify_step,
)

M = 1 << 24


# -- the order of the walk's questions ---------------------------------------------------


class Script:
    """Row operations that answer from a script and record every question."""

    def __init__(self, good: set[int], p: dict[int, float], eager: bool = False) -> None:
        self.good, self.p, self.eager_draws = good, p, eager
        self.calls: list[tuple[str, list]] = []

    def check(self, rows):
        self.calls.append(("check", [r for r, _ in rows]))
        return [r in self.good for r, _ in rows]

    def p_at(self, asks):
        self.calls.append(("p_at", list(asks)))
        return [self.p[r] for r, _ in asks]

    def draw(self, draws):
        self.calls.append(("draw", [(d.row, d.q is not None) for d in draws]))
        return [-1 if d.row == 99 else 7 for d in draws]


def job(rows: Sequence[int], tokens: Sequence[int], eos: int | None = None) -> walk.RoundRows:
    drafts = tuple(QRow(t, counts=np.full(4, M // 4)) for t in tokens)
    return walk.RoundRows(
        rows=tuple(rows),
        drafts=drafts,
        tokens=tuple(tokens),
        counts=(M // 4,) * len(tokens),
        seed=3,
        generation=0,
        round_id=0,
        start=5,
        eos=eos,
        vocab=4,
    )


@pytest.mark.parametrize("eager", [False, True])
def test_the_walk_asks_only_for_the_rows_its_rounds_reach(eager):
    # p = 1 always accepts and p = 0 never does (the exact test, whatever the draw).
    jobs = [
        job([0], []),  # target-only: one row, one draw
        job([1, 2, 3], [1, 2]),  # both accepted: the bonus from row 3
        job([4, 5, 6], [1, 2]),  # rejected at row 5: the correction, row 6 never read
        job([7, 8, 9], [3, 1], eos=3),  # an accepted terminal draft: no bonus, no draw
        job([10, 11], [1]),  # row 11 is bad: the round stops there
        job([12, 99], [1]),  # the bonus row has no mass: empty
    ]
    good = {0, 1, 2, 3, 4, 5, 7, 10, 12, 99}
    p = {1: 1.0, 2: 1.0, 4: 1.0, 5: 0.0, 7: 1.0, 10: 1.0, 12: 1.0}
    ops = Script(good, p, eager)
    got = walk.walk(jobs, ops)
    asked = [
        ("check", [0, 1, 4, 7, 10, 12]),
        ("p_at", [(1, 1), (4, 1), (7, 3), (10, 1), (12, 1)]),
        ("draw", [(0, False)]),
        ("check", [2, 5, 11, 99]),
        ("p_at", [(2, 2), (5, 2)]),
        ("draw", [(99, False), (5, True)]),
        ("check", [3]),
        ("draw", [(3, False)]),
    ]
    if not eager:  # every draw in one call, at the end
        asked = [a for a in asked if a[0] != "draw"]
        asked.append(("draw", [(0, False), (99, False), (5, True), (3, False)]))
    assert ops.calls == asked
    stop = walk.Stop
    assert got == [
        walk.Decision(stop.TARGET, 0, 0, 7),
        walk.Decision(stop.BONUS, 2, 2, 7),
        walk.Decision(stop.CORRECTION, 1, 1, 7),
        walk.Decision(stop.EOS, 0, 1, -1),
        walk.Decision(stop.BAD_ROW, 1, 1, -1),
        walk.Decision(stop.EMPTY, 1, 1, -1),
    ]


def test_the_acceptance_test_is_the_walks_on_the_exact_counts():
    # u * q(x) < p(x) exactly: at p(x) = u * q(x) rejected, one ulp above accepted.
    one = job([0, 1], [2])
    u = walk.RoundDraws(one).u53(Domain.ACCEPTANCE, one.start)
    p_x = u * (M // 4) / 2.0**77
    assert float(u * (M // 4)) == u * (M // 4)  # p_x is exact
    below = walk.walk([one], Script({0, 1}, {0: p_x}))[0]
    above = walk.walk([one], Script({0, 1}, {0: float(np.nextafter(p_x, 1.0))}))[0]
    assert below.stop is walk.Stop.CORRECTION
    assert above.stop is walk.Stop.BONUS
    assert accept_exact(u, M // 4, float(np.nextafter(p_x, 1.0)))


# -- every path: the decisions of a plain reading of the rule ------------------------------


def spec_round(v: RequestVerifier, proposal: Proposal | None, round_id: int, rows) -> tuple:
    """§6.5 read plainly, one position after another (the package's walk is not used):
    (tokens, accepted, outcome) or the code of the error."""
    streams = RoundStreams(Role.SPARK, v.seed, v.generation, round_id)
    start = v.position
    prefix = list(v.committed)

    def p_of(i: int) -> np.ndarray:
        p = check_target(rows[i], v.vocab_size)
        for proc in v.processors:
            p = check_target(proc(prefix, p), v.vocab_size)
        return p

    try:
        if proposal is None:
            token = sample_weights(p_of(0), streams.u53_int(Domain.TARGET, start))
            return (token,), 0, Outcome.TARGET
        new: list[int] = []
        for i, row in enumerate(proposal.rows):
            p = p_of(i)
            u = streams.u53_int(Domain.ACCEPTANCE, start + i)
            if accept_exact(u, row.count_at(row.token), float(p[row.token])):
                new.append(row.token)
                prefix.append(row.token)
                if row.token == v.eos:
                    return tuple(new), len(new), Outcome.EOS
                continue
            u = streams.u53_int(Domain.CORRECTION, start + i)
            y = residual_sample(p, row.dense_counts(v.vocab_size), u)
            return (*new, y), len(new), Outcome.CORRECTION
        d = len(proposal.rows)
        b = sample_weights(p_of(d), streams.u53_int(Domain.CORRECTION, start + d))
        return (*new, b), len(new), Outcome.BONUS
    except VerifyError as exc:
        return exc.code


def mask_last(prefix, p):
    """A processor that reads its prefix: no token twice in a row."""
    q = np.array(p, dtype=np.float64)
    q[prefix[-1]] = 0.0
    return q


def round_of(k: int, vocab: int, depth: int, support, eos: bool, processors: bool):
    target = ToyLM(vocab, 3)
    v = RequestVerifier(
        session=1,
        seed=500 + k,
        vocab_size=vocab,
        prefix=[1, 10 + k],
        target=target.probs,
        eos=3 if eos else None,
        processors=(mask_last,) if processors else (),
    )
    if not depth:
        return v, None
    streams = RoundStreams(Role.WORKER, v.seed, v.generation, 0)
    drafted = propose(
        v.committed, depth, ToyLM(vocab, 3, draft=True).logits, streams, support=support, eos=v.eos
    )
    return v, proposal_from_rows(v, drafted, 0, depth)


def rows_for(v: RequestVerifier, proposal: Proposal | None, scale: list[float]) -> list:
    target = ToyLM(v.vocab_size, 3)
    prefixes = [v.committed] if proposal is None else v.prefixes(proposal)
    return [target.probs(list(p)) * s for p, s in zip(prefixes, scale, strict=False)]


def result_of(r: RoundResult | VerifyError) -> tuple | ErrorCode:
    if isinstance(r, VerifyError):
        return r.code
    return r.tokens, r.accepted, r.outcome


cases = st.lists(
    st.tuples(
        st.integers(0, 5),
        st.sampled_from([None, 5]),
        st.booleans(),
        st.booleans(),
        st.lists(st.sampled_from([1.0, 1.0, 3.5, 1e-300, 0.0]), min_size=6, max_size=6),
    ),
    min_size=1,
    max_size=5,
)


@settings(
    max_examples=40,
    deadline=None,
    # The fixture patches the module for the whole test: the same for every example.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(cases, st.sampled_from([40, 300]))
def test_every_path_decides_as_the_rule_reads(monkeypatch_paths, plans, vocab):
    # Per request, and in one step (on every backend the fixture gives): the
    # tokens of the plain reading of §6.5, the errors of its checks (a row
    # without mass, TARGET_ZERO_MASS), with weights that are not probabilities.
    expected, singles, steps, matrix = [], [], [], []
    for k, (depth, support, eos, processors, scale) in enumerate(plans):
        v, proposal = round_of(k, vocab, depth, support, eos, processors)
        rows = rows_for(v, proposal, scale)
        expected.append(spec_round(v, proposal, 0, rows))
        one, _ = round_of(k, vocab, depth, support, eos, processors)
        scored = None if all(x == 1.0 for x in scale[: len(rows)]) else rows
        try:  # the target called per prefix where the rows are its own
            if proposal is None:
                score = None if scored is None else rows[0]
                singles.append(result_of(one.decode_target_only(0, score=score)))
            else:
                singles.append(result_of(one.verify(proposal, scores=scored)))
        except VerifyError as exc:
            singles.append(exc.code)
        stepped, _ = round_of(k, vocab, depth, support, eos, processors)
        steps.append((stepped, proposal, 0))
        matrix.extend(rows)
    assert singles == expected
    probs = monkeypatch_paths(np.array(matrix))
    assert [result_of(r) for r in verify_step(steps, probs)] == expected


@pytest.fixture(params=["numpy", "compiled", "device"])
def monkeypatch_paths(request, monkeypatch):
    """The rows as each backend of a step takes them (the device path on CPU tensors)."""
    if request.param == "numpy":
        monkeypatch.setattr(targetrows, "_fastq", None)
        return lambda m: m
    if request.param == "compiled":
        if getattr(targetrows._fastq, "row_checks", None) is None:
            pytest.skip("compiled fast path not built")
        return lambda m: m
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(targetrows, "_on_device", lambda x: isinstance(x, torch.Tensor))
    return torch.from_numpy


def test_every_path_goes_through_the_one_walk(monkeypatch):
    # The per-request verifier (processors too), target-only rounds and a step on
    # each backend: every one of them decides in pp1wire.q.walk.walk's loop.
    torch = pytest.importorskip("torch")
    seen: list[str] = []
    u53 = walk.RoundDraws.u53

    def spy(self, domain, position):
        seen.append(domain.name)
        return u53(self, domain, position)

    monkeypatch.setattr(walk.RoundDraws, "u53", spy)
    v, proposal = round_of(0, 40, 3, None, False, True)
    assert proposal is not None
    v.verify(proposal)
    assert "ACCEPTANCE" in seen
    seen.clear()
    v.decode_target_only(v.take_round())
    assert seen == ["TARGET"]
    for backend in ("compiled", "numpy", "device"):
        seen.clear()
        with monkeypatch.context() as mp:
            if backend == "numpy":
                mp.setattr(targetrows, "_fastq", None)
            w, p = round_of(1, 40, 3, None, False, False)
            rows = np.array(rows_for(w, p, [1.0] * 4))
            if backend == "device":
                mp.setattr(targetrows, "_on_device", lambda x: isinstance(x, torch.Tensor))
                rows = torch.from_numpy(rows)
            verify_step([(w, p, 0)], rows)
        assert "ACCEPTANCE" in seen, backend


# -- the compiled row operations, qualified against numpy's --------------------------------


compiled = pytest.mark.skipif(
    getattr(targetrows._fastq, "row_checks", None) is None, reason="compiled path not built"
)


@compiled
@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 5, 64, 65, 300, 1100, 4097, 70_001]),
    st.integers(0, 2**32 - 1),
    st.sampled_from([np.float32, np.float64]),
    st.sampled_from(["none", "q32", "i32", "i64", "sparse", "bad ids"]),
    st.sampled_from([1, 3]),
)
def test_the_compiled_row_operations_are_numpys(n, seed, dtype, qkind, threads):
    rng = np.random.default_rng(seed)
    rows = [(rng.random(n) ** 4).astype(dtype) for _ in range(4)]
    rows[1][n // 2] = np.nan
    rows.append(np.zeros(n, dtype=dtype))
    rows.append(np.ones(n + 1, dtype=dtype))  # not a row of this vocabulary
    step = targetrows.StepRows.of_rows(rows)
    host, fast = targetrows.HostRows(step), targetrows.CompiledRows(step, threads)
    wanted = [(r, n) for r in range(len(rows))]
    assert fast.check(wanted) == host.check(wanted) == [True, False, True, True, False, False]
    counts = dyadic.counts_from_weights(rng.random(n)) if n > 1 else np.array([M])
    q = None
    if qkind == "q32":
        q = QRow(0, q32=dyadic.counts_to_fp32(counts))
    elif qkind in ("i32", "i64"):
        q = QRow(0, counts=counts.astype(np.int32 if qkind == "i32" else np.int64))
    elif qkind in ("sparse", "bad ids"):
        ids = np.flatnonzero(counts).astype(np.int32)
        if qkind == "bad ids" and ids.size > 1:
            ids = ids[::-1].copy()  # not ascending: the compiled draw leaves it to numpy
        q = QRow(0, counts=counts[np.flatnonzero(counts)].astype(np.int64), ids=ids)
    draws = [walk.Draw(r, q, int(rng.integers(0, 1 << 53)), n) for r in (0, 2, 3)]
    assert fast.draw(draws) == host.draw(draws)
    assert fast.p_at([(2, n - 1)]) == host.p_at([(2, n - 1)])


@compiled
def test_a_sparse_q_the_compiled_draw_does_not_take_is_refused_there():
    row = np.full(8, 0.125)
    total = 1.0
    q = np.array([M // 2, M // 2], dtype=np.int64)
    ids_down, ids_out = np.array([5, 2], dtype=np.int32), np.array([2, 8], dtype=np.int32)
    draws = [(row, total, q, ids_down, 1), (row, total, q, ids_out, 1), (row, total, None, None, 1)]
    assert targetrows._fastq.draw_rows(draws) == [-3, -3, 0]


# -- the sharded walk keeps its collectives ----------------------------------------------


def test_a_sharded_step_runs_six_collectives_on_every_rank_and_decides_as_one_rank():
    # Check, normalize, p(x), the draws' totals, the drawn IDs, vote; a step of
    # target-only rounds asks no p(x) and skips that one on every rank alike.
    pytest.importorskip("torch")
    from pp1wire.q.layout import ShardLayout
    from pp1wire.q.verify import batched
    from pp1wire.tp.shard_spark import ShardedVerifyGroup, ShardRound

    from .groups import run_in_threads

    vocab = 64
    layout = ShardLayout.even(vocab, 2)
    plans = [(3, None), (0, None), (2, 5), (5, None)]

    def shard(row: QRow, rank: int) -> QRow:
        lo, hi = layout.range(rank)
        q = row.dense_q(vocab).astype(np.float32)
        if row.ids is None:
            return QRow(row.token, q32=np.ascontiguousarray(q[lo:hi]))
        ids = row.ids[(row.ids >= lo) & (row.ids < hi)]
        return QRow(row.token, q32=q[ids], ids=ids.astype(np.int32))

    def body(coord):
        group = ShardedVerifyGroup(coord)
        span = layout.range(coord.rank)
        target = batched(ToyLM(vocab, 3).probs)
        spent = []
        outs = []
        for step in (plans, [(0, None), (0, None)]):
            rounds = []
            for k, (depth, support) in enumerate(step):
                v, p = round_of(k, vocab, depth, support, False, False)
                if p is not None:
                    rows = tuple(shard(r, coord.rank) for r in p.rows)
                    p = Proposal(p.session, p.generation, p.round_id, p.position, p.digest,
                                 p.depth, rows, p.context, span)  # fmt: skip
                rounds.append(ShardRound(v, 0, p))
            before = coord.collectives
            outs.append([result_of(o) for o in group.decide(rounds, target)])
            spent.append(coord.collectives - before)
        return spent, outs

    results = run_in_threads(2, body, layout=layout, timeout=20.0)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    assert results[0] == results[1]
    spent, outs = results[0]
    assert spent == [6, 5]
    one = []
    for k, (depth, support) in enumerate(plans):
        v, p = round_of(k, vocab, depth, support, False, False)
        one.append(result_of(v.decode_target_only(0) if p is None else v.verify(p)))
    assert outs[0] == one
    assert all(isinstance(o, tuple) for o in outs[0] + outs[1])


def test_a_key_outside_the_rng_abi_is_refused_on_every_path():
    # A seed beyond 64 bits has no draws: the ABI's own refusal, per request and in a step.
    from pp1wire.errors import RngError

    def verifier() -> RequestVerifier:
        target = ToyLM(40, 3).probs
        return RequestVerifier(session=1, seed=1 << 64, vocab_size=40, prefix=[1], target=target)

    with pytest.raises(RngError):
        verifier().decode_target_only(0)
    rounds = [(verifier(), None, 0)]
    with pytest.raises(RngError):
        verify_step(rounds, np.ones((1, 40)))
