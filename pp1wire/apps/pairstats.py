"""What a draft/target pair looks like to speculative decoding, measured on contexts sampled from
its own target, with the drafter's q built exactly as the worker builds it: Monte Carlo figures in
float64 over exact dyadic q, from a seeded generator."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pp1wire.q.proposal import build_row

M = 1 << 24
Row = npt.NDArray[np.float64]
ModelRow = Callable[[Sequence[int]], npt.NDArray[np.floating]]

#: q at the draw above which the confidence rule of ``docs/adaptive.md`` continues (τ).
TAU = 0.3


def ranks(x: npt.NDArray[np.float64]) -> Row:
    """Ranks from 1, ties given the mean of the ranks they span."""
    order = np.argsort(x, kind="stable")
    _, first, counts = np.unique(x[order], return_index=True, return_counts=True)
    mean_rank = first + (counts + 1) / 2.0
    out = np.empty(x.size)
    out[order] = np.repeat(mean_rank, counts)
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties ranked by their mean rank); 0 if either is constant."""
    ra, rb = ranks(np.asarray(a, dtype=np.float64)), ranks(np.asarray(b, dtype=np.float64))
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def _q(logits: npt.NDArray[np.floating], support: int | None, vocab: int) -> Row:
    """The drafter's q as the worker ships it, as a dense row of exact floats."""
    counts, ids = build_row(logits, 1.0, support)
    q = np.zeros(vocab)
    if ids is None:
        q[:] = counts
    else:
        q[ids] = counts
    q /= M
    return q


def _p(target: ModelRow, prefix: Sequence[int]) -> Row:
    p: Row = np.array(target(prefix), dtype=np.float64)
    p /= p.sum()
    return p


def _draw(weights: Row, rng: np.random.Generator) -> int:
    """One draw from ``weights`` (nonnegative, not all zero)."""
    cumulative = np.cumsum(weights)
    return int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))


def _accepted_length(
    prefix: list[int],
    p: Row,
    q: Row,
    depth: int,
    drafter: ModelRow,
    target: ModelRow,
    support: int | None,
    rng: np.random.Generator,
) -> float:
    """One estimate of the expected accepted drafts of a block of ``depth`` after ``prefix``."""
    vocab = p.size
    length, alive, path = 0.0, 1.0, list(prefix)
    for i in range(depth):
        if i:
            p = _p(target, path)
            q = _q(drafter(path), support, vocab)
        both = np.minimum(p, q)
        alpha = float(both.sum())
        alive *= alpha
        length += alive
        if alpha == 0.0:
            break
        path.append(_draw(both, rng))
    return length


def _spread(x: Sequence[float], at: Sequence[float], *, std: bool = False) -> dict[str, float]:
    """The mean of ``x`` (its standard deviation), and its quantiles ``at``."""
    out = {"mean": float(np.mean(x))} | ({"std": float(np.std(x))} if std else {})
    values = np.quantile(np.asarray(x, dtype=np.float64), at)
    return out | {f"p{round(100 * a)}": float(v) for a, v in zip(at, values, strict=True)}


def measure(
    drafter: ModelRow,
    target: ModelRow,
    vocab: int,
    *,
    chains: int = 50,
    length: int = 40,
    prompt: Sequence[int] = (1, 2, 3),
    depth: int = 5,
    support: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """The pair's statistics over ``chains * length`` contexts sampled from ``target`` (each
    chain grown from ``prompt``), ``drafter`` mapping a prefix to logits and ``target`` to p,
    q built as ``pp1-worker`` builds it: acceptance Σ min(p, q) (dense and top-K), the mean
    accepted length at ``depth`` (per-position acceptances along an accepted path, summed),
    top-K mass, q at a draw against its chance of acceptance, and the target's entropy.
    """
    rng = np.random.default_rng(seed)
    acc_dense: list[float] = []
    acc_sparse: list[float] = []
    top: list[float] = []
    conf: list[float] = []
    chance: list[float] = []
    conf_sparse: list[float] = []
    chance_sparse: list[float] = []
    entropy: list[float] = []
    len_dense: list[float] = []
    len_sparse: list[float] = []
    started = time.perf_counter()
    for _ in range(chains):
        prefix = list(prompt)
        for _ in range(length):
            p = _p(target, prefix)
            logits = drafter(prefix)
            q = _q(logits, None, vocab)
            qs = _q(logits, support, vocab)
            acc_dense.append(float(np.minimum(p, q).sum()))
            acc_sparse.append(float(np.minimum(p, qs).sum()))
            k = min(support, vocab)
            top.append(float(np.partition(q, vocab - k)[vocab - k :].sum()))
            for weights, cs, ch in ((q, conf, chance), (qs, conf_sparse, chance_sparse)):
                x = _draw(weights, rng)
                cs.append(float(weights[x]))
                ch.append(min(1.0, float(p[x] / weights[x])))
            nz = p[p > 0]
            entropy.append(float(-(nz * np.log2(nz)).sum()))
            len_dense.append(_accepted_length(prefix, p, q, depth, drafter, target, None, rng))
            len_sparse.append(_accepted_length(prefix, p, qs, depth, drafter, target, support, rng))
            prefix.append(_draw(p, rng))
    qs_arr, ch_arr = np.asarray(conf), np.asarray(chance)
    above = qs_arr >= TAU
    at = (0.1, 0.25, 0.5, 0.75, 0.9)
    return {
        "contexts": len(acc_dense),
        "vocab": vocab,
        "depth": depth,
        "support": support,
        "acceptance": {
            "dense": _spread(acc_dense, at, std=True),
            f"sparse{support}": _spread(acc_sparse, at, std=True),
        },
        "mean_accepted_length": {
            "dense": float(np.mean(len_dense)),
            f"sparse{support}": float(np.mean(len_sparse)),
        },
        f"top{support}_mass": _spread(top, at),
        "confidence": {
            "spearman_dense": spearman(conf, chance),
            f"spearman_sparse{support}": spearman(conf_sparse, chance_sparse),
            "q_at_draw_median": float(np.median(qs_arr)),
            "mean_acceptance_of_draw": float(ch_arr.mean()),
            "tau": TAU,
            "share_q_at_least_tau": float(above.mean()),
            "acceptance_q_at_least_tau": float(ch_arr[above].mean()) if above.any() else None,
            "acceptance_q_below_tau": float(ch_arr[~above].mean()) if (~above).any() else None,
        },
        "target_entropy_bits": _spread(entropy, at),
        "seconds": time.perf_counter() - started,
    }


def row_cost(
    fn: Callable[[Sequence[int]], Any],
    batch: Callable[[Sequence[Sequence[int]]], Any],
    prefixes: Sequence[Sequence[int]],
    *,
    batch_size: int = 8,
    repeats: int = 3,
) -> dict[str, float]:
    """Milliseconds per row of ``fn`` one prefix at a time, and of ``batch`` over
    ``batch_size`` prefixes at a time: the best of ``repeats`` passes over ``prefixes``."""
    per_prefix, batched = [], []
    groups = [prefixes[i : i + batch_size] for i in range(0, len(prefixes), batch_size)]
    for _ in range(repeats):
        t = time.perf_counter()
        for prefix in prefixes:
            fn(prefix)
        per_prefix.append((time.perf_counter() - t) / len(prefixes))
        t = time.perf_counter()
        for group in groups:
            batch(group)
        batched.append((time.perf_counter() - t) / len(prefixes))
    return {"per_prefix_ms": 1e3 * min(per_prefix), "batch_ms": 1e3 * min(batched)}
