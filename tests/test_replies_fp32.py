"""A row holding its FP32 wire values encodes to the same reply bytes as its counts."""

from __future__ import annotations

import numpy as np
import pytest

from pp1wire.errors import ProposalReleasedError
from pp1wire.q import dyadic
from pp1wire.q.proposal import Lease, QRow
from pp1wire.wire.replies import row_payload

V = 300


def _rows(rng):
    logits = rng.standard_normal(V) * 3
    dense = dyadic.counts_from_logits(logits).astype(np.int32)
    ids, counts = dyadic.sparse_counts_from_logits(logits, 1.0, 16)
    return dense, (ids, counts)


@pytest.mark.parametrize("shard", [None, (0, 100), (100, 300), (250, 251)])
@pytest.mark.parametrize("padding", [0, 5])
def test_fp32_rows_encode_as_their_counts(shard, padding):
    rng = np.random.default_rng(padding)
    dense, (ids, counts) = _rows(rng)
    entries = V + padding
    by_counts = QRow(token=1, counts=dense)
    wire = np.zeros(entries, dtype="<f4")
    wire[:V] = dyadic.counts_to_fp32(dense)
    for q32 in (wire, wire[:V], wire.copy()):
        for lease in (None, Lease()):
            row = QRow(token=1, q32=q32, lease=lease)
            want = bytes(row_payload(by_counts, entries, shard)[0])
            payload, n = row_payload(row, entries, shard)
            assert bytes(payload) == want
            assert n == row_payload(by_counts, entries, shard)[1]
            sent_as_is = np.shares_memory(np.frombuffer(payload, dtype="<f4"), q32)
            # Only an unshared row of the whole length travels without a copy.
            assert sent_as_is == (shard is None and lease is None and q32.size == entries)
    sparse_counts = QRow(token=int(ids[0]), counts=counts, ids=ids)
    sparse_fp32 = QRow(token=int(ids[0]), q32=dyadic.counts_to_fp32(counts), ids=ids)
    assert bytes(row_payload(sparse_fp32, entries, shard)[0]) == bytes(
        row_payload(sparse_counts, entries, shard)[0]
    )


def test_a_released_row_is_not_encoded():
    lease = Lease()
    row = QRow(token=0, q32=np.zeros(V, dtype="<f4"), lease=lease)
    lease.released = True
    with pytest.raises(ProposalReleasedError):
        row_payload(row, V)
