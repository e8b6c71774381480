"""The compiled dense-row scan computes exactly what the numpy path computes."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
