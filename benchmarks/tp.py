"""TP2 against TP1: the Spark side's round time and fan-out bytes, measured in one run.

Run from the repository root: ``python benchmarks/tp.py [--vocab V] [--reps N]
[--support dense|sparse:32 ...] [--json]``.

One ``pp1-worker`` on loopback (toy drafter, vocabulary 129,280 by default);
``pp1-spark`` with 4 slots at depth 5 (the 4 x 5 batch), dense and sparse:32,
alternately ``--tp 1`` and ``--tp 2`` (``--reps`` times each, median kept).
Both run the same seeds, so they commit the same tokens in the same rounds
(the TP acceptance test checks that); the ratio of their run times (rank 0's
``seconds``: requests only, not process start) is the ratio of their round
times. A batch round is 4 slot rounds; fan-out bytes per batch round are rank
0's ``tp_fanout_bytes`` over (rounds / 4): for dense, 4 x 5 rows of V FP32
values (4 x 5 x V x 4 B = 10,342,400 B at V = 129,280) plus 8 B per row for
its token and length. Goal: TP2 round <= 1.5 x TP1.

Every process runs with ``OMP_NUM_THREADS=1`` (what ``pp1-spark --tp`` and
torchrun give each rank), so TP1 is not slowed by idle OpenMP threads spinning
against the worker on a small machine, nor TP2 flattered by it.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import spark_runs
from extras import require

from pp1wire.apps.launch import worker_process


def spark(address: str, vocab: int, support: str, tp: int, requests: int) -> dict[str, Any]:
    """One pp1-spark run's --json summary."""
    return spark_runs.summary(
        address, vocab,
        "--requests", str(requests), "--concurrency", "4", "--max-tokens", "24",
        "--depth", "5", "--support", support, "--tp", str(tp),
        what=f"--tp {tp}",
    )  # fmt: skip


def main() -> None:
    """Measure and print the figures."""
    require("torch")
    p = spark_runs.parser(__doc__)
    p.add_argument("--requests", type=int, default=8)
    args = p.parse_args()
    supports = args.support or ["dense", "sparse:32"]
    out: dict[str, Any] = {"vocab": args.vocab}
    with worker_process(vocab=args.vocab, seed=0) as worker:
        for support in supports:
            runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
            for _ in range(args.reps):
                for tp in (1, 2):
                    runs[tp].append(spark(worker.address, args.vocab, support, tp, args.requests))
            one, two = runs[1][0], runs[2][0]
            if (one["tokens"], one["rounds"]) != (two["tokens"], two["rounds"]):
                sys.exit(f"{support}: TP1 and TP2 did different work: {one} vs {two}")
            batch_rounds = two["rounds"] / 4
            t1 = [r["seconds"] for r in runs[1]]
            t2 = [r["seconds"] for r in runs[2]]
            key = support.replace(":", "")
            out[key] = {
                "tp1_round_ms": statistics.median(t1) / batch_rounds * 1e3,
                "tp2_round_ms": statistics.median(t2) / batch_rounds * 1e3,
                **spark_runs.ratio("tp2_vs_tp1", t1, t2),
                "fanout_bytes_per_batch_round": two["tp_fanout_bytes"] / batch_rounds,
                "fanout_ms_per_batch_round": two["tp_fanout_seconds"] / batch_rounds * 1e3,
                "batch_rounds": batch_rounds,
                "rounds_per_attempt": two["tp_rounds_per_attempt"],
            }
    for key, r in spark_runs.table(out, args, supports):
        print(
            f"{key:9s} TP1 {r['tp1_round_ms']:7.2f} ms/round  TP2 {r['tp2_round_ms']:7.2f} "
            f"ms/round  TP2/TP1 {r['tp2_vs_tp1']:.2f} (range {r['tp2_vs_tp1_min_max'][0]:.2f}"
            f"-{r['tp2_vs_tp1_min_max'][1]:.2f})  fan-out "
            f"{r['fanout_bytes_per_batch_round']:,.0f} B / {r['fanout_ms_per_batch_round']:.2f} "
            f"ms per batch round; {r['rounds_per_attempt']:.2f} rounds per attempt"
        )


if __name__ == "__main__":
    main()
