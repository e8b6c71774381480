"""Per-row costs of dyadic24 validation and construction, as ratios to numpy baselines.

Run: ``python benchmarks/micro.py [--quick] [--json] [--places]``.

Each variant and its baseline are timed round-robin in the same run (the
machines are shared and noisy), and the report gives the median of the
per-trial medians with the min-max across trials beside it.

The worker's row (the batch path of ``propose_batch``):

* ``row_logits_counts``: the row maximum, the binary64 exponential
  (``weights_rows``), then the counts and the draw (``rows.allocate_rows``,
  without ``row_entries``) and their wire values (``counts_to_fp32``);
* ``row_logits_after``: the same exponential, then ``rows.construct_rows``
  (checks, total, allocation, draw and wire values in one call, the rows
  written as they travel: ``row_entries``);
* ``row_probs_after``: ``rows.construct_rows`` on a probabilities drafter's
  FP32 row (no maximum, no exponential);
* ``sparse32_probs_after`` against ``construct_sparse32`` (from logits);
* ``sample_dense``: the proposal draw alone from a row's int32 counts
  (``dyadic.sample``, the whole row whatever the token).

Each ``*_vs_after`` ratio is the speedup of the one-pass row.

``--places``: how the time of a proposal draw varies with the index it draws
(``docs/adaptive.md`` §7). For one dense row and one sparse:32 row, each draw
``u`` puts the token at one of nine places (the row's first entry, every eighth
of the mass, its last entry): the draw alone (``dyadic.sample``, compiled and
numpy) and the worker's whole dense row (``rows.construct_rows``). The places
are timed round-robin, from another place each trial; a place's figure is the
median over trials of the fastest of its repetitions (ns), ``spread`` the
largest figure less the smallest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pp1wire.q import dyadic, tree, validate
from pp1wire.q import rows as rows_

VOCAB = 129_280


def _trial(fn: Callable[[], object], reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(
    cases: dict[str, Callable[[], object]], trials: int, reps: int
) -> dict[str, list[float]]:
    """Per-trial medians (seconds) for each case, cases interleaved within a trial."""
    for fn in cases.values():
        fn()
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(trials):
        for name, fn in cases.items():
            out[name].append(_trial(fn, reps))
    return out


def run_cases(trials: int, reps: int) -> dict[str, list[float]]:
    """Per-trial values: ``<case>_us`` medians and same-trial ratios."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(VOCAB) * 3.0
    counts = dyadic.counts_from_logits(logits)
    row_bytes = dyadic.counts_to_fp32(counts).tobytes()
    row = np.frombuffer(row_bytes, dtype="<f4")
    bits = row.view(np.uint32)
    token = int(np.argmax(counts))
    validator = validate.DenseRowValidator(VOCAB)
    builder = dyadic.builder(VOCAB)
    sparse_ids, sparse_counts = dyadic.sparse_counts_from_logits(logits, 1.0, 32)
    sparse_ids_b = sparse_ids.astype("<i4").tobytes()
    sparse_q_b = dyadic.counts_to_fp32(sparse_counts).tobytes()

    def numpy_path(fn: Callable[..., object], *args: object) -> object:
        # The same construction with the compiled total and allocation switched off.
        saved, dyadic._fastq, tree._fastq = dyadic._fastq, None, None
        try:
            return fn(*args)
        finally:
            dyadic._fastq = tree._fastq = saved

    def softmax() -> object:
        z = logits - logits.max()
        np.exp(z, out=z)
        z /= z.sum()
        return z

    probs32 = (np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()).astype(
        np.float32
    )
    draw = [12345]
    payload = [np.empty(VOCAB, dtype="<f4")]
    counts32 = counts.astype(np.int32)

    def row_logits_counts() -> object:
        check = dyadic.check_top(float(logits.max()))
        w = rows_.weights_rows([logits], [check], [1.0])
        built, picks = rows_.allocate_rows(w, draw)
        return dyadic.counts_to_fp32(built[0]), picks

    def row_logits_after() -> object:
        check = dyadic.check_top(float(logits.max()))
        w = rows_.weights_rows([logits], [check], [1.0])
        return rows_.construct_rows(list(w), draw, VOCAB, payload)

    cases: dict[str, Callable[[], object]] = {
        "max_pass": lambda: bits.max(),
        "validate_dense": lambda: validator.check(row, token),
        "validate_dense_api": lambda: validate.validate_dense(row_bytes, VOCAB, token),
        "validate_sparse32": lambda: validate.validate_sparse(
            sparse_ids_b, sparse_q_b, VOCAB, 32, int(sparse_ids[0])
        ),
        "softmax_f64": softmax,
        "construct_dense": lambda: builder.from_logits(logits, 1.0),
        "construct_dense_api": lambda: dyadic.counts_from_logits(logits, 1.0),
        "construct_sparse32": lambda: dyadic.sparse_counts_from_logits(logits, 1.0, 32),
        "construct_dense_numpy": lambda: numpy_path(builder.from_logits, logits, 1.0),
        "row_logits_counts": row_logits_counts,
        "row_logits_after": row_logits_after,
        "row_probs_after": lambda: rows_.construct_rows([probs32], draw, VOCAB, payload),
        "sparse32_probs_after": lambda: dyadic.sparse_counts_from_fp32(probs32, 32),
        "sample_dense": lambda: dyadic.sample(counts32, 12345),
    }
    res = measure(cases, trials, reps)

    def ratio(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(res[a], res[b], strict=True)]

    out = {f"{k}_us": [v * 1e6 for v in vals] for k, vals in res.items()}
    out.update(
        {
            "validate_vs_max": ratio("validate_dense", "max_pass"),
            "validate_api_vs_max": ratio("validate_dense_api", "max_pass"),
            "construct_vs_softmax": ratio("construct_dense", "softmax_f64"),
            "construct_api_vs_softmax": ratio("construct_dense_api", "softmax_f64"),
            "construct_sparse32_vs_softmax": ratio("construct_sparse32", "softmax_f64"),
            "construct_compiled_vs_numpy": ratio("construct_dense", "construct_dense_numpy"),
            "row_logits_counts_vs_after": ratio("row_logits_counts", "row_logits_after"),
            "row_logits_counts_vs_probs_after": ratio("row_logits_counts", "row_probs_after"),
            "sparse32_logits_vs_probs": ratio("construct_sparse32", "sparse32_probs_after"),
        }
    )
    return out


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


def measure_places(
    cases: dict[str, list[Callable[[], object]]], trials: int, reps: int
) -> dict[str, dict[str, Any]]:
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
    out: dict[str, dict[str, Any]] = {}
    for name, places in per.items():
        figures = [round(statistics.median(v)) for v in places]
        out[name] = {
            "ns_by_place": figures,
            "spread_ns": max(figures) - min(figures),
            "median_ns": round(statistics.median(figures)),
        }
    return out


def run_places(trials: int, reps: int) -> dict[str, dict[str, Any]]:
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
    return measure_places(cases, trials, reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--places", action="store_true", help="the draw's time by place")
    args = parser.parse_args()
    if args.places:
        return places_main(args.quick, args.json)
    trials, reps = (3, 20) if args.quick else (9, 200)
    res = run_cases(trials, reps)
    if args.json:
        print(json.dumps({k: statistics.median(v) for k, v in res.items() if "_vs_" in k}))
        return 0
    print(f"vocabulary {VOCAB}, {trials} trials x {reps} reps, interleaved")
    print(f"{'case':28s} {'median us':>10s} {'min..max us':>18s}")
    for name, values in res.items():
        if name.endswith("_us"):
            print(
                f"{name[:-3]:28s} {statistics.median(values):10.1f} "
                f"{min(values):8.1f}..{max(values):<8.1f}"
            )
    print(f"{'ratio (same-trial)':28s} {'median':>10s} {'min..max':>18s}")
    for name, values in res.items():
        if "_vs_" in name:
            print(
                f"{name:28s} {statistics.median(values):10.2f} "
                f"{min(values):8.2f}..{max(values):<8.2f}"
            )
    return 0


def places_main(quick: bool, as_json: bool) -> int:
    trials, reps = (3, 5) if quick else (15, 40)
    res = run_places(trials, reps)
    if as_json:
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
