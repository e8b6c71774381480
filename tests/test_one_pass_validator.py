"""The compiled one-pass dense check refuses exactly what the numpy validator refuses.

``DenseRowValidator.check`` runs every check of ``docs/protocol.md`` §6.2
(dense) in one compiled pass over the row (``_fastq.check_dense``): the same
first failing class, the same error code, for the golden reply vectors and
their rejection cases (run on both paths) and for hypothesis rows that break
one or several rules at once, padded or not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.errors import ErrorCode, ValidationError
from pp1wire.q import dyadic, validate

from .golden_runners import run_reply_vector

fastq = pytest.importorskip("pp1wire.q._fastq")

ROOT = Path(__file__).resolve().parent.parent
VECTORS = json.loads((ROOT / "golden" / "vectors.json").read_text())["vectors"]
REPLIES = [v for v in VECTORS if v["kind"] == "reply"]


@pytest.mark.usefixtures("dyadic_path")
@pytest.mark.parametrize("vector", REPLIES, ids=lambda v: v["name"])
def test_golden_reply_vectors_on_both_paths(vector):
    assert run_reply_vector(vector) == vector["expect"]


def outcome(row: np.ndarray, vocab: int, entries: int, proposed: int, compiled: bool):
    """The validator's verdict: None, or the refusal's code."""
    saved = dyadic._fastq
    if not compiled:
        dyadic._fastq = None
    try:
        validate.DenseRowValidator(vocab, entries).check(row, proposed)
    except ValidationError as exc:
        return exc.code
    finally:
        dyadic._fastq = saved
    return None


damage = st.sampled_from(
    [
        ("value", np.nan),
        ("value", np.inf),
        ("value", -np.inf),
        ("value", -0.0),
        ("value", -(2.0**-24)),
        ("value", 1.5),
        ("value", 2.0**-30),  # not a multiple of 2**-24
        ("value", 3 * 2.0**-24),  # dyadic, but the mass is off
        ("value", 0.0),
        ("value", 1.0),
        ("pad", -0.0),
        ("pad", 2.0**-24),
        ("pad", np.nan),
        ("bits", 0x7FC00001),  # a NaN with a payload
        ("bits", 0xFF800000),  # -inf
        ("bits", 0x80000001),  # the smallest negative subnormal
        ("bits", 0x00000001),  # the smallest positive subnormal
    ]
)


@settings(max_examples=500, deadline=None)
@given(
    st.integers(1, 300),
    st.integers(0, 5),
    st.lists(st.tuples(damage, st.integers(0, 10**6)), max_size=3),
    st.integers(-2, 400),
    st.integers(0, 2**16),
)
def test_compiled_check_refuses_what_numpy_refuses(vocab, padding, damages, proposed, seed):
    entries = vocab + padding
    gen = np.random.default_rng(seed)
    counts = dyadic.counts_from_weights(gen.random(vocab) ** 4 + 1e-9)
    row = np.zeros(entries, dtype="<f4")
    row[:vocab] = dyadic.counts_to_fp32(counts)
    bits = row.view(np.uint32)
    for (where, value), at in damages:
        if where == "pad":
            if padding:
                row[vocab + at % padding] = value
        elif where == "bits":
            bits[at % vocab] = value
        else:
            row[at % vocab] = value
    if proposed >= 0 and proposed < vocab and gen.random() < 0.3:
        row[proposed] = 0.0  # a zero at the proposed token, perhaps with other damage
    got = outcome(row, vocab, entries, proposed, compiled=True)
    assert got == outcome(row, vocab, entries, proposed, compiled=False)
    assert got == _reference(row, vocab, entries, proposed)


def _reference(row: np.ndarray, vocab: int, entries: int, proposed: int):
    """§6.2 (dense) read literally, one rule after another, in exact integers."""
    if row.size != entries:
        return ErrorCode.ROW_LENGTH
    if not 0 <= proposed < vocab:
        return ErrorCode.PROPOSED_OUT_OF_RANGE
    body = row[:vocab]
    bits = body.view(np.uint32)
    if (~np.isfinite(body)).any():
        return ErrorCode.NON_FINITE
    if (bits >= 0x80000000).any():
        return ErrorCode.NEGATIVE
    if (body > 1).any():
        return ErrorCode.NON_DYADIC
    if row[vocab:].view(np.uint32).any():
        return ErrorCode.DENSE_PADDING_NONZERO
    scaled = body.astype(np.float64) * dyadic.M
    if (scaled != np.floor(scaled)).any():
        return ErrorCode.NON_DYADIC
    if int(scaled.astype(np.int64).sum()) != dyadic.M:
        return ErrorCode.MASS_MISMATCH
    if body[proposed] == 0:
        return ErrorCode.ZERO_Q_AT_PROPOSED
    return None


def test_a_valid_full_vocabulary_row_passes_and_its_counts_are_read_back():
    vocab = 129_280
    gen = np.random.default_rng(1)
    counts = dyadic.counts_from_weights(gen.random(vocab) ** 8)
    row = np.zeros(vocab + 128, dtype="<f4")
    row[:vocab] = dyadic.counts_to_fp32(counts)
    token = int(np.argmax(counts))
    validator = validate.DenseRowValidator(vocab, vocab + 128)
    validator.check(row, token)
    assert np.array_equal(validator.counts(), counts)
    row[vocab + 127] = -0.0
    with pytest.raises(ValidationError) as err:
        validator.check(row, token)
    assert err.value.code is ErrorCode.DENSE_PADDING_NONZERO


def test_the_compiled_check_reads_any_buffer_and_refuses_partial_values():
    q = dyadic.counts_to_fp32(dyadic.point_mass(8, 3))
    assert fastq.check_dense(q.tobytes(), 8, 3) == 0
    assert fastq.check_dense(memoryview(q.tobytes()), 8, 3) == 0
    assert fastq.check_dense(q.tobytes()[:-1], 8, 3) == int(ErrorCode.ROW_LENGTH)
    assert fastq.check_dense(q.tobytes(), 9, 3) == int(ErrorCode.ROW_LENGTH)
    assert fastq.check_dense(q.tobytes(), 8, 8) == int(ErrorCode.PROPOSED_OUT_OF_RANGE)
    assert fastq.check_dense(q.tobytes(), 8, 2) == int(ErrorCode.ZERO_Q_AT_PROPOSED)
