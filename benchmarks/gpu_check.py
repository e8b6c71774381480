"""Check the torch kernels on a CUDA device against the numpy (CPU) results, and time them.

Run on a machine with a GPU: ``python benchmarks/gpu_check.py [--json FILE]``.
Without CUDA it checks the CPU build against numpy and says so.

What must agree bit for bit on any device: everything after the weights
(allocation from given weights, target normalization, the tree draws), since
those are IEEE additions, divisions and comparisons in a fixed order. What may
differ: ``exp`` in construction from logits (the device's own), so that case
reports how many counts differ and whether the drawn tokens still agree.
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
    logits_diff_entries = []
    logits_token_agree = 0
    draws = 0
    for row in range(args.rows):
        prefix = [row + 1, 2 * row + 3]
        z = drafter.logits(prefix)
        w = dyadic.weights_from_logits(z, 0.9)
        counts = dyadic.counts_from_weights(w)
        got = torch_ops.counts_from_weights(torch.from_numpy(w).to(dev)).cpu().numpy()
        exact["weights_counts"] += int(np.array_equal(got, counts))
        ids, sc = dyadic.sparse_counts_from_weights(w, 32)
        gi, gc = torch_ops.sparse_counts_from_weights(torch.from_numpy(w).to(dev), 32)
        exact["sparse_weights"] += int(gi.tolist() == ids.tolist() and gc.tolist() == sc.tolist())
        from_logits = torch_ops.counts_from_logits(torch.from_numpy(z).to(dev), 0.9).cpu().numpy()
        want_logits = dyadic.counts_from_logits(z, 0.9)
        logits_diff_entries.append(int((from_logits != want_logits).sum()))
        raw = target.probs(prefix)
        p = verify.check_target(raw, V)
        gp = torch_ops.check_target(torch.from_numpy(raw).to(dev))
        exact["normalize"] += int(np.array_equal(gp.cpu().numpy(), p))
        agree_r = agree_b = 0
        for u in (0, 1, 12345, U53 // 3, U53 // 2, U53 - 1):
            draws += 1
            tc = torch.from_numpy(counts).to(dev)
            agree_r += int(
                int(torch_ops.residual_sample(gp, tc, u)) == verify.residual_sample(p, counts, u)
            )
            agree_b += int(int(torch_ops.sample_weights(gp, u)) == verify.sample_weights(p, u))
            logits_token_agree += int(
                dyadic.sample(from_logits, u >> 29) == dyadic.sample(want_logits, u >> 29)
            )
        exact["residual"] += int(agree_r == 6)
        exact["bonus"] += int(agree_b == 6)
    report["rows"] = args.rows
    report["bit_equal_rows"] = exact
    report["logits_counts_entries_differing_per_row"] = logits_diff_entries
    report["logits_proposal_draws_agreeing"] = f"{logits_token_agree}/{draws}"
    # Timings on this device vs numpy on this machine's CPU (one row, median of reps).
    z = drafter.logits([1, 2, 3])
    zt = torch.from_numpy(z).to(dev)
    p = verify.check_target(target.probs([1, 2, 3]), V)
    pt = torch.from_numpy(p).to(dev)
    c = dyadic.counts_from_logits(z)
    ct = torch.from_numpy(c).to(dev)
    reps = 30
    report["seconds_median"] = {
        "numpy_counts_from_logits": timed(lambda: dyadic.counts_from_logits(z), reps, False),
        "torch_counts_from_logits": timed(lambda: torch_ops.counts_from_logits(zt), reps, cuda),
        "numpy_residual_sample": timed(lambda: verify.residual_sample(p, c, U53 // 3), reps, False),
        "torch_residual_sample": timed(
            lambda: int(torch_ops.residual_sample(pt, ct, U53 // 3)), reps, cuda
        ),
        "numpy_sparse32": timed(lambda: dyadic.sparse_counts_from_logits(z, 1.0, 32), reps, False),
        "torch_sparse32": timed(
            lambda: torch_ops.sparse_counts_from_logits(zt, 1.0, 32), reps, cuda
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
