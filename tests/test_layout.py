"""Shard layouts and the shard contract (protocol §6.7) against the unsharded q contract (§6.2).

The claim under test: the shard checks of every rank plus the group checks
accept exactly the rows the unsharded validator accepts, for every split, and
refuse a single corruption with the same code (a wrong total surfaces as the
group's ``GROUP_MASS_MISMATCH``, or as ``MASS_MISMATCH`` from the one shard
that alone holds more than 2**24).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.errors import ErrorCode, ValidationError
from pp1wire.q import dyadic, validate
from pp1wire.q.layout import (
    ShardLayout,
    ShardSummary,
    check_dense_shard,
    check_group,
    check_sparse_shard,
)

M = dyadic.M
V = 8
KEY = (0, 1, 3, 99, 2, 0)


def layouts(v: int):
    """Every layout of ``v`` into 1..3 shards (empty ranges included)."""
    for n in (1, 2, 3):
        for cuts in itertools.combinations_with_replacement(range(v + 1), n - 1):
            yield ShardLayout((0, *cuts, v))


def test_even_split_and_digest():
    assert ShardLayout.even(129_280, 2).bounds == (0, 64_640, 129_280)
    assert ShardLayout.even(10, 3).bounds == (0, 3, 6, 10)
    assert ShardLayout.even(8, 1).bounds == (0, 8)
    a, b = ShardLayout.even(10, 2), ShardLayout((0, 4, 10))
    assert a.digest != b.digest  # same count and vocabulary, another split
    assert ShardLayout.even(10, 2).digest == a.digest
    assert a.range(1) == (5, 10)
    with pytest.raises(ValueError, match="outside a layout"):
        a.range(2)


@pytest.mark.parametrize("bounds", [(0,), (1, 8), (0, 5, 4, 8), (0, 0), (0, 2**31)], ids=str)
def test_bad_layouts_are_refused(bounds):
    with pytest.raises(ValueError, match=r"layout|vocabulary"):
        ShardLayout(bounds)


def unsharded_dense(q32: np.ndarray, token: int) -> ErrorCode | None:
    try:
        validate.DenseRowValidator(V).check(q32, token)
    except ValidationError as exc:
        return exc.code
    return None


def sharded_dense(q32: np.ndarray, token: int, layout: ShardLayout) -> ErrorCode | None:
    summaries = []
    for r in range(layout.shards):
        start, end = layout.range(r)
        try:
            mass = check_dense_shard(q32[start:end].copy(), start, end, V, token)
        except ValidationError as exc:
            return exc.code
        summaries.append(ShardSummary(KEY, (token,), (mass,)))
    return check_group(summaries)


def unsharded_sparse(ids: np.ndarray, q: np.ndarray, token: int) -> ErrorCode | None:
    try:
        validate.check_sparse(ids, q, V, V, token)
    except ValidationError as exc:
        return exc.code
    return None


def sharded_sparse(
    ids: np.ndarray, q: np.ndarray, token: int, layout: ShardLayout
) -> ErrorCode | None:
    summaries = []
    for r in range(layout.shards):
        start, end = layout.range(r)
        mine = (ids >= start) & (ids < end)
        try:
            mass = check_sparse_shard(ids[mine], q[mine], start, end, V, V, token)
        except ValidationError as exc:
            return exc.code
        summaries.append(ShardSummary(KEY, (token,), (mass,)))
    return check_group(summaries)


def same(unsharded: ErrorCode | None, sharded: ErrorCode | None) -> bool:
    if unsharded is ErrorCode.MASS_MISMATCH:
        return sharded in (ErrorCode.MASS_MISMATCH, ErrorCode.GROUP_MASS_MISMATCH)
    return unsharded == sharded


counts_strategy = st.lists(st.integers(0, 4), min_size=V, max_size=V).filter(lambda c: sum(c) > 0)

CORRUPTIONS = ["none", "nan", "inf", "neg", "negzero", "above1", "nondyadic", "mass", "zero_at"]


def corrupt_dense(counts: list[int], token: int, how: str) -> np.ndarray:
    c = dyadic.counts_from_weights(counts)
    q = dyadic.counts_to_fp32(c).astype("<f4")
    other = (token + 1) % V
    if how == "nan":
        q[other] = np.nan
    elif how == "inf":
        q[other] = np.inf
    elif how == "neg":
        q[other] = -q[token]
    elif how == "negzero":
        q[other] = -0.0 if q[other] == 0 else -q[other]
    elif how == "above1":
        q[other] = 1.5
    elif how == "nondyadic":
        q[other] = np.float32(1e-30)
    elif how == "mass":
        q[other] += np.float32(1 / M)
    elif how == "zero_at":  # the token's mass moved elsewhere: the total stays exact
        q[other] += q[token]
        q[token] = 0.0
    return q


@settings(max_examples=60, deadline=None)
@given(counts_strategy, st.sampled_from(CORRUPTIONS), st.data())
def test_dense_shard_and_group_checks_equal_the_unsharded_contract(counts, how, data):
    c = dyadic.counts_from_weights(counts)
    token = data.draw(st.sampled_from([i for i in range(V) if c[i] > 0]))
    q = corrupt_dense(counts, token, how)
    want = unsharded_dense(q, token)
    if how == "none":
        assert want is None
    for layout in layouts(V):
        got = sharded_dense(q, token, layout)
        assert same(want, got), (how, layout.bounds, want, got)


@settings(max_examples=60, deadline=None)
@given(
    counts_strategy,
    st.sampled_from(["none", "nan", "neg", "nondyadic", "mass", "zero"]),
    st.data(),
)
def test_sparse_shard_and_group_checks_equal_the_unsharded_contract(counts, how, data):
    c = dyadic.counts_from_weights(counts)
    ids = np.flatnonzero(c).astype("<i4")
    q = dyadic.counts_to_fp32(c[ids]).astype("<f4")
    token = int(data.draw(st.sampled_from(list(ids))))
    if ids.size > 1:
        j = int(np.flatnonzero(ids != token)[0])
        if how == "nan":
            q[j] = np.nan
        elif how == "neg":
            q[j] = -q[j]
        elif how == "nondyadic":
            q[j] = np.float32(1e-30)
        elif how == "mass":
            q[j] += np.float32(1 / M)
        elif how == "zero":
            q[j] = 0.0
    want = unsharded_sparse(ids, q, token)
    for layout in layouts(V):
        got = sharded_sparse(ids, q, token, layout)
        assert same(want, got), (how, layout.bounds, want, got)


def test_a_valid_looking_shard_with_the_wrong_mass_is_refused_by_the_group_not_the_shard():
    layout = ShardLayout((0, 4, 8))
    q = dyadic.counts_to_fp32(dyadic.counts_from_weights([1, 1, 1, 1, 1, 1, 1, 1]))
    q[1] += np.float32(1 / M)  # shard 0 holds M/2 + 1: below 2**24, so every shard passes
    masses = [check_dense_shard(q[s:e].copy(), s, e, V, 5) for s, e in map(layout.range, (0, 1))]
    assert masses == [M // 2 + 1, M // 2]
    summaries = [ShardSummary(KEY, (5,), (m,)) for m in masses]
    assert check_group(summaries) is ErrorCode.GROUP_MASS_MISMATCH


def test_a_shard_alone_above_the_whole_mass_is_refused_by_the_shard():
    q = np.full(4, 0.5, dtype="<f4")  # 2 * 2**24 on one shard
    with pytest.raises(ValidationError) as exc:
        check_dense_shard(q, 0, 4, V, 1)
    assert exc.value.code is ErrorCode.MASS_MISMATCH


def test_group_refuses_shards_that_disagree_on_the_round_or_tokens():
    a = ShardSummary(KEY, (1, 2), (M, M))
    b = ShardSummary(KEY, (1, 2), (0, 0))
    assert check_group([a, b]) is None
    assert check_group([a, ShardSummary((0, 2, 3, 99, 2, 0), (1, 2), (0, 0))]) is (
        ErrorCode.GROUP_SHARD_MISMATCH
    )
    assert check_group([a, ShardSummary(KEY, (1, 3), (0, 0))]) is ErrorCode.GROUP_SHARD_MISMATCH
    assert check_group([a, ShardSummary(KEY, (1, 2), (0,))]) is ErrorCode.GROUP_SHARD_MISMATCH


def test_an_empty_sparse_shard_passes_unless_it_owns_the_token():
    empty_ids, empty_q = np.zeros(0, "<i4"), np.zeros(0, "<f4")
    assert check_sparse_shard(empty_ids, empty_q, 4, 8, V, 4, 1) == 0
    with pytest.raises(ValidationError) as exc:
        check_sparse_shard(empty_ids, empty_q, 4, 8, V, 4, 5)
    assert exc.value.code is ErrorCode.ZERO_Q_AT_PROPOSED
    ids = np.array([3], "<i4")
    with pytest.raises(ValidationError) as exc:
        check_sparse_shard(ids, np.ones(1, "<f4"), 4, 8, V, 4, 1)
    assert exc.value.code is ErrorCode.SPARSE_ID_OUT_OF_RANGE
