"""Check the torch kernels on a CUDA device against the numpy (CPU) results, and time them.

Run on a machine with a GPU: ``python benchmarks/gpu_check.py [--json FILE]``.
Without CUDA it checks the CPU build against numpy and says so.

What must agree bit for bit on any device: everything after the weights (a
probabilities drafter's position of rows built and drawn on the device,
``torch_ops.build_position``, dense and sparse; target normalization; the tree
draws), since those are IEEE additions, divisions and comparisons in a fixed
order. Rows from logits are built on the host only (a logits tensor is read
there first), so no device ``exp`` is checked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from extras import require

try:
    import torch
except ImportError:  # the tp extra
    require("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pp1wire.apps.models import ToyLM
from pp1wire.q import dyadic, torch_ops, verify
from pp1wire.q.proposal import build_row

V = 129_280
U53 = 1 << 53


def timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (CUDA-synchronized)."""
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    drafter, target = ToyLM(V, 3, draft=True), ToyLM(V, 3)
    exact = {"weights_counts": 0, "normalize": 0, "residual": 0, "bonus": 0, "sparse_weights": 0}
    specs = [(1.0, 0), (1.0, 32)]
    for row in range(args.rows):
        prefix = [row + 1, 2 * row + 3]
        probs = drafter.probs(prefix).astype(np.float32)
        u24 = 12_345 + row
        rows = torch.from_numpy(np.stack([probs, probs])).to(dev)
        dense, sparse = torch_ops.build_position(rows, specs, [u24, u24], None)
        counts, _ = build_row(probs, 1.0, None, kind="probs")
        sc, ids = build_row(probs, 1.0, 32, kind="probs")
        exact["weights_counts"] += int(
            np.array_equal(dense.counts, counts) and dense.token == dyadic.sample(counts, u24)
        )
        exact["sparse_weights"] += int(
            np.array_equal(sparse.ids, ids)
            and np.array_equal(sparse.counts, sc)
            and sparse.token == int(ids[dyadic.sample(sc, u24)])
        )
        raw = target.probs(prefix)
        p = verify.check_target(raw, V)
        gp = torch_ops.check_target(torch.from_numpy(raw).to(dev))
        exact["normalize"] += int(np.array_equal(gp.cpu().numpy(), p))
        agree_r = agree_b = 0
        for u in (0, 1, 12345, U53 // 3, U53 // 2, U53 - 1):
            tc = torch.from_numpy(counts).to(dev)
            agree_r += int(
                int(torch_ops.residual_sample(gp, tc, u)) == verify.residual_sample(p, counts, u)
            )
            agree_b += int(int(torch_ops.sample_weights(gp, u)) == verify.sample_weights(p, u))
        exact["residual"] += int(agree_r == 6)
        exact["bonus"] += int(agree_b == 6)
    report["rows"] = args.rows
    report["bit_equal_rows"] = exact
    # Timings on this device vs numpy on this machine's CPU (one row, median of reps).
    z = drafter.logits([1, 2, 3])
    probs = drafter.probs([1, 2, 3]).astype(np.float32)
    pos = torch.from_numpy(probs[None]).to(dev)
    p = verify.check_target(target.probs([1, 2, 3]), V)
    pt = torch.from_numpy(p).to(dev)
    c = dyadic.counts_from_logits(z)
    ct = torch.from_numpy(c).to(dev)
    reps = 30
    report["seconds_median"] = {
        "numpy_counts_from_logits": timed(lambda: dyadic.counts_from_logits(z), reps, False),
        "numpy_counts_from_probs": timed(lambda: dyadic.counts_from_fp32(probs), reps, False),
        "torch_position_from_probs": timed(
            lambda: torch_ops.build_position(pos, [(1.0, 0)], [12345], None), reps, cuda
        ),
        "numpy_residual_sample": timed(lambda: verify.residual_sample(p, c, U53 // 3), reps, False),
        "torch_residual_sample": timed(
            lambda: int(torch_ops.residual_sample(pt, ct, U53 // 3)), reps, cuda
        ),
        "numpy_sparse32": timed(lambda: dyadic.sparse_counts_from_fp32(probs, 32), reps, False),
        "torch_sparse32": timed(
            lambda: torch_ops.build_position(pos, [(1.0, 32)], [12345], None), reps, cuda
        ),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    ok = all(v == args.rows for v in exact.values())
    print("bit-equal after the weights:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
