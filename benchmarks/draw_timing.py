"""How the time of a proposal draw varies with the index it draws (``docs/adaptive.md`` §7).

Run: ``python benchmarks/draw_timing.py [--quick] [--json]``.

For one row of V = 129,280 (dense) and one of 32 entries (sparse:32), each draw
``u`` is chosen so that the token falls at one of nine places along the row
(its first entry, then every eighth of the cumulative counts, then its last):
the draw alone (``dyadic.sample``: compiled, and numpy with the compiled module
off), and the worker's whole dense row (``rows.construct_rows``: checks,
allocation, wire values and the draw in one call). The places are timed
round-robin within each trial, from another place each trial (the machines
are shared and noisy); a place's
figure is the median over trials of the fastest of its repetitions. ``spread``
is the largest place's figure less the smallest, in nanoseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from pp1wire.q import dyadic
from pp1wire.q import rows as rows_

VOCAB = 129_280
PLACES = 9


def _draws(counts: np.ndarray) -> list[int]:
    """A draw for each place: the first entry, every eighth of the mass, the last."""
    cum = np.cumsum(counts, dtype=np.int64)
    out = [0]
    for k in range(1, PLACES - 1):
        out.append(int(k * dyadic.M // (PLACES - 1)))
    out.append(dyadic.M - 1)
    assert dyadic.sample(counts, out[0]) == 0
    assert dyadic.sample(counts, out[-1]) == int(np.flatnonzero(counts)[-1])
    assert int(cum[-1]) == dyadic.M
    return out


def _fastest(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        best = min(best, time.perf_counter_ns() - t0)
    return best


def measure(cases: dict[str, list[Callable[[], object]]], trials: int, reps: int) -> dict:
    """Per case: each place's figure (ns) and the spread across places."""
    for fns in cases.values():
        for fn in fns:
            fn()
    per: dict[str, list[list[float]]] = {k: [[] for _ in v] for k, v in cases.items()}
    for trial in range(trials):
        for name, fns in cases.items():
            for k in range(len(fns)):  # each trial starts at another place
                place = (trial + k) % len(fns)
                per[name][place].append(_fastest(fns[place], reps))
    out = {}
    for name, places in per.items():
        figures = [round(statistics.median(v)) for v in places]
        out[name] = {
            "ns_by_place": figures,
            "spread_ns": max(figures) - min(figures),
            "median_ns": round(statistics.median(figures)),
        }
    return out


def run(trials: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(VOCAB) * 3.0
    p = np.exp(logits - logits.max())
    probs32 = (p / p.sum()).astype(np.float32)
    dense32 = dyadic.counts_from_fp32(probs32)
    _, sparse = dyadic.sparse_counts_from_fp32(probs32, 32)
    dense_u, sparse_u = _draws(dense32), _draws(sparse)
    payload = [np.empty(VOCAB, dtype="<f4")]

    def numpy_sample(c: np.ndarray, u: int) -> object:
        saved, dyadic._fastq = dyadic._fastq, None  # type: ignore[attr-defined]
        try:
            return dyadic.sample(c, u)
        finally:
            dyadic._fastq = saved  # type: ignore[attr-defined]

    cases: dict[str, list[Callable[[], object]]] = {
        "dense_sample": [lambda u=u: dyadic.sample(dense32, u) for u in dense_u],
        "dense_sample_numpy": [lambda u=u: numpy_sample(dense32, u) for u in dense_u],
        "dense_row": [
            lambda u=u: rows_.construct_rows([probs32], [u], VOCAB, payload) for u in dense_u
        ],
        "sparse32_sample": [lambda u=u: dyadic.sample(sparse, u) for u in sparse_u],
        "sparse32_sample_numpy": [lambda u=u: numpy_sample(sparse, u) for u in sparse_u],
    }
    return measure(cases, trials, reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trials, reps = (3, 5) if args.quick else (15, 40)
    res = run(trials, reps)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{trials} trials x {reps} reps per place, {PLACES} places along the row")
    print(f"{'case':24s} {'median ns':>10s} {'spread ns':>10s}  by place")
    for name, r in res.items():
        places = " ".join(str(v) for v in r["ns_by_place"])
        print(f"{name:24s} {r['median_ns']:10d} {r['spread_ns']:10d}  {places}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
