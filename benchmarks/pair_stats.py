"""The n-gram pair's statistics beside the toy pair's and beside published real pairs.

Run from the repository root: ``python benchmarks/pair_stats.py [--json]
[--chains 50] [--toy-chains 10] [--length 40] [--no-row-cost]``.

Both pairs are measured by :func:`pp1wire.apps.pairstats.measure` (its
docstring says how): contexts sampled from each pair's own target, grown from
``pp1-spark``'s default prompt [1, 2, 3] (``--chains`` chains of ``--length``
tokens for the n-gram pair, ``--toy-chains`` for the toy pair, whose rows cost
far more), the drafter's q built exactly as ``pp1-worker`` builds it at
temperature 1, depth 5 and sparse top-32.

- The n-gram pair (``pp1wire.apps.ngram``) is measured over its own K tokens:
  at any vocabulary of K IDs or more its law is the same (IDs beyond K have
  probability zero under both models, are never drawn and never among the top
  32), so the figures hold at 129,280.
- The toy pair (``pp1wire.apps.models``) at ``--toy-vocab`` (129,280).

It also times one row of each model at 129,280 (``--no-row-cost``: not),
one prefix at a time and in batches of 8 (best of 3 passes over 32 prefixes
sampled from the n-gram target; a shared machine makes these noisy).

The published figures printed beside them are quoted from the papers cited
(acceptance alpha = E[Σ min(p, q)] as Leviathan et al. define it); a mean
accepted length next to them is *derived* from alpha by the paper's Eq. (1)
under its i.i.d. assumption, E[accepted] = alpha + alpha² + … + alpha⁵ at depth
5, not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from pp1wire.apps import ngram, pairstats
from pp1wire.apps.models import DEFAULT_VOCAB, ToyLM

# Published figures for real draft/target pairs: (pair, setting, what, value, source).
LEVIATHAN = (
    "Leviathan, Kalman, Matias, Fast Inference from Transformers via Speculative Decoding, "
    "ICML 2023 (arXiv:2211.17192)"
)
SPECDEC_PP = (
    "Huang, Guo, Wang, SpecDec++: Boosting Speculative Decoding via Adaptive Candidate "
    "Lengths, COLM 2025 (arXiv:2405.19715), abstract"
)
PUBLISHED: tuple[tuple[str, str, str, float, str], ...] = (
    ("T5-XXL 11B / T5-small 77M", "WMT EnDe, T=1", "alpha", 0.62, LEVIATHAN + ", Table 2"),
    ("T5-XXL 11B / T5-small 77M", "CNN/DM, T=1", "alpha", 0.53, LEVIATHAN + ", Table 2"),
    ("T5-XXL 11B / T5-small 77M", "WMT EnDe, T=0", "alpha", 0.75, LEVIATHAN + ", Table 2"),
    ("T5-XXL 11B / T5-small 77M", "CNN/DM, T=0", "alpha", 0.65, LEVIATHAN + ", Table 2"),
    ("T5-XXL 11B / bigram", "WMT EnDe, T=0", "alpha", 0.20, LEVIATHAN + ", Table 3"),
    ("LaMDA 137B / LaMDA 8B", "dialog, T=0", "alpha", 0.75, LEVIATHAN + ", Table 3"),
    ("LaMDA 137B / LaMDA 100M", "dialog, T=0", "alpha", 0.61, LEVIATHAN + ", Table 3"),
    ("llama-2-chat 70B / 7B", "Alpaca", "adaptive vs baseline SD", 1.072, SPECDEC_PP),
    ("llama-2-chat 70B / 7B", "GSM8K", "adaptive vs baseline SD", 1.094, SPECDEC_PP),
    ("llama-2-chat 70B / 7B", "HumanEval", "adaptive vs baseline SD", 1.111, SPECDEC_PP),
)


def implied_length(alpha: float, depth: int = 5) -> float:
    """E[accepted drafts] of a block of ``depth`` for i.i.d. acceptance ``alpha`` (Eq. (1))."""
    return sum(alpha**i for i in range(1, depth + 1))


def _sample_prefixes(model: ngram.NgramLM, n: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out, prefix = [], [1, 2, 3]
    for _ in range(n):
        p = model.probs(prefix)
        prefix = [*prefix, int(rng.choice(p.size, p=p))]
        out.append(list(prefix))
    return out


def row_costs(vocab: int) -> dict[str, dict[str, float]]:
    """Milliseconds per row of each model at ``vocab``: per prefix and in batches of 8."""
    target, drafter = ngram.ngram_target(vocab), ngram.ngram_drafter(vocab)
    toy_target, toy_drafter = ToyLM(vocab, 0), ToyLM(vocab, 0, draft=True)
    prefixes = _sample_prefixes(target, 32)
    cases = {
        "ngram drafter logits": (drafter.logits, drafter.logits_batch),
        "toy drafter logits": (toy_drafter.logits, toy_drafter.logits_batch),
        "ngram target probs": (target.probs, target.probs_batch),
        "toy target probs": (toy_target.probs, toy_target.probs_batch),
    }
    return {name: pairstats.row_cost(one, many, prefixes) for name, (one, many) in cases.items()}


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(out: dict[str, Any]) -> str:
    """The figures as text: both pairs side by side, then the published ones."""
    ng, toy = out["ngram"], out["toy"]
    lines = [
        f"n-gram pair: {out['ngram_pair']} over K = {out['tokens']} tokens "
        f"(text sha256 {out['text_digest'][:16]}, tables {out['tables_digest'][:16]}); "
        f"toy pair at V = {toy['vocab']:,}",
        f"contexts sampled from each target: n-gram {ng['contexts']}, toy {toy['contexts']}",
        "",
        f"  {'':46s} {'n-gram':>24s} {'toy':>24s}  goal",
    ]

    def row(label: str, a: str, b: str, goal: str = "") -> None:
        lines.append(f"  {label:46s} {a:>24s} {b:>24s}  {goal}".rstrip())

    def spread(d: dict[str, float], keys: tuple[str, ...]) -> str:
        return "/".join(f"{d[k]:.2f}" for k in keys)

    deciles = ("p10", "p50", "p90")
    for key, name in (("dense", "dense"), ("sparse32", "sparse:32")):
        a, b = ng["acceptance"][key], toy["acceptance"][key]
        goal = "0.5..0.9" if key == "dense" else ""
        row(f"acceptance sum min(p,q), {name}: mean", _fmt(a["mean"]), _fmt(b["mean"]), goal)
        row("  std", _fmt(a["std"]), _fmt(b["std"]))
        row("  p10/p50/p90", spread(a, deciles), spread(b, deciles))
    for key, name in (("dense", "dense"), ("sparse32", "sparse:32")):
        a, b = ng["mean_accepted_length"][key], toy["mean_accepted_length"][key]
        row(f"mean accepted length, depth 5, {name}", _fmt(a, 2), _fmt(b, 2))
    row("drafter's top-32 mass: median", _fmt(ng["top32_mass"]["p50"]),
        _fmt(toy["top32_mass"]["p50"]), ">= 0.85")  # fmt: skip
    c, d = ng["confidence"], toy["confidence"]
    row("Spearman, q(x) at draw vs min(1,p/q): dense", _fmt(c["spearman_dense"]),
        _fmt(d["spearman_dense"]), ">= 0.3")  # fmt: skip
    row("  sparse:32", _fmt(c["spearman_sparse32"]), _fmt(d["spearman_sparse32"]))
    row("q(x) at the draw: median", _fmt(c["q_at_draw_median"]), _fmt(d["q_at_draw_median"]))
    row("share of draws with q(x) >= 0.3", _fmt(c["share_q_at_least_tau"]),
        _fmt(d["share_q_at_least_tau"]))  # fmt: skip
    row("  their acceptance min(1,p/q)", _fmt(c["acceptance_q_at_least_tau"]),
        _fmt(d["acceptance_q_at_least_tau"]))  # fmt: skip
    row("  acceptance of draws with q(x) < 0.3", _fmt(c["acceptance_q_below_tau"]),
        _fmt(d["acceptance_q_below_tau"]))  # fmt: skip
    a, b = ng["target_entropy_bits"], toy["target_entropy_bits"]
    row("target entropy, bits: mean", _fmt(a["mean"], 2), _fmt(b["mean"], 2))
    quartiles = ("p10", "p25", "p50", "p75", "p90")
    row("  p10/p25/p50/p75/p90", spread(a, quartiles), spread(b, quartiles))
    lines += ["", "published figures for real pairs (quoted; lengths derived by Eq. (1)):"]
    for pair, setting, what, value, source in PUBLISHED:
        if what == "alpha":
            shown = f"alpha {value:.2f} (depth-5 length by Eq. (1): {implied_length(value):.2f})"
        else:
            shown = f"{what} {value:.3f}x"
        lines.append(f"  {pair:28s} {setting:15s} {shown}")
        lines.append(f"      {source}")
    if "row_cost_ms" in out:
        lines += ["", f"one row at V = {out['row_cost_vocab']:,}, ms (per prefix / batch of 8):"]
        for name, cost in out["row_cost_ms"].items():
            lines.append(f"  {name:24s} {cost['per_prefix_ms']:8.3f} / {cost['batch_ms']:8.3f}")
    return "\n".join(lines)


def main() -> None:
    """Measure and print (or ``--json``)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--chains", type=int, default=50, help="n-gram pair: chains sampled")
    p.add_argument("--toy-chains", type=int, default=10, help="toy pair: chains sampled")
    p.add_argument("--length", type=int, default=40, help="contexts per chain")
    p.add_argument("--toy-vocab", type=int, default=DEFAULT_VOCAB)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-row-cost", action="store_true", help="skip the row timings")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    try:
        table = ngram.tables()
    except ngram.CorpusMissingError as exc:
        print(f"pair_stats: {exc}", file=sys.stderr)
        sys.exit(1)
    k = table.size
    target, drafter = ngram.ngram_target(k), ngram.ngram_drafter(k)
    toy_target, toy_drafter = ToyLM(args.toy_vocab, 0), ToyLM(args.toy_vocab, 0, draft=True)
    out: dict[str, Any] = {
        "ngram_pair": "--drafter pp1wire.apps.ngram:drafter_factory "
        "--target pp1wire.apps.ngram:target_factory",
        "tokens": k,
        "text_digest": table.text_digest,
        "tables_digest": table.digest,
        "ngram": pairstats.measure(
            drafter.logits, target.probs, k, chains=args.chains, length=args.length,
            seed=args.seed,
        ),
        "toy": pairstats.measure(
            toy_drafter.logits, toy_target.probs, args.toy_vocab, chains=args.toy_chains,
            length=args.length, seed=args.seed,
        ),
        "published": [
            {"pair": a, "setting": b, "what": c, "value": d, "source": e}
            for a, b, c, d, e in PUBLISHED
        ],
    }  # fmt: skip
    if not args.no_row_cost:
        out["row_cost_vocab"] = DEFAULT_VOCAB
        out["row_cost_ms"] = row_costs(DEFAULT_VOCAB)
    if args.json:
        print(json.dumps(out))
        return
    print(report(out))


if __name__ == "__main__":
    main()
