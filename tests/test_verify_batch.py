"""One engine step: many requests' rounds scored by one target call decide exactly
what per-request verification decides (same tokens, same prefixes, same refusals)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode, VerifyError
from pp1wire.q.proposal import propose
from pp1wire.q.rng import Role, RoundStreams
from pp1wire.q.verify import RequestVerifier, batched, proposal_from_rows, verify_batch

V = 40


def make(seed: int, target) -> RequestVerifier:
    return RequestVerifier(
        session=1, seed=seed, vocab_size=V, prefix=[1, 2, seed % V], target=target
    )


def draft(v: RequestVerifier, round_id: int, depth: int, support: int | None):
    streams = RoundStreams(Role.WORKER, v.seed, v.generation, round_id)
    rows = propose(v.committed, depth, ToyLM(V, 3, draft=True).logits, streams, support=support)
    return proposal_from_rows(v, rows, round_id, depth)


@settings(max_examples=25, deadline=None)
@given(
    plan=st.lists(st.tuples(st.integers(0, 5), st.sampled_from([None, 6])), min_size=1, max_size=6),
    rounds=st.integers(1, 4),
)
def test_a_batched_step_commits_what_per_request_verification_commits(plan, rounds):
    # plan[k] = (depth, support) of request k; depth 0 = a target-only round.
    target = ToyLM(V, 3).probs
    calls = []

    def counted(prefixes):
        calls.append(len(prefixes))
        return [target(p) for p in prefixes]

    alone = [make(k, target) for k in range(len(plan))]
    batch = [make(k, target) for k in range(len(plan))]
    steps = 0
    for r in range(rounds):
        step = []
        for k, (depth, support) in enumerate(plan):
            if batch[k].finished:
                continue
            proposal = draft(batch[k], r, depth, support) if depth else None
            step.append((batch[k], proposal, r))
            want = (
                alone[k].verify(draft(alone[k], r, depth, support))
                if depth
                else alone[k].decode_target_only(r)
            )
            step[-1] = (batch[k], proposal, r, want)
        if not step:
            continue
        steps += 1
        decided = verify_batch([s[:3] for s in step], counted)
        for (_, _, _, want), got in zip(step, decided, strict=True):
            assert not isinstance(got, VerifyError), got
            assert got.tokens == want.tokens
            assert got.accepted == want.accepted
        assert [v.committed for v in batch] == [v.committed for v in alone]
    # One target call per step, scoring every position and bonus of every round.
    assert len(calls) == steps


def test_a_refused_round_does_not_spoil_the_others_and_a_failing_target_fails_all():
    target = ToyLM(V, 3).probs
    good, stale = make(1, target), make(2, target)
    p_good = draft(good, 0, 3, None)
    p_stale = draft(stale, 0, 3, None)
    stale.decode_target_only(0)  # its prefix moved on: the proposal is stale
    decided = verify_batch([(good, p_good, 0), (stale, p_stale, 1)], batched(target))
    assert not isinstance(decided[0], VerifyError)
    assert isinstance(decided[1], VerifyError)
    assert decided[1].code is ErrorCode.STALE_PREFIX

    def broken(prefixes):
        raise RuntimeError("device lost")

    a, b = make(3, target), make(4, target)
    before = (list(a.committed), list(b.committed))
    decided = verify_batch([(a, None, 0), (b, draft(b, 0, 2, None), 0)], broken)
    assert [d.code for d in decided] == [ErrorCode.TARGET_FAILED] * 2  # type: ignore[union-attr]
    assert (a.committed, b.committed) == before
    assert a.poisoned
    assert b.poisoned


def test_a_plugin_with_its_own_batch_form_is_called_once():
    class Engine:
        def __init__(self):
            self.model = ToyLM(V, 3)
            self.batches = 0

        def __call__(self, prefix):
            raise AssertionError("the per-prefix form must not be used")

        def batch(self, prefixes):
            self.batches += 1
            return np.stack([self.model.probs(p) for p in prefixes])

    engine = Engine()
    vs = [make(k, engine) for k in range(3)]
    decided = verify_batch([(v, draft(v, 0, 4, None), 0) for v in vs], batched(engine))
    assert engine.batches == 1
    assert not any(isinstance(d, VerifyError) for d in decided)
    ref = [make(k, ToyLM(V, 3).probs) for k in range(3)]
    for v, r in zip(vs, ref, strict=True):
        r.verify(draft(r, 0, 4, None))
        assert v.committed == r.committed


@pytest.mark.parametrize("rows", [0, 2])
def test_scores_that_do_not_fit_the_proposal_are_the_callers_mistake(rows):
    # Before: reported as TARGET_FAILED, as if the target had failed (and poisoned).
    v = make(5, ToyLM(V, 3).probs)
    p = draft(v, 0, 3, None)
    with pytest.raises(VerifyError) as info:
        v.verify(p, scores=[np.full(V, 1.0 / V)] * rows)
    assert info.value.code is ErrorCode.BAD_ARGUMENT
    assert not v.poisoned


def test_evaluating_a_batch_commits_nothing_and_decides_what_committing_would():
    target = ToyLM(V, 3).probs
    held = [make(k, target) for k in range(4)]
    committing = [make(k, target) for k in range(4)]
    rounds = [(v, draft(v, 0, 3, None) if k % 2 else None, 0) for k, v in enumerate(held)]
    before = [list(v.committed) for v in held]
    evaluated = verify_batch(rounds, batched(target), commit=False)
    assert [list(v.committed) for v in held] == before
    assert all(v.last_round == -1 for v in held)
    decided = verify_batch(
        [(c, draft(c, 0, 3, None) if k % 2 else None, 0) for k, c in enumerate(committing)],
        batched(target),
    )
    for e, d in zip(evaluated, decided, strict=True):
        assert not isinstance(e, VerifyError)
        assert not isinstance(d, VerifyError)
        assert e.tokens == d.tokens


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.floats(0, 1e30, allow_nan=False, allow_infinity=False) | st.sampled_from([5e-324, 0.0]),
        min_size=2,
        max_size=64,
    ).filter(lambda v: sum(v) > 0)
)
def test_one_entry_divided_alone_is_the_entry_of_the_divided_row(values):
    # The verifier divides only p(x) for an accepted draft: bit-for-bit the same number.
    from pp1wire.q.verify import check_target, checked_target

    arr = np.array(values, dtype=np.float64)
    full = check_target(arr, arr.size)
    raw, total = checked_target(arr, arr.size)
    assert all(float(raw[x]) / total == float(full[x]) for x in range(arr.size))


def test_a_per_prefix_target_that_fails_fails_only_the_rounds_that_needed_it():
    def target(prefix):
        if list(prefix[:1]) == [7]:
            raise RuntimeError("device lost")
        return ToyLM(V, 3).probs(prefix)

    ok, bad = make(1, target), make(2, target)
    bad.rebuild([7, 1], 0)
    decided = verify_batch([(ok, None, 0), (bad, draft(bad, 0, 3, None), 0)], batched(target))
    assert not isinstance(decided[0], VerifyError)
    assert isinstance(decided[1], VerifyError)
    assert decided[1].code is ErrorCode.TARGET_FAILED
    assert bad.poisoned
    assert not ok.poisoned
