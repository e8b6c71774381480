"""Run under torchrun: every rank checks the sharded kernels against single-process results.

Each rank owns a contiguous piece of the vocabulary (uneven sizes, and with
three ranks an empty middle shard), computes the distributed kernels on it,
and compares with the unsharded numpy kernels that it also computes on the
whole vector. Exit code 0 only if everything agrees on this rank.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

from pp1wire.apps.models import ToyLM
from pp1wire.q import dist_ops, dyadic, verify

V = 129_280
U53 = 1 << 53


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Uneven splits; with 3 ranks the middle one owns nothing.
    cuts = {2: [50_001], 3: [70_000, 70_000]}[world]
    edges = [0, *cuts, V]
    lo, hi = edges[rank], edges[rank + 1]
    failures = []
    drafter, target = ToyLM(V, 5, draft=True), ToyLM(V, 5)
    for prefix in ([1, 2, 3], [9]):
        z = drafter.logits(prefix)
        want = dyadic.counts_from_logits(z, 0.9)
        got = dist_ops.counts_from_logits(torch.from_numpy(z[lo:hi].copy()), 0.9)
        if not np.array_equal(got.numpy(), want[lo:hi]):
            failures.append("dense counts")
        ids, counts = dyadic.sparse_counts_from_logits(z, 1.0, 32)
        sids, scounts = dist_ops.sparse_counts_from_logits(
            torch.from_numpy(z[lo:hi].copy()), 1.0, 32
        )
        if sids.tolist() != ids.tolist() or scounts.tolist() != counts.tolist():
            failures.append("sparse counts")
        for u24 in (0, 1, 12_345_678, (1 << 24) - 1):
            if dist_ops.sample(torch.from_numpy(want[lo:hi].copy()), u24) != dyadic.sample(
                want, u24
            ):
                failures.append(f"sample {u24}")
        raw = target.probs(prefix)
        p = verify.check_target(raw, V)
        got_p = dist_ops.normalize_target(torch.from_numpy(raw[lo:hi].copy()))
        if not np.array_equal(got_p.numpy(), p[lo:hi]):
            failures.append("normalized target")
        for u53 in (0, 1, U53 // 3, U53 // 2, U53 - 1):
            one = verify.residual_sample(p, want, u53)
            shard = dist_ops.residual_sample(
                torch.from_numpy(p[lo:hi].copy()), torch.from_numpy(want[lo:hi].copy()), u53
            )
            if one != shard:
                failures.append(f"residual {u53}: {shard} != {one}")
    dist.destroy_process_group()
    for f in failures:
        print(f"rank {rank}: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
