"""Sharded vs unsharded q construction and residual draw at V = 129,280, 2 shards.

    python benchmarks/sharding.py [--reps N] [--json]

numpy: the unsharded kernels (``pp1wire.q.dyadic`` / ``verify``) against the
two-shard emulator (``pp1wire.q.sharding``), interleaved in one process.
torch (CPU): ``pp1wire.tp.dist_ops`` on two gloo ranks started with torchrun
against the unsharded kernels in this process: numpy's q construction (what
each rank runs on its range) and ``pp1wire.q.torch_ops``' residual draw (the
ranks share this machine's cores, so the ratio includes that contention and
every collective). Medians over ``--reps`` calls; ratios are sharded /
unsharded measured in this same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extras import require
from micro import _trial

from pp1wire.apps.models import ToyLM
from pp1wire.q import dyadic, sharding, verify

V = 129_280
CUT = 64_640
U53 = 1 << 53


def inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z = ToyLM(V, 4, draft=True).logits([1, 2, 3])
    p = verify.check_target(ToyLM(V, 4).probs([1, 2, 3]), V)
    return z, p, dyadic.counts_from_logits(z)


def numpy_part(reps: int) -> dict[str, float]:
    z, p, c = inputs()
    zs, ps, cs = [z[:CUT], z[CUT:]], [p[:CUT], p[CUT:]], [c[:CUT], c[CUT:]]
    out: dict[str, list[float]] = {k: [] for k in ("construct", "construct_2", "resid", "resid_2")}
    for _ in range(3):  # interleaved rounds: drift hits both alike
        out["construct"].append(_trial(lambda: dyadic.counts_from_logits(z), reps))
        out["construct_2"].append(_trial(lambda: sharding.counts_from_logits(zs), reps))
        out["resid"].append(_trial(lambda: verify.residual_sample(p, c, U53 // 3), reps))
        out["resid_2"].append(_trial(lambda: sharding.residual_sample(ps, cs, U53 // 3), reps))
    return {k: statistics.median(v) for k, v in out.items()}


def torch_unsharded(reps: int) -> dict[str, float]:
    import torch

    from pp1wire.q import torch_ops

    z, p, c = inputs()
    pt, ct = torch.from_numpy(p), torch.from_numpy(c)
    return {
        # The ranks build q with numpy (the collectives are gloo's): the unsharded
        # numpy kernel is the baseline.
        "construct": _trial(lambda: dyadic.counts_from_logits(z), reps),
        "resid": _trial(lambda: int(torch_ops.residual_sample(pt, ct, U53 // 3)), reps),
    }


def rank_worker(reps: int) -> None:
    import torch

    from pp1wire.q.layout import ShardLayout
    from pp1wire.tp import dist_ops
    from pp1wire.tp.coordinator import GroupCoordinator

    coord = GroupCoordinator.join(60.0, ShardLayout((0, CUT, V)))
    rank = coord.rank
    z, p, c = inputs()
    lo, hi = (0, CUT) if rank == 0 else (CUT, V)
    zt, pt, ct = (torch.from_numpy(a[lo:hi].copy()) for a in (z, p, c))

    def synced(fn):
        def run():
            fn()
            coord.everyone(True)

        return run

    result = {
        "construct_2": _trial(synced(lambda: dist_ops.counts_from_logits(zt, 1.0, coord)), reps),
        "resid_2": _trial(synced(lambda: dist_ops.residual_sample(pt, ct, U53 // 3, coord)), reps),
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
    coord.leave()


def main() -> int:
    require("torch")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(args.reps)
        return 0
    res: dict[str, object] = {"vocab": V, "shards": 2}
    npart = numpy_part(args.reps)
    res["numpy_ms"] = {k: v * 1e3 for k, v in npart.items()}
    res["numpy_construct_sharded_vs_unsharded"] = npart["construct_2"] / npart["construct"]
    res["numpy_residual_sharded_vs_unsharded"] = npart["resid_2"] / npart["resid"]
    try:
        import torch  # noqa: F401
    except ImportError:
        res["torch"] = "not installed (pip install -e '.[tp]')"
    else:
        before = torch_unsharded(args.reps)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                __file__,
                "--rank-worker",
                "--reps",
                str(args.reps),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        after = torch_unsharded(args.reps)
        unsharded = {k: (before[k] + after[k]) / 2 for k in before}
        ranks = json.loads(done.stdout.strip().splitlines()[-1])
        res["torch_ms"] = {
            **{k: v * 1e3 for k, v in unsharded.items()},
            **{k: v * 1e3 for k, v in ranks.items()},
        }
        res["torch_construct_sharded_vs_unsharded"] = ranks["construct_2"] / unsharded["construct"]
        res["torch_residual_sharded_vs_unsharded"] = ranks["resid_2"] / unsharded["resid"]
    if args.json:
        print(json.dumps(res))
    else:
        for key, value in res.items():
            print(f"{key:42s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
