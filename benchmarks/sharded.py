"""Vocabulary-sharded TP2 against unsharded TP2: round time and bytes per link, in one run.

Run from the repository root: ``python benchmarks/sharded.py [--vocab V] [--reps N]
[--support dense|sparse:32 ...] [--max-tokens N] [--json]``.

Unsharded TP2: one ``pp1-worker`` and ``pp1-spark --tp 2`` (rank 0 holds the
one link and fans each proposal out to rank 1). Sharded TP2: ``pp1-worker --tp 2
--vocab-shards 2`` and ``pp1-spark --tp 2 --vocab-shards 2`` (two links, each
carrying its half of every q row; the ranks decide with collectives). Both
run the 4 x 5 batch (4 slots at depth 5, one wave of 4 requests) at the same
seeds, so they commit the same tokens in the same rounds (checked); runs
alternate, ``--reps`` each, median and min-max kept. A batch round is 4 slot
rounds; its time is rank 0's ``seconds`` over (rounds / 4). Bytes per link are
the worker's ``pp1_worker_reply_bytes_total`` per batch round: the one link of
the unsharded pipeline, each rank's link of the sharded one. The ideal for
dense q at V = 129,280 is half the bytes per link (4 x 5 x 64,640 x 4 B =
5,171,200 B of q per link and batch round).

Every process runs with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import spark_runs

from pp1wire.apps.launch import worker_group, worker_process
from pp1wire.apps.metrics import scrape


def spark(address: str, vocab: int, support: str, sharded: bool, max_tokens: int) -> dict[str, Any]:
    """One pp1-spark run's --json summary."""
    extra = ["--vocab-shards", "2"] if sharded else []
    return spark_runs.summary(
        address, vocab,
        "--requests", "4", "--concurrency", "4", "--max-tokens", str(max_tokens),
        "--depth", "5", "--support", support, "--tp", "2", *extra,
        what=f"sharded={sharded}",
    )  # fmt: skip


def main() -> None:
    """Measure and print the figures."""
    p = spark_runs.parser(__doc__)
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per request (default 24)")
    args = p.parse_args()
    supports = args.support or ["dense", "sparse:32"]
    out: dict[str, Any] = {"vocab": args.vocab}
    with (
        worker_process("--metrics-port", "0", vocab=args.vocab, seed=0) as single,
        worker_group(vocab=args.vocab, seed=0) as group,
    ):
        assert single.metrics is not None
        links = {False: [single.metrics], True: group.metrics}
        for support in supports:
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            sent: dict[bool, list[list[float]]] = {False: [], True: []}
            for _ in range(args.reps):
                for sharded in (False, True):
                    before = [scrape(m, "pp1_worker_reply_bytes_total") for m in links[sharded]]
                    address = group.address if sharded else single.address
                    runs[sharded].append(
                        spark(address, args.vocab, support, sharded, args.max_tokens)
                    )
                    after = [scrape(m, "pp1_worker_reply_bytes_total") for m in links[sharded]]
                    sent[sharded].append([a - b for a, b in zip(after, before, strict=True)])
            plain, split = runs[False][0], runs[True][0]
            if (plain["tokens"], plain["rounds"]) != (split["tokens"], split["rounds"]):
                sys.exit(f"{support}: the pipelines did different work: {plain} vs {split}")
            batch_rounds = split["rounds"] / 4
            t1 = [r["seconds"] for r in runs[False]]
            t2 = [r["seconds"] for r in runs[True]]
            key = support.replace(":", "")
            out[key] = {
                "unsharded_round_ms": statistics.median(t1) / batch_rounds * 1e3,
                "sharded_round_ms": statistics.median(t2) / batch_rounds * 1e3,
                **spark_runs.ratio("sharded_vs_unsharded", t1, t2),
                "unsharded_link_bytes_per_batch_round": sent[False][0][0] / batch_rounds,
                "sharded_link_bytes_per_batch_round": [b / batch_rounds for b in sent[True][0]],
                "batch_rounds": batch_rounds,
                "fallbacks": split["fallbacks"],
            }
    for key, r in spark_runs.table(out, args, supports):
        lo, hi = r["sharded_vs_unsharded_min_max"]
        per_link = " / ".join(f"{b:,.0f}" for b in r["sharded_link_bytes_per_batch_round"])
        print(
            f"{key:9s} unsharded TP2 {r['unsharded_round_ms']:8.2f} ms/round  sharded TP2 "
            f"{r['sharded_round_ms']:8.2f} ms/round  sharded/unsharded "
            f"{r['sharded_vs_unsharded']:.2f} (range {lo:.2f}-{hi:.2f})  bytes per link and "
            f"batch round: {r['unsharded_link_bytes_per_batch_round']:,.0f} unsharded, "
            f"{per_link} sharded"
        )


if __name__ == "__main__":
    main()
