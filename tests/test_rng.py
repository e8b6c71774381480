"""Philox4x32-10 known answers and the pp1 RNG ABI's key layout and ownership rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pp1wire.errors import ErrorCode, RngError
from pp1wire.q.rng import (
    ABI_NAME,
    DRAW_LIMIT,
    Domain,
    Role,
    RoundStreams,
    counter_for,
    derive_seed,
    key_for_seed,
    philox4x32_10,
    u24_from_block,
    u53_int_from_block,
)

# Random123's published known-answer vectors for philox4x32_10.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF,) * 2,
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_known_answers_scalar(counter, key, expected):
    assert philox4x32_10(counter, key) == expected


def test_abi_name_is_versioned():
    assert ABI_NAME == "pp1-philox4x32-10-v1"


def test_counter_layout():
    assert counter_for(7, 9, 11, Domain.CORRECTION, 5) == (11, 9, 7, (3 << 24) | 5)
    assert key_for_seed(0x0123456789ABCDEF) == (0x89ABCDEF, 0x01234567)


@pytest.mark.parametrize(
    "fields",
    [
        (-1, 0, 0, Domain.PROPOSAL, 0),
        (1 << 32, 0, 0, Domain.PROPOSAL, 0),
        (0, 1 << 32, 0, Domain.PROPOSAL, 0),
        (0, 0, 1 << 32, Domain.PROPOSAL, 0),
        (0, 0, 0, Domain.PROPOSAL, DRAW_LIMIT),
        (0, 0, 0, 9, 0),
    ],
)
def test_counter_fields_out_of_range(fields):
    with pytest.raises(RngError) as info:
        counter_for(*fields)
    assert info.value.code is ErrorCode.RNG_FIELD_RANGE


def test_seed_range():
    with pytest.raises(RngError):
        key_for_seed(1 << 64)
    with pytest.raises(RngError):
        key_for_seed(-1)


@given(
    st.tuples(*[st.integers(0, 3)] * 3, st.sampled_from(list(Domain)), st.integers(0, 2)),
    st.tuples(*[st.integers(0, 3)] * 3, st.sampled_from(list(Domain)), st.integers(0, 2)),
)
def test_distinct_fields_give_distinct_counters(a, b):
    if a != b:
        assert counter_for(*a) != counter_for(*b)


def test_ownership_is_enforced():
    worker = RoundStreams(Role.WORKER, 1, 0, 0)
    spark = RoundStreams(Role.SPARK, 1, 0, 0)
    worker.u24(Domain.PROPOSAL, 3)
    for domain in (Domain.ACCEPTANCE, Domain.CORRECTION, Domain.TARGET):
        with pytest.raises(RngError) as info:
            worker.u24(domain, 3)
        assert info.value.code is ErrorCode.WRONG_OWNER
        spark.u53_int(domain, 3)
    with pytest.raises(RngError) as info:
        spark.u24(Domain.PROPOSAL, 3)
    assert info.value.code is ErrorCode.WRONG_OWNER


def test_a_key_is_never_drawn_twice():
    streams = RoundStreams(Role.SPARK, 5, 1, 2)
    streams.u53_int(Domain.ACCEPTANCE, 10)
    with pytest.raises(RngError) as info:
        streams.u53_int(Domain.ACCEPTANCE, 10)
    assert info.value.code is ErrorCode.KEY_REUSED
    # A different draw counter or domain is a different key.
    streams.u53_int(Domain.ACCEPTANCE, 10, draw=1)
    streams.u53_int(Domain.CORRECTION, 10)


def test_domains_do_not_share_noise():
    worker = RoundStreams(Role.WORKER, 99, 0, 0)
    spark = RoundStreams(Role.SPARK, 99, 0, 0)
    blocks = {worker.block(Domain.PROPOSAL, 4)}
    blocks |= {spark.block(d, 4) for d in (Domain.ACCEPTANCE, Domain.CORRECTION, Domain.TARGET)}
    assert len(blocks) == 4


def test_derived_uniforms():
    block = (0xFFFFFFFF, 0xFFFFFFFF, 0, 0)
    assert u24_from_block(block) == (1 << 24) - 1
    assert u53_int_from_block(block) == (1 << 53) - 1
    assert u53_int_from_block((0, 0, 0, 0)) == 0
    assert u24_from_block((0x12345678, 0, 0, 0)) == 0x123456


def test_u24_is_uniform_enough():
    # 2**16 draws into 16 bins of the top nibble: each bin expects 4096, sd 62;
    # tolerance six standard deviations plus one count, declared before the run.
    top = [u24_from_block(philox4x32_10((i, 0, 0, 0), (1, 2))) >> 20 for i in range(1 << 16)]
    bins = np.bincount(top, minlength=16)
    expected = (1 << 16) / 16
    sd = np.sqrt((1 << 16) * (1 / 16) * (15 / 16))
    assert np.all(np.abs(bins - expected) <= 6 * sd + 1)


def test_derive_seed_known_answers():
    # derive_seed(s, i) is output i of SplitMix64 started at state s. From state 0
    # the reference generator's first three outputs are published constants.
    assert [derive_seed(0, i) for i in range(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]
    # The base seed shifts the state: index i of base s is index i + k of base
    # s - k * gamma, so bases one gamma apart give the same sequence shifted by one.
    gamma = 0x9E3779B97F4A7C15
    assert derive_seed(gamma, 0) == derive_seed(0, 1)


def test_derive_seed_is_spread_and_checked():
    seeds = [derive_seed(7, i) for i in range(1000)]
    assert len(set(seeds)) == 1000
    assert all(0 <= s < 1 << 64 for s in seeds)
    with pytest.raises(RngError):
        derive_seed(-1, 0)
    with pytest.raises(RngError):
        derive_seed(0, -1)
