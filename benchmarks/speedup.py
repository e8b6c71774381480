"""What speculative decoding is for: tokens per second against target-only decoding.

Run from the repository root: ``python benchmarks/speedup.py [--requests N] [--max-tokens N]``.

Starts ``pp1-worker`` with a drafter that costs 0.5 ms per call and runs
``pp1-spark`` with a target that costs 5 ms per call (``benchmarks/paced.py``),
vocabulary 32,000, 8 concurrent requests: once at depth 5 (dense q) and once
target-only (``--depth 0``), in the same run. Prints both rates, their ratio,
and the ratio the measured acceptance would give an engine that scores a
round in one batched target call: mean tokens per round (accepted + 1) for
one target call, against one token per call target-only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from pp1wire.apps.launch import spark_command, worker_process

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 32_000


def spark(address: str, depth: int, args: argparse.Namespace) -> dict[str, float]:
    """One pp1-spark run's --json summary."""
    cmd = spark_command(
        address,
        "--target", "benchmarks.paced:target_factory",
        "--requests", str(args.requests), "--concurrency", str(args.requests),
        "--max-tokens", str(args.max_tokens), "--depth", str(depth), "--json",
        vocab=VOCAB,
    )  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    summary: dict[str, float] = json.loads(done.stdout)
    return summary


def main() -> None:
    """Run both modes and print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    os.chdir(ROOT)  # the plugins are imported as benchmarks.paced by both daemons
    with worker_process(
        "--drafter", "benchmarks.paced:drafter_factory", "--max-slots", str(args.requests),
        vocab=VOCAB, seed=0,  # the drafter perturbs the target of the same seed
    ) as worker:  # fmt: skip
        spec = spark(worker.address, 5, args)
        plain = spark(worker.address, 0, args)
    rounds = spec["rounds"]
    tokens_per_round = spec["tokens"] / rounds if rounds else 0.0
    measured = spec["tokens_per_second"] / plain["tokens_per_second"]
    print(f"vocab {VOCAB}, {args.requests} requests x {args.max_tokens} tokens, depth 5, dense")
    print(f"speculative:  {spec['tokens_per_second']:8.1f} tokens/s "
          f"(acceptance {spec['acceptance_rate']:.2f}, mean accepted length "
          f"{spec['mean_accepted_length']:.2f}, fallbacks {spec['fallbacks']})")  # fmt: skip
    print(f"target-only:  {plain['tokens_per_second']:8.1f} tokens/s")
    print(f"speedup measured {measured:.2f}; one batched target call per round would give "
          f"{tokens_per_round:.2f} tokens per target call")  # fmt: skip


if __name__ == "__main__":
    main()
