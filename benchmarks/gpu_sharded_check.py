"""The vocabulary-sharded kernels on NCCL against the same kernels on gloo: bit-equality and cost.

Run: ``python benchmarks/gpu_sharded_check.py [--vocab V] [--rows N] [--reps N] [--json]``.

A sharded group's collectives carry small words (flags, maxima, cover totals,
histograms, drawn IDs). A group whose ranks all have CUDA may carry them on
its NCCL device group (``GroupCoordinator.join(..., device=True)``: the ranks
agree in one all-reduce; a CUDA tensor then travels on NCCL, a host tensor
always on gloo, ``docs/tp.md`` §11). This script starts one rank per CUDA
device (at most 2; one device runs one rank, which still takes every step of
the NCCL path: the copies to and from the device and the collectives), and on
each rank runs the batched kernels of ``pp1wire.tp.dist_ops`` on the same
inputs twice — through a coordinator on the rank's gloo group, and through the
one on its NCCL group —

* the proposal construction and draw of a position (dense and sparse rows of
  logits and of probabilities, greedy rows) and
* the target normalization and the draws from weights and from counts,

and checks that both give the same results bit for bit (tokens, counts at the
tokens, every rank's piece of q, refusal codes, canonical totals). Then it
times a dense and a sparse position on each (milliseconds of wall and of the
rank's CPU per position). Without CUDA it prints one line saying it skipped
and exits 0; otherwise it exits 0 only if every rank was bit-equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from extras import require

try:
    import torch
except ImportError:  # the tp extra
    require("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pp1wire.apps.models import ToyLM
from pp1wire.apps.ranks import rank_environments
from pp1wire.errors import Pp1Error
from pp1wire.q import dyadic
from pp1wire.q.layout import ShardLayout
from pp1wire.tp import dist_ops
from pp1wire.tp.coordinator import GroupCoordinator
from pp1wire.tp.dist_ops import BuiltRow, RowSpec


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def _built(got: list[BuiltRow | Pp1Error]) -> list[Any]:
    out: list[Any] = []
    for g in got:
        if isinstance(g, Pp1Error):
            out.append(g.code.name)
        else:
            ids = None if g.ids is None else _digest(g.ids)
            out.append([g.token, g.count, _digest(np.asarray(g.counts, np.int64)), ids])
    return out


def _inputs(vocab: int, rows: int) -> dict[str, Any]:
    drafter, target = ToyLM(vocab, 5, draft=True), ToyLM(vocab, 5)
    prefixes = [[1, 2, 3 + i] for i in range(rows)]
    logits = drafter.logits_batch(prefixes)
    return {
        "logits": logits,
        "probs": drafter.probs_batch(prefixes).astype(np.float32),
        "target": target.probs_batch(prefixes),
    }


def _position(x: np.ndarray, specs: list[RowSpec], coord: GroupCoordinator, probs: bool) -> Any:
    return _built(dist_ops.construct_rows(x, specs, coord, probs=probs))


def _results(data: dict[str, Any], coord: GroupCoordinator) -> dict[str, Any]:
    """Every kernel's results on this rank through ``coord``."""
    assert coord.layout is not None
    lo, hi = coord.layout.range(coord.rank)
    rows = data["logits"].shape[0]
    u24 = [(7_654_321 * (i + 1)) % (1 << 24) if coord.rank == 0 else 0 for i in range(rows)]
    out: dict[str, Any] = {}
    for name, key, probs, shape in (
        ("dense logits", "logits", False, (0.9, 0)),
        ("sparse logits", "logits", False, (1.0, 32)),
        ("greedy logits", "logits", False, (0.0, 0)),
        ("dense probs", "probs", True, (1.0, 0)),
        ("sparse probs", "probs", True, (1.0, 32)),
    ):
        specs = [RowSpec(shape[0], shape[1], u) for u in u24]
        x = np.ascontiguousarray(data[key][:, lo:hi])
        out[name] = _position(x, specs, coord, probs)
    p = dist_ops.normalize_targets(np.ascontiguousarray(data["target"][:, lo:hi]), coord)
    out["target codes"] = [None if c is None else c.name for c in p.codes]
    out["target totals"] = _digest(p.totals)
    weights = np.stack([p.normalized(i) for i in range(rows)])
    draws = [(1 << 52) // (i + 2) for i in range(rows)]
    out["draws from p"] = [str(v) for v in dist_ops.sample_weights_rows(weights, draws, coord)]
    # Every rank allocates the same global counts from the same rows and takes its piece.
    counts = np.stack([dyadic.counts_from_weights(row) for row in data["target"]])
    u24s = [(7_654_321 * (i + 1)) % dyadic.M for i in range(rows)]
    piece = np.ascontiguousarray(counts[:, lo:hi])
    out["draws from counts"] = [str(v) for v in dist_ops.sample_counts(piece, u24s, coord)]
    return out


def _timed(data: dict[str, Any], coord: GroupCoordinator, reps: int) -> dict[str, float]:
    assert coord.layout is not None
    lo, hi = coord.layout.range(coord.rank)
    x = np.ascontiguousarray(data["logits"][:, lo:hi])
    out = {}
    for name, support in (("dense", 0), ("sparse:32", 32)):
        specs = [RowSpec(1.0, support, 5 if coord.rank == 0 else 0)] * x.shape[0]
        dist_ops.construct_rows(x, specs, coord)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(reps):
            dist_ops.construct_rows(x, specs, coord)
        out[f"{name} wall ms"] = (time.perf_counter() - wall) / reps * 1e3
        out[f"{name} cpu ms"] = (time.process_time() - cpu) / reps * 1e3
    return out


def rank_main(args: argparse.Namespace) -> int:
    """One rank: join (NCCL device group when every rank has CUDA), compare, time."""
    world = int(os.environ["WORLD_SIZE"])
    layout = ShardLayout.even(args.vocab, world)
    nccl = GroupCoordinator.join(120.0, layout, device=True)
    gloo = GroupCoordinator(
        nccl.group, rank=nccl.rank, world=world, timeout=120.0, layout=layout
    )
    data = _inputs(args.vocab, args.rows)
    report: dict[str, Any] = {"rank": nccl.rank, "device": str(nccl.device)}
    if nccl.device.type != "cuda":
        report["error"] = "the ranks did not all have CUDA: no NCCL device group"
        print(json.dumps(report), flush=True)
        return 1
    on_gloo, on_nccl = _results(data, gloo), _results(data, nccl)
    report["bit_equal"] = on_gloo == on_nccl
    report["differ"] = [k for k in on_gloo if on_gloo[k] != on_nccl.get(k)]
    report["gloo"] = _timed(data, gloo, args.reps)
    report["nccl"] = _timed(data, nccl, args.reps)
    print(json.dumps(report), flush=True)
    nccl.leave()
    return 0 if report["bit_equal"] else 1


def main() -> int:
    """Start the ranks (or skip without CUDA) and print what they found."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--rows", type=int, default=4, help="rows per position (default 4)")
    p.add_argument("--reps", type=int, default=20, help="timed positions per path (default 20)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_process:
        return rank_main(args)
    if not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        print("gpu_sharded_check: skipped: no CUDA device (the NCCL path needs one per rank)")
        return 0
    world = min(2, torch.cuda.device_count())
    procs = []
    for env in rank_environments(world):
        argv = [sys.executable, __file__, "--rank-process", *sys.argv[1:]]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    reports = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=540)
        finally:
            proc.kill()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        reports.append(json.loads(lines[-1]) if lines else {"error": f"exit {proc.returncode}"})
    ok = all(r.get("bit_equal") for r in reports)
    summary = {"ranks": world, "vocab": args.vocab, "bit_equal": ok, "reports": reports}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{world} rank(s), one CUDA device each, vocab {args.vocab}: NCCL vs gloo "
              f"bit-equal on every rank: {ok}")
        for r in reports:
            if "error" in r:
                print(f"  rank {r.get('rank', '?')}: {r['error']}")
                continue
            figures = "  ".join(
                f"{path} {k} {v:.2f}" for path in ("gloo", "nccl") for k, v in r[path].items()
            )
            print(f"  rank {r['rank']} ({r['device']}): differ {r['differ']}  {figures}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
