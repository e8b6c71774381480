"""The sharded kernels across gloo ranks equal single-process results at V = 129,280.

The ranks are threads of this process, each with its own gloo group over one
store (:func:`pp1wire.tp.coordinator.run_in_threads`): the same collectives as
separate processes, without starting any. Uneven splits; with three ranks the
middle one owns nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pp1wire.apps.models import ToyLM  # noqa: E402
from pp1wire.q import dyadic, verify  # noqa: E402
from pp1wire.q.layout import ShardLayout  # noqa: E402
from pp1wire.tp import dist_ops  # noqa: E402
from pp1wire.tp.coordinator import GroupCoordinator, run_in_threads  # noqa: E402

V = 129_280
U53 = 1 << 53


def _compare(coord: GroupCoordinator) -> list[str]:
    assert coord.layout is not None
    lo, hi = coord.layout.range(coord.rank)
    failures = []
    drafter, target = ToyLM(V, 5, draft=True), ToyLM(V, 5)

    def piece(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a[lo:hi].copy())

    for prefix in ([1, 2, 3], [9]):
        z = drafter.logits(prefix)
        want = dyadic.counts_from_logits(z, 0.9)
        got = dist_ops.counts_from_logits(piece(z), 0.9, coord)
        if not np.array_equal(got.numpy(), want[lo:hi]):
            failures.append("dense counts")
        ids, counts = dyadic.sparse_counts_from_logits(z, 1.0, 32)
        sids, scounts = dist_ops.sparse_counts_from_logits(piece(z), 1.0, 32, coord)
        if sids.tolist() != ids.tolist() or scounts.tolist() != counts.tolist():
            failures.append("sparse counts")
        for u24 in (0, 1, 12_345_678, (1 << 24) - 1):
            if dist_ops.sample(piece(want), u24, coord) != dyadic.sample(want, u24):
                failures.append(f"sample {u24}")
        raw = target.probs(prefix)
        p = verify.check_target(raw, V)
        if not np.array_equal(dist_ops.normalize_target(piece(raw), coord).numpy(), p[lo:hi]):
            failures.append("normalized target")
        for u53 in (0, 1, U53 // 3, U53 // 2, U53 - 1):
            one = verify.residual_sample(p, want, u53)
            shard = dist_ops.residual_sample(piece(p), piece(want), u53, coord)
            if one != shard:
                failures.append(f"residual {u53}: {shard} != {one}")
    return failures


@pytest.mark.parametrize("cuts", [(50_001,), (70_000, 70_000)], ids=["2 ranks", "3 ranks"])
def test_gloo_ranks_equal_single_process(cuts):
    layout = ShardLayout((0, *cuts, V))
    results = run_in_threads(layout.shards, _compare, layout=layout)
    for rank, result in enumerate(results):
        assert result == [], f"rank {rank}: {result}"


def test_a_kernel_refuses_a_piece_that_is_not_its_range():
    layout = ShardLayout.even(10, 2)

    def body(coord: GroupCoordinator) -> str:
        with pytest.raises(ValueError, match="range has 5"):
            dist_ops.sample(torch.zeros(4, dtype=torch.int64), 0, coord)
        return "ok"

    assert run_in_threads(2, body, layout=layout) == ["ok", "ok"]
