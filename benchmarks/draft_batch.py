"""Worker CPU per drafted row: drafting STEPs one request at a time vs as one batch.

Run: ``python benchmarks/draft_batch.py [--quick] [--json] [--reps N]
[--drafter-kind logits|probs|both]``.

A step of 8 slots x depth 5 (40 rows) is drafted and its replies encoded two
ways, interleaved in every repetition (the machines are shared and noisy):

* ``per-request``: today's worker path per slot, :func:`propose` then
  :func:`reply_frames` (rows encoded from their counts);
* ``batch``: :func:`propose_batch` over the 8 slots (one drafter call per
  position, the rows in one compiled pass on ``--threads`` threads, dense rows
  written once as they travel), then :func:`reply_frames` per slot.

The drafter is free (it returns precomputed rows: logits, or with
``--drafter-kind probs`` the same rows' FP32 probabilities, ``kind =
"probs"``: q built with no exponential), so the figures are the worker's own
work: q construction, the proposal draw and reply encoding. Cases of a
probabilities drafter are named ``probs:<case>``.
CPU is the process's (every thread); wall is elapsed time. Each figure is the
median over repetitions with the min-max beside it, and ``ratio`` is
per-request / batch within one repetition.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from pp1wire.q.batch import propose_batch
from pp1wire.q.proposal import DraftJob, propose
from pp1wire.q.rng import Role, RoundStreams
from pp1wire.wire.messages import Step
from pp1wire.wire.replies import reply_frames

SLOTS = 8
DEPTH = 5
CASES = (("dense", 129_280, 0), ("dense", 32_000, 0), ("sparse:32", 129_280, 32))


class _Drafter:
    """Precomputed rows, chosen by the prefix: logits, or their FP32 probabilities."""

    def __init__(self, pool: list[np.ndarray], kind: str) -> None:
        self.pool = pool
        self.kind = kind

    def __call__(self, prefix: Sequence[int]) -> np.ndarray:
        last = int(prefix[-1]) if len(prefix) else 0
        return self.pool[(len(prefix) * 31 + last) % len(self.pool)]


def _drafter(vocab: int, kind: str = "logits") -> tuple[_Drafter, list[np.ndarray]]:
    rng = np.random.default_rng(vocab)
    pool = [rng.standard_normal(vocab) * 3.0 for _ in range(16)]
    if kind == "probs":
        pool = [(np.exp(x - x.max()) / np.exp(x - x.max()).sum()).astype(np.float32) for x in pool]
    return _Drafter(pool, kind), pool


def _step(slot: int, round_id: int, position: int, support: int) -> Step:
    return Step(
        session=1,
        slot=slot,
        generation=1,
        round=round_id,
        position=position,
        digest=0,
        depth=DEPTH,
        temperature=1.0,
        support=support,
        context=0,
    )


class Clock:
    """CPU (process, every thread) and wall seconds of the timed blocks."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0

    def time(self, fn: Callable[[], object]) -> object:
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        self.cpu += time.process_time() - c0
        self.wall += time.perf_counter() - w0
        return out


def one_rep(
    vocab: int, support: int, rounds: int, threads: int, kind: str = "logits"
) -> dict[str, float]:
    """Milliseconds per drafted row of each variant over ``rounds`` steps."""
    drafter, _ = _drafter(vocab, kind)
    prefixes = [[slot + 1, 7 * slot + 3] for slot in range(SLOTS)]
    clocks = {k: Clock() for k in ("seq_build", "seq_encode", "batch_build", "batch_encode")}
    rows_drafted = {"seq": 0, "batch": 0}
    for r in range(rounds):
        jobs = [
            DraftJob(seed=s, generation=1, round_id=r, prefix=prefixes[s], depth=DEPTH,
                     temperature=1.0, support=support)
            for s in range(SLOTS)
        ]  # fmt: skip
        for j in jobs:
            streams = RoundStreams(Role.WORKER, j.seed, j.generation, j.round_id)
            rows = clocks["seq_build"].time(
                lambda j=j, streams=streams: propose(
                    j.prefix, j.depth, drafter, streams, support=j.support or None
                )
            )
            assert isinstance(rows, tuple)
            step = _step(j.seed, r, len(j.prefix), support)
            clocks["seq_encode"].time(
                lambda step=step, rows=rows: reply_frames(1, step, rows, vocab)
            )
            rows_drafted["seq"] += len(rows)
        got = clocks["batch_build"].time(
            lambda jobs=jobs: propose_batch(
                lambda ps: [drafter(p) for p in ps], jobs, vocab, threads=threads,
                row_entries=vocab, kind=kind,
            )
        )  # fmt: skip
        assert isinstance(got, list)
        for j, rows in zip(jobs, got, strict=True):
            assert isinstance(rows, tuple), rows
            step = _step(j.seed, r, len(j.prefix), support)
            clocks["batch_encode"].time(
                lambda step=step, rows=rows: reply_frames(1, step, rows, vocab)
            )
            rows_drafted["batch"] += len(rows)
    out: dict[str, float] = {}
    for name, clock in clocks.items():
        n = rows_drafted[name.split("_")[0]]
        out[f"{name}_cpu"] = clock.cpu / n * 1e3
        out[f"{name}_wall"] = clock.wall / n * 1e3
    for clock_kind in ("cpu", "wall"):
        seq, batch = f"seq_all_{clock_kind}", f"batch_all_{clock_kind}"
        out[seq] = out[f"seq_build_{clock_kind}"] + out[f"seq_encode_{clock_kind}"]
        out[batch] = out[f"batch_build_{clock_kind}"] + out[f"batch_encode_{clock_kind}"]
        out[f"ratio_all_{clock_kind}"] = out[seq] / out[batch]
    return out


def run(
    reps: int, rounds: int, threads: int, kinds: Sequence[str] = ("logits",)
) -> dict[str, dict[str, list[float]]]:
    """Per case (and drafter kind), each figure's values over the repetitions."""
    results: dict[str, dict[str, list[float]]] = {}
    for kind in kinds:
        for label, vocab, support in CASES:
            one_rep(vocab, support, 1, threads, kind)  # warm up: scratch, pools, caches
            per: dict[str, list[float]] = {}
            for _ in range(reps):
                for key, value in one_rep(vocab, support, rounds, threads, kind).items():
                    per.setdefault(key, []).append(value)
            name = f"{label}@{vocab}"
            results[name if kind == "logits" else f"{kind}:{name}"] = per
    return results


ROWS_SHOWN = (
    ("per-request build", "seq_build"),
    ("per-request encode", "seq_encode"),
    ("per-request all-in", "seq_all"),
    ("batch build", "batch_build"),
    ("batch encode", "batch_encode"),
    ("batch all-in", "batch_all"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3, help="steps per repetition")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafter-kind", choices=("logits", "probs", "both"), default="logits")
    args = parser.parse_args()
    reps, rounds = (2, 1) if args.quick else (args.reps, args.rounds)
    kinds = ("logits", "probs") if args.drafter_kind == "both" else (args.drafter_kind,)
    results = run(reps, rounds, args.threads, kinds)
    if args.json:
        summary = {
            case: {k: statistics.median(v) for k, v in per.items()} for case, per in results.items()
        }
        print(json.dumps(summary))
        return 0
    print(
        f"{SLOTS} slots x depth {DEPTH}, {rounds} steps per repetition, {reps} repetitions, "
        f"batch on {args.threads} threads; ms per drafted row, median (min..max)"
    )
    for case, per in results.items():
        print(f"\n{case}")
        print(f"  {'':22s} {'CPU ms/row':>24s} {'wall ms/row':>24s}")
        for label, key in ROWS_SHOWN:
            cells = []
            for kind in ("cpu", "wall"):
                v = per[f"{key}_{kind}"]
                cells.append(f"{statistics.median(v):7.3f} ({min(v):.3f}..{max(v):.3f})")
            print(f"  {label:22s} {cells[0]:>24s} {cells[1]:>24s}")
        for kind in ("cpu", "wall"):
            v = per[f"ratio_all_{kind}"]
            print(
                f"  ratio per-request/batch all-in {kind}: {statistics.median(v):.2f} "
                f"({min(v):.2f}..{max(v):.2f})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
