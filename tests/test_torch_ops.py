"""The torch kernels are bit-equal to the numpy ones on the CPU (and raise the same codes)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.errors import Pp1Error
from pp1wire.q import dyadic, verify

torch = pytest.importorskip("torch")
from pp1wire.q import torch_ops  # noqa: E402

U53 = 1 << 53


def same(np_fn: Callable[..., object], torch_fn: Callable[..., object], *args: object) -> None:
    """numpy on the arrays and torch on the same values as tensors agree exactly."""
    np_args = [np.asarray(a) if isinstance(a, list) else a for a in args]
    t_args = [
        torch.tensor(a, dtype=torch.float64)
        if isinstance(a, list)
        else torch.from_numpy(a)
        if isinstance(a, np.ndarray)
        else a
        for a in args
    ]
    want: object
    got: object
    try:
        want = np_fn(*np_args)
    except Pp1Error as exc:
        want = exc.code
    try:
        got = torch_fn(*t_args)
    except Pp1Error as exc:
        got = exc.code
    if not isinstance(want, (tuple, np.ndarray, int)):
        assert got is want
        return
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.cpu().tolist() == np.asarray(w).tolist()
    elif isinstance(want, np.ndarray):
        assert got.cpu().tolist() == want.tolist()
    else:
        assert int(got) == want


finite = st.floats(min_value=0.0, max_value=1e300, allow_subnormal=True)
tiny = st.floats(min_value=0.0, max_value=1e-300, allow_subnormal=True)
weights = st.lists(st.one_of(finite, tiny, st.just(0.0), st.just(1.0)), min_size=1, max_size=40)
logits = st.lists(
    st.one_of(st.floats(-1e4, 1e4), st.just(-np.inf), st.just(0.0)), min_size=1, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(weights, st.integers(1, 8))
def test_construction_from_weights(values, k):
    same(dyadic.counts_from_weights, torch_ops.counts_from_weights, values)
    same(dyadic.sparse_counts_from_weights, torch_ops.sparse_counts_from_weights, values, k)


@settings(max_examples=200, deadline=None)
@given(logits, st.floats(0.05, 20.0), st.integers(1, 8))
def test_construction_from_logits(values, temperature, k):
    same(dyadic.counts_from_logits, torch_ops.counts_from_logits, values, temperature)
    same(
        dyadic.sparse_counts_from_logits,
        torch_ops.sparse_counts_from_logits,
        values,
        temperature,
        k,
    )


@settings(max_examples=200, deadline=None)
@given(weights, st.integers(0, U53 - 1), st.integers(0, (1 << 24) - 1))
def test_draws(values, u53, u24):
    w = np.array(values)
    same(lambda x: verify.check_target(x, w.size), torch_ops.check_target, values)
    same(verify.sample_weights, torch_ops.sample_weights, values, u53)
    if (w > 0).any() and np.isfinite(w.sum()):
        counts = dyadic.counts_from_weights(w)
        same(dyadic.sample, torch_ops.sample, counts, u24)
        p = verify.check_target(w[::-1].copy(), w.size)
        same(verify.residual_sample, torch_ops.residual_sample, p, counts, u53)


def test_full_vocabulary_rows():
    # One full-size case: the toy drafter's logits at 129,280 tokens.
    from pp1wire.apps.models import ToyLM

    lm = ToyLM(129_280, 1, draft=True)
    for prefix in ([1, 2, 3], [7]):
        z = lm.logits(prefix)
        want = dyadic.counts_from_logits(z, 0.8)
        got = torch_ops.counts_from_logits(torch.from_numpy(z), 0.8)
        assert torch.equal(got, torch.from_numpy(want))
        ids, counts = dyadic.sparse_counts_from_logits(z, 1.0, 32)
        tids, tcounts = torch_ops.sparse_counts_from_logits(torch.from_numpy(z), 1.0, 32)
        assert tids.tolist() == ids.tolist()
        assert tcounts.tolist() == counts.tolist()
        p = verify.check_target(lm.probs(prefix), 129_280)
        assert torch.equal(
            torch_ops.check_target(torch.from_numpy(lm.probs(prefix))), torch.from_numpy(p)
        )
        for u in (0, 12345, U53 // 2, U53 - 1):
            assert int(
                torch_ops.residual_sample(torch.from_numpy(p), got, u)
            ) == verify.residual_sample(p, want, u)


def test_torch_descent_never_enters_a_zero_child():
    for values, targets, want in (
        ([0.5, 0.0], (0.5, 0.75), 0),
        ([0.0, 0.5], (0.0,), 1),
        ([0.0, 0.25, 0.0, 0.0], (0.0, 0.25, 1.0), 1),
    ):
        levels = torch_ops.tree_levels(torch.tensor(values, dtype=torch.float64))
        for t in targets:
            assert int(torch_ops.descend(levels, torch.tensor(t, dtype=torch.float64))) == want
