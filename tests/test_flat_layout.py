"""The engine-layout helpers of the embeddable client, checked by value."""

from __future__ import annotations

import numpy as np
import pytest

from pp1wire.aio.handles import flatten_drafts, pack_outputs, target_rows
from pp1wire.q.proposal import Proposal, QRow


def _proposal(tokens: list[int]) -> Proposal:
    rows = tuple(QRow(token=t, q32=np.zeros(4, dtype=np.float32)) for t in tokens)
    return Proposal(
        session=1, generation=0, round_id=0, position=3, digest=0, depth=len(tokens), rows=rows
    )


def test_flatten_drafts_concatenates_in_request_order():
    ids, counts = flatten_drafts([_proposal([5, 6, 7]), None, _proposal([9])])
    assert ids.dtype == np.int32
    assert ids.tolist() == [5, 6, 7, 9]
    assert counts.tolist() == [3, 0, 1]
    empty_ids, empty_counts = flatten_drafts([])
    assert empty_ids.tolist() == []
    assert empty_counts.tolist() == []


def test_pack_outputs_pads_with_minus_one():
    out = pack_outputs([[1, 2], [], [3, 4, 5, 6]], max_depth=3)
    assert out.dtype == np.int32
    assert out.tolist() == [[1, 2, -1, -1], [-1, -1, -1, -1], [3, 4, 5, 6]]
    with pytest.raises(ValueError, match="5 tokens"):
        pack_outputs([[1, 2, 3, 4, 5]], max_depth=3)


def test_target_rows_splits_drafts_plus_bonus_per_request():
    counts = np.array([2, 0, 1], dtype=np.int32)
    probs = np.arange(6 * 2, dtype=np.float64).reshape(6, 2)  # 3 drafts + 3 bonus rows
    blocks = target_rows(probs, counts)
    assert [b.shape[0] for b in blocks] == [3, 1, 2]
    assert blocks[0].tolist() == probs[0:3].tolist()
    assert blocks[1].tolist() == probs[3:4].tolist()
    assert blocks[2].tolist() == probs[4:6].tolist()
    assert np.shares_memory(blocks[0], probs)  # views, no copy
    with pytest.raises(ValueError, match="expected 6"):
        target_rows(probs[:5], counts)


def test_engine_tensors_go_in_without_a_copy():
    torch = pytest.importorskip("torch")
    from pp1wire.apps.models import ToyLM
    from pp1wire.q.arrays import host_array
    from pp1wire.q.verify import RequestVerifier, check_target

    counts = torch.tensor([2, 0, 1], dtype=torch.int32)
    probs = torch.arange(12, dtype=torch.float64).reshape(6, 2)
    blocks = target_rows(probs, counts)
    assert all(isinstance(b, torch.Tensor) for b in blocks)
    assert blocks[2].data_ptr() == probs[4].data_ptr()  # a view of the engine's tensor
    row = torch.rand(16, dtype=torch.float64)
    assert np.shares_memory(host_array(row), row.numpy())
    assert check_target(row, 16).tolist() == check_target(row.numpy(), 16).tolist()
    assert pack_outputs([torch.tensor([3, 4])], max_depth=2).tolist() == [[3, 4, -1]]

    # A verifier whose target returns tensors commits exactly what the numpy target does.
    lm = ToyLM(16, 2)
    runs = []
    for target in (lm.probs, lambda prefix: torch.from_numpy(lm.probs(prefix))):
        v = RequestVerifier(session=1, seed=9, vocab_size=16, prefix=[1], target=target)
        for r in range(5):
            v.decode_target_only(r)
        runs.append(list(v.committed))
    assert runs[0] == runs[1]
