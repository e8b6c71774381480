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


@settings(max_examples=200, deadline=None)
@given(weights, st.integers(0, U53 - 1), st.integers(0, (1 << 24) - 1))
def test_draws(values, u53, u24):
    w = np.array(values)
    same(lambda x: verify.check_target(x, w.size), torch_ops.check_target, values)
    same(verify.sample_weights, torch_ops.sample_weights, values, u53)
    if (w > 0).any() and np.isfinite(w.sum()):
        counts = dyadic.counts_from_weights(w)
        drawn = torch_ops.draw_rows(torch.from_numpy(counts)[None], torch.tensor([u24]))
        assert int(drawn[0]) == dyadic.sample(counts, u24)
        p = verify.check_target(w[::-1].copy(), w.size)
        same(verify.residual_sample, torch_ops.residual_sample, p, counts, u53)


def test_full_vocabulary_rows():
    # One full-size case: the toy models' rows at 129,280 tokens.
    from pp1wire.apps.models import ToyLM
    from pp1wire.q.proposal import build_row

    lm = ToyLM(129_280, 1, draft=True)
    for prefix in ([1, 2, 3], [7]):
        probs = lm.probs(prefix).astype(np.float32)
        specs, draws = [(1.0, 0), (1.0, 32)], [12_345, (1 << 24) - 1]
        rows = torch.from_numpy(probs[None].repeat(2, 0))
        got = torch_ops.build_position(rows, specs, draws, None)
        for row, (_, support), u in zip(got, specs, draws, strict=True):
            counts, ids = build_row(probs, 1.0, support or None, kind="probs")
            assert not isinstance(row, Pp1Error), row
            assert np.array_equal(row.counts, counts)
            pick = dyadic.sample(counts, u)
            assert row.token == (pick if ids is None else int(ids[pick]))
        want = dyadic.counts_from_logits(lm.logits(prefix), 0.8)
        p = verify.check_target(lm.probs(prefix), 129_280)
        assert torch.equal(
            torch_ops.check_target(torch.from_numpy(lm.probs(prefix))), torch.from_numpy(p)
        )
        for u in (0, 12345, U53 // 2, U53 - 1):
            assert int(
                torch_ops.residual_sample(torch.from_numpy(p), torch.from_numpy(want), u)
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
