"""Adaptive blocks against the best fixed depth: tokens/s and drafted rows per committed token.

Run from the repository root: ``python benchmarks/adaptive.py [--runs 3] [--requests 8]
[--max-tokens 64] [--vocab 32000] [--models toy ngram] [--json]``.

Declared before any run (nothing here is tuned to the result):

- Plugins (``benchmarks/adaptive_plugins.py``), for each pair of ``--models``
  (both by default): the toy pair (``pp1wire.apps.models``) or the n-gram pair
  (``pp1wire.apps.ngram``, the statistics of real language); the target at a
  fixed ``--target-ms`` 20 ms per call, a batch of prefixes being one call (one
  engine step), and the drafter at ``--draft-ms`` 2 ms per call; ``--vocab``
  32,000; ``--requests`` S = 8 requests at once, one slot each; temperature 1.
- Configurations, every one with the same plugins, worker and prompts: fixed
  depth 1..5 (``--stop fixed``); ``--depth 5 --stop confidence:0.3``;
  ``--depth 5 --stop joint:0.3``; ``--depth auto`` (the controller's default
  policy, at most 5). Each for dense q and sparse:32 q.
- tau = 0.3 for both rules, from the costs: a draft costs t_d = 2 ms, and a
  committed token is worth about a third of a 20 ms round (rounds commit about
  three tokens), so a draft pays while its chance of acceptance exceeds about
  t_d / (20 ms / 3) = 0.3; the rules use the drafter's own q as that chance
  (``docs/adaptive.md`` §1).
- ``--runs`` R = 3 interleaved repetitions (every configuration once per
  repetition, in the same order); the figures are the median and the min-max
  over them. The ratio of each adaptive configuration to the best fixed depth
  (the fixed depth with the highest median tokens/s, per support) is taken
  repetition by repetition, then summarized. Goal: >= 1.10 in tokens/s, and
  fewer drafted rows per committed token.

A diagnostic from the same models, in process: over ``--probes`` drafted
positions, the drafter's q at its own draw against the exact acceptance chance
min(1, p/q) of that draw: their mean, their correlation, and the acceptance
above and below tau. A rule on q can only help where q says something about
acceptance. For the toy pair (``diagnostic``) the positions follow random
one-token contexts and the correlation is Pearson's; for every pair
(``statistics``) they are contexts sampled from the pair's own target, as
``benchmarks/pair_stats.py`` measures them (:mod:`pp1wire.apps.pairstats`:
Spearman's correlation, acceptance, mean accepted length at depth 5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
from speedup import summarize

from pp1wire.apps import demo, pairstats
from pp1wire.apps.launch import spark_command, worker_process
from pp1wire.apps.models import ToyLM
from pp1wire.q.proposal import build_row

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 32_000
TAU = "0.3"
SUPPORTS = {"dense": "dense", "sparse32": "sparse:32"}
# Each pair's plugins in benchmarks/adaptive_plugins.py: (drafter, target).
PAIRS = {
    "toy": ("drafter_factory", "target_factory"),
    "ngram": ("ngram_drafter_factory", "ngram_target_factory"),
}
PLUGINS = "benchmarks.adaptive_plugins"


def configurations(depths: list[int]) -> dict[str, list[str]]:
    """The pp1-spark flags of each configuration, by name."""
    out = {f"fixed{d}": ["--depth", str(d)] for d in depths}
    out["confidence"] = ["--depth", "5", "--stop", f"confidence:{TAU}"]
    out["joint"] = ["--depth", "5", "--stop", f"joint:{TAU}"]
    out["auto"] = ["--depth", "auto"]
    return out


def spark(
    address: str,
    flags: list[str],
    support: str,
    requests: int,
    tokens: int,
    env: dict[str, str],
    *,
    vocab: int = VOCAB,
    pair: str = "toy",
) -> dict[str, Any]:
    """One pp1-spark run's --json summary."""
    cmd = spark_command(
        address,
        "--target", f"{PLUGINS}:{PAIRS[pair][1]}",
        "--requests", str(requests), "--concurrency", str(requests),
        "--max-tokens", str(tokens), "--support", support, "--json", *flags,
        vocab=vocab,
    )  # fmt: skip
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, check=True, cwd=ROOT, env=env
    )
    summary: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    if summary["fallbacks"]:
        raise RuntimeError(f"{flags} {support}: fallbacks {summary['fallbacks_by_reason']}")
    return summary


def measure(
    runs: int,
    requests: int,
    tokens: int,
    target_ms: float,
    draft_ms: float,
    depths: list[int],
    *,
    vocab: int = VOCAB,
    pair: str = "toy",
) -> dict[str, Any]:
    """Every configuration ``runs`` times, interleaved, with the pair ``pair``; returns
    the figures."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),  # the plugins: benchmarks.adaptive_plugins
        "PP1_BENCH_TARGET_MS": str(target_ms),
        "PP1_BENCH_DRAFT_MS": str(draft_ms),
    }
    configs = configurations(depths)
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {c: [] for c in configs} for s in SUPPORTS
    }
    with worker_process(
        "--drafter", f"{PLUGINS}:{PAIRS[pair][0]}",
        "--max-slots", str(requests), "--draw-threads", str(requests),
        vocab=vocab, seed=0, env=env,  # the toy drafter perturbs the target of the same seed
    ) as worker:  # fmt: skip
        for _ in range(runs):
            for skey, support in SUPPORTS.items():
                for name, flags in configs.items():
                    summary = spark(
                        worker.address, flags, support, requests, tokens, env,
                        vocab=vocab, pair=pair,
                    )  # fmt: skip
                    raw[skey][name].append(summary)
    out: dict[str, Any] = {}
    for skey in SUPPORTS:
        rate = {c: [r["tokens_per_second"] for r in raw[skey][c]] for c in configs}
        rows = {c: [r["draft_tokens"] / r["tokens"] for r in raw[skey][c]] for c in configs}
        fixed = [c for c in configs if c.startswith("fixed")]
        best = max(fixed, key=lambda c: statistics.median(rate[c]))
        table: dict[str, Any] = {}
        for c in configs:
            table[c] = {
                "tokens_per_second": summarize(rate[c]),
                "rows_per_token": summarize(rows[c]),
                "mean_step_depth": summarize([r["mean_step_depth"] for r in raw[skey][c]]),
                "acceptance_rate": summarize([r["acceptance_rate"] for r in raw[skey][c]]),
            }
        for c in ("confidence", "joint", "auto"):
            table[c]["speed_vs_best_fixed"] = summarize(
                [a / b for a, b in zip(rate[c], rate[best], strict=True)]
            )
            table[c]["rows_vs_best_fixed"] = summarize(
                [a / b for a, b in zip(rows[c], rows[best], strict=True)]
            )
        out[skey] = {"best_fixed": best, "configurations": table}
    return out


def diagnostic(probes: int, seed: int = 1, vocab: int = VOCAB) -> dict[str, Any]:
    """The toy drafter's q at its draw against the draw's exact acceptance chance (dense q)."""
    target, drafter = ToyLM(vocab, 0), ToyLM(vocab, 0, draft=True)
    rng = np.random.default_rng(seed)
    qs, accept = [], []
    for _ in range(probes):
        prefix = [int(rng.integers(vocab))]
        counts, _ = build_row(drafter.logits(prefix), 1.0, None)
        q = counts / float(1 << 24)
        p = np.asarray(target.probs(prefix), dtype=np.float64)
        p = p / p.sum()
        x = int(rng.choice(vocab, p=q))
        qs.append(float(q[x]))
        accept.append(min(1.0, float(p[x] / q[x])))
    q_arr, a_arr = np.asarray(qs), np.asarray(accept)
    above = q_arr >= float(TAU)
    return {
        "probes": probes,
        "mean_acceptance": float(a_arr.mean()),
        "q_at_draw_median": float(np.median(q_arr)),
        "correlation_q_acceptance": float(np.corrcoef(q_arr, a_arr)[0, 1]),
        "share_q_at_least_tau": float(above.mean()),
        "acceptance_q_at_least_tau": float(a_arr[above].mean()) if above.any() else None,
        "acceptance_q_below_tau": float(a_arr[~above].mean()) if (~above).any() else None,
    }


def statistics_of(pair: str, vocab: int, probes: int) -> dict[str, Any]:
    """The pair's statistics (:func:`pp1wire.apps.pairstats.measure`) over about ``probes``
    contexts sampled from its own target (chains of 40 tokens)."""
    drafter, target = demo.models(pair, vocab, 0)
    length = min(40, probes)
    return pairstats.measure(drafter, target, vocab, chains=max(1, probes // length), length=length)


def main() -> None:
    """Measure and print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--target-ms", type=float, default=20.0)
    p.add_argument("--draft-ms", type=float, default=2.0)
    p.add_argument("--depths", default="1,2,3,4,5", help="the fixed depths swept")
    p.add_argument("--probes", type=int, default=400)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--models", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    out: dict[str, Any] = {"pairs": {}}
    for pair in args.models:
        res = measure(
            args.runs, args.requests, args.max_tokens, args.target_ms, args.draft_ms, depths,
            vocab=args.vocab, pair=pair,
        )  # fmt: skip
        if pair == "toy":
            res["diagnostic"] = diagnostic(args.probes, vocab=args.vocab)
        res["statistics"] = statistics_of(pair, args.vocab, args.probes)
        out["pairs"][pair] = res
    out["settings"] = {
        "runs": args.runs,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "target_ms": args.target_ms,
        "draft_ms": args.draft_ms,
        "vocab": args.vocab,
        "tau": TAU,
        "models": args.models,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"vocab {args.vocab}, {args.requests} requests x {args.max_tokens} tokens, target "
        f"{args.target_ms:g} ms per batch call, drafter {args.draft_ms:g} ms per call, "
        f"{args.runs} interleaved runs (median [min-max])"
    )
    for pair, res in out["pairs"].items():
        for skey in SUPPORTS:
            table = res[skey]
            print(f"\n{pair} pair, {skey}: best fixed depth = {table['best_fixed']}")
            for name, row in table["configurations"].items():
                r, w = row["tokens_per_second"], row["rows_per_token"]
                line = (
                    f"  {name:10s} {r['median']:7.1f} tok/s [{r['min']:.1f}-{r['max']:.1f}]  "
                    f"rows/token {w['median']:.3f} [{w['min']:.3f}-{w['max']:.3f}]  "
                    f"depth {row['mean_step_depth']['median'] or 0:.2f}"
                )
                if "speed_vs_best_fixed" in row:
                    sp = row["speed_vs_best_fixed"]
                    line += f"  vs best fixed x{sp['median']:.3f} [{sp['min']:.3f}-{sp['max']:.3f}]"
                print(line)
        if "diagnostic" in res:
            print(f"\n{pair} pair, diagnostic:", json.dumps(res["diagnostic"]))
        st = res["statistics"]
        c = st["confidence"]
        print(
            f"{pair} pair, statistics over {st['contexts']} contexts from its target: acceptance "
            f"{st['acceptance']['dense']['mean']:.3f} (sparse:32 "
            f"{st['acceptance']['sparse32']['mean']:.3f}), mean accepted length at depth 5 "
            f"{st['mean_accepted_length']['dense']:.2f} (sparse:32 "
            f"{st['mean_accepted_length']['sparse32']:.2f}), Spearman q(x) vs min(1,p/q) "
            f"{c['spearman_dense']:.3f}, q(x) >= {c['tau']}: {c['share_q_at_least_tau']:.2f} "
            f"of draws, accepted {c['acceptance_q_at_least_tau'] or 0:.3f} "
            f"(below: {c['acceptance_q_below_tau'] or 0:.3f})"
        )


if __name__ == "__main__":
    main()
