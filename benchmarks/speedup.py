"""What speculative decoding is for: tokens per second against the ideal and against target-only.

Run from the repository root: ``python benchmarks/speedup.py [--requests N] [--max-tokens N]
[--json]``.

Starts ``pp1-worker`` with a drafter that costs t_d = 0.5 ms per call and runs
``pp1-spark`` with a target that costs t_t = 5 ms per call, a batch of prefixes
being one call (``benchmarks/paced.py``: each call sleeps to a fixed deadline,
the toy arithmetic inside it, so the plugins cost exactly their fixed time and
release the GIL as a GPU call does); vocabulary 32,000, S = 8 concurrent
requests, depth d = 5: dense q, sparse:32 q, and target-only (``--depth 0``),
in the same run.

Ideal (an engine with these plugin costs and nothing else): a round drafts d
positions for every slot at once (d·t_d) and scores every slot's drafts and
bonus in one target call (t_t), committing S·(L + 1) tokens, L being the
*measured* mean accepted length; so ideal tokens/s = S·(L + 1) / (d·t_d + t_t),
and target-only ideal = S / t_t. ``e2e_vs_ideal`` = measured / ideal (goal
>= 0.9); ``speedup`` = speculative tokens/s / target-only tokens/s, measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from pp1wire.apps.launch import spark_command, worker_process

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 32_000
DEPTH = 5
T_DRAFT = 0.5e-3
T_TARGET = 5e-3


def spark(address: str, depth: int, support: str, requests: int, tokens: int) -> dict[str, Any]:
    """One pp1-spark run's --json summary."""
    cmd = spark_command(
        address,
        "--target", "benchmarks.paced:target_factory",
        "--requests", str(requests), "--concurrency", str(requests),
        "--max-tokens", str(tokens), "--depth", str(depth), "--support", support, "--json",
        vocab=VOCAB,
    )  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True, cwd=ROOT)
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def measure(requests: int, tokens: int) -> dict[str, Any]:
    """Run the three modes; returns the figures (``*_vs_ideal``, ``speedup_*``, rates)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the plugins: benchmarks.paced
    with worker_process(
        "--drafter", "benchmarks.paced:drafter_factory", "--max-slots", str(requests),
        vocab=VOCAB, seed=0, env=env,  # the drafter perturbs the target of the same seed
    ) as worker:  # fmt: skip
        runs = {
            "dense": spark(worker.address, DEPTH, "dense", requests, tokens),
            "sparse32": spark(worker.address, DEPTH, "sparse:32", requests, tokens),
            "target_only": spark(worker.address, 0, "dense", requests, tokens),
        }
    plain = runs["target_only"]["tokens_per_second"]
    out: dict[str, Any] = {
        "target_only_tokens_per_second": plain,
        "target_only_vs_ideal": plain / (requests / T_TARGET),
    }
    for key in ("dense", "sparse32"):
        r = runs[key]
        ideal = requests * (r["mean_accepted_length"] + 1) / (DEPTH * T_DRAFT + T_TARGET)
        out[f"{key}_tokens_per_second"] = r["tokens_per_second"]
        out[f"{key}_ideal_tokens_per_second"] = ideal
        out[f"e2e_vs_ideal_{key}"] = r["tokens_per_second"] / ideal
        out[f"speedup_{key}"] = r["tokens_per_second"] / plain
        out[f"{key}_mean_accepted_length"] = r["mean_accepted_length"]
        out[f"{key}_acceptance_rate"] = r["acceptance_rate"]
    return out


def main() -> None:
    """Measure and print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = measure(args.requests, args.max_tokens)
    if args.json:
        print(json.dumps(out))
        return
    print(f"vocab {VOCAB}, {args.requests} requests x {args.max_tokens} tokens, depth {DEPTH}")
    for key in ("dense", "sparse32"):
        print(
            f"{key:9s} {out[f'{key}_tokens_per_second']:8.1f} tokens/s, ideal "
            f"{out[f'{key}_ideal_tokens_per_second']:8.1f} (mean accepted length "
            f"{out[f'{key}_mean_accepted_length']:.2f}): e2e_vs_ideal "
            f"{out[f'e2e_vs_ideal_{key}']:.2f}; speedup over target-only "
            f"{out[f'speedup_{key}']:.2f}"
        )
    print(
        f"target-only {out['target_only_tokens_per_second']:8.1f} tokens/s, ideal "
        f"{args.requests / T_TARGET:8.1f}: {out['target_only_vs_ideal']:.2f}"
    )


if __name__ == "__main__":
    main()
