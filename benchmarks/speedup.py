"""What speculative decoding buys: speculative against target-only tokens/s, and against the ideal.

Run from the repository root: ``python benchmarks/speedup.py [--json] [--smoke]
[--models toy ngram] [--drafter-kind logits|probs|both] [--drafter-ms MS ...]
[--prepare N]``.

The plugins cost a fixed time per call, as a forward pass does
(:mod:`pp1wire.apps.paced`): the target sleeps to a deadline t_t per call,
whether it scores one prefix or a whole step's batch, and the drafter costs
t_d per call (one prefix or a batch): 0.5 ms, or each of ``--drafter-ms``, a
dimension of the cells (``drafter_ms``), each with its own workers. Two model
pairs (``--models``, both by default, one table row each): ``toy``, whose rows are nearly free
(tabulated toy models), so what is left of each side's CPU is pp1wire's own;
and ``ngram`` (:mod:`pp1wire.apps.ngram`, the pair with the statistics of real
language), whose rows are computed inside the paced time (a few hundredths
of a millisecond each). ``pp1-worker`` and ``pp1-spark`` run as they ship, pinned to different
cores (the first half of this process's cores, and the second half), with
S = 8 requests of 64 tokens at concurrency 8 (8 slots) and depth d = 5; for
each vocabulary V in {32,000, 129,280} and target cost t_t in {5, 20, 50}
ms: target-only (``--depth 0``), dense q and sparse:32 q, in the same run,
interleaved (each repetition runs every cell once, in a rotated order), each
figure the median with the min-max over the repetitions (3 by default).

Per cell, from the same repetition:

* ``speedup`` = speculative tokens/s / target-only tokens/s;
* ``ideal`` = S·(L + 1) / (d·t_d + t_t) tokens/s (the cell's t_d), with L the mean accepted
  length this run measured: an engine with these plugin costs and no other
  drafts d positions for every slot at once (d·t_d), scores every slot's
  drafts and bonus in one target call (t_t) and commits S·(L + 1) tokens;
  ``ideal_speedup`` = ideal / (S / t_t), the target-only ideal being S / t_t;
* ``measured_vs_ideal`` = speculative tokens/s / ideal;
* ``fill`` = the rounds each target call decided over the slots running
  (``pp1-spark``'s ``step_fill``; 1.0: every slot in every call);
* ``round_trip_ms`` = STEP sent to proposal validated, the run's median
  (``round_trip_ms_median``);
* ``step_ms`` = the run's seconds / its steps (target calls), against
  ``ideal_step_ms`` = d·t_d + t_t; ``worker_cpu_ms_per_step`` and
  ``spark_cpu_ms_per_step`` say what each side's CPU added to it;
* ``worker_cpu_ms_per_row`` = the worker process's CPU (user + system, from
  ``/proc/PID/task/*/schedstat``, every thread) during the run / the rows it sent
  (``pp1_worker_rows_total``), all in;
* ``spark_cpu_ms_per_token`` = ``pp1-spark``'s CPU during its requests
  (``cpu_seconds``) / the tokens it committed; the same for target-only
  (``target_only_spark_cpu_ms_per_token``);
* ``spark_cpu_ms_per_row`` = the same CPU / the rows the worker sent it (every
  one received and checked).

``--drafter-kind logits|probs|both`` chooses what the paced drafter hands
over: logits (the default) or FP32 probabilities (``kind = "probs"``); each
pair and kind has its own worker, and every run and cell says which
(``models``, ``drafter``). The
**free-model floor** (``floors``) is, per pair, vocabulary and kind, dense q with
free models (t_t = 0 and a drafter of 0 ms, its own worker, warmed up as the
others are): speculative and target-only tokens/s and each side's CPU per row,
over the same repetitions (``--no-floor`` skips it).

**Prepared blocks** (``--prepare N``, N in 1..8; 0, the default: none, and
the benchmark is the one above). Every speculative cell also runs against a
second worker of its pair, kind, vocabulary and t_d, started with ``pp1-worker
--prepare N`` (``prepare`` = N in its cell and runs; the cells above have
``prepare`` = 0): it drafts each slot's next block for N guesses of the
round's outcome while the Spark side verifies, and serves the STEP that
matches one. Its runs are interleaved with the others in each repetition's
rotation; target-only runs once per repetition, the baseline of both. An on
cell has every figure above, over its own runs, and:

* ``on_vs_off`` = its tokens/s / the tokens/s of the same cell without
  preparation (``prepare`` = 0), in the same repetition;
* ``rounds`` = the rounds its requests ran (``pp1-spark``'s ``rounds``);
* ``prepared_blocks`` and ``prepared_served``, by hypothesis (``bonus``,
  ``reject@1``, ...): the worker's ``pp1_worker_prepared_blocks_total`` and
  ``pp1_worker_prepared_used_total`` over the run (read before it and after,
  once the worker's counters have settled: the last round's preparation ends
  after the run does), and ``prepared_blocks_total`` and
  ``prepared_served_total``, their sums;
* ``hit_rate`` = ``prepared_served_total`` / ``rounds``: the share of rounds
  whose block was ready when its STEP came;
* ``prepared_use_rate`` = ``prepared_served_total`` /
  ``prepared_blocks_total``: the share of prepared blocks that were served;
* ``hit_rate_by_hypothesis``: per hypothesis prepared in the run, its blocks
  served / its blocks prepared.

``--json`` prints one object: ``cells`` (those figures, each ``{"median",
"min", "max"}``; a figure by hypothesis, one such object per hypothesis,
over the runs that prepared it), ``runs`` (every repetition's raw figures,
from which each one follows) and, for ``benchmarks/run.py``, the keys it
always read, from the repetition with the median dense speedup of the first
vocabulary at t_t = 20 ms (or the first t_t given), of the first t_d, without
preparation.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pp1wire.apps.demo import PAIRS as DEMO_PAIRS
from pp1wire.apps.launch import (
    RunningWorker,
    pinned,
    spark_command,
    split_cores,
    worker_command,
    worker_process,
)
from pp1wire.apps.paced import DRAFTER_MS_ENV, TARGET_MS_ENV
from pp1wire.wire.prepared import MAX_PREPARE

#: Each model pair's paced plugins (``--models``): the drafter of each kind
#: (``--drafter-kind``), then the target; pp1-demo's table, which also names them.
PAIRS = {name: DEMO_PAIRS[name][1:] for name in ("toy", "ngram")}

ROOT = Path(__file__).resolve().parent.parent
VOCABS = (32_000, 129_280)
SUPPORTS = ("dense", "sparse:32")
TARGET_MS = (5.0, 20.0, 50.0)
DRAFTER_MS = 0.5
DEPTH = 5
#: How long a worker's counters may take to settle after a run (they are read then).
SETTLE_S = 10.0


def cores() -> tuple[list[int], list[int]]:
    """The worker's cores and the Spark side's: two halves of this process's (one core: both)."""
    halves = split_cores()
    if halves is None:
        mine = sorted(os.sched_getaffinity(0))
        return mine, mine
    return halves


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``'s live threads, from /proc: each
    thread's ``schedstat`` (nanoseconds; the worker's threads live as long as it does)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that just ended
            continue
    return total / 1e9


_BY_HYPOTHESIS = re.compile(
    r'^pp1_worker_prepared_(blocks|used)_total\{hypothesis="([^"]*)"\} (\S+)$'
)


def worker_counts(worker: RunningWorker) -> dict[str, Any]:
    """The worker's ``pp1_worker_rows_total`` (``rows``) and its prepared blocks and those
    served, by hypothesis (``blocks``, ``used``: ``pp1_worker_prepared_*_total``)."""
    with urllib.request.urlopen(f"http://{worker.metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, Any] = {"rows": 0.0, "blocks": {}, "used": {}}
    for line in text.splitlines():
        if line.startswith("pp1_worker_rows_total "):
            out["rows"] += float(line.rsplit(" ", 1)[1])
        elif (m := _BY_HYPOTHESIS.match(line)) is not None:
            out[m[1]][m[2]] = float(m[3])
    return out


def rows_sent(worker: RunningWorker) -> float:
    """The worker's ``pp1_worker_rows_total``."""
    rows: float = worker_counts(worker)["rows"]
    return rows


def settled_counts(worker: RunningWorker, quiet: float) -> dict[str, Any]:
    """:func:`worker_counts` once they have not moved for ``quiet`` seconds (a preparation
    still running after a run counts in it), or after ``SETTLE_S`` regardless."""
    deadline = time.monotonic() + SETTLE_S
    last = worker_counts(worker)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = worker_counts(worker)
        if now == last:
            break
        last = now
    return last


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: count - before.get(name, 0.0) for name, count in sorted(after.items())}


def spark_run(
    worker: RunningWorker,
    *,
    vocab: int,
    depth: int,
    support: str,
    target_ms: float,
    requests: int,
    tokens: int,
    on: list[int],
    models: str = "toy",
    settle: float | None = None,
) -> dict[str, Any]:
    """One ``pp1-spark`` run: its summary, with the worker's CPU and rows during it. With
    ``settle`` (a preparing worker), also its prepared and served blocks by hypothesis
    (``prepared_blocks``, ``prepared_served``), read once its counters have been still for
    ``settle`` seconds, as its CPU is then."""
    cmd = spark_command(
        worker.address,
        "--target", PAIRS[models][1],
        "--requests", str(requests), "--concurrency", str(requests),
        "--max-tokens", str(tokens), "--depth", str(depth), "--support", support, "--json",
        vocab=vocab,
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", TARGET_MS_ENV: repr(target_ms)}
    before = settled_counts(worker, settle) if settle is not None else worker_counts(worker)
    cpu = process_cpu(worker.process.pid)
    done = subprocess.run(
        pinned(cmd, on), capture_output=True, text=True, timeout=900, env=env, cwd=ROOT, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"pp1-spark exited {done.returncode}: {done.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    after = settled_counts(worker, settle) if settle is not None else worker_counts(worker)
    summary["worker_cpu_seconds"] = process_cpu(worker.process.pid) - cpu
    summary["worker_rows"] = after["rows"] - before["rows"]
    if settle is not None:
        summary["prepared_blocks"] = _delta(after["blocks"], before["blocks"])
        summary["prepared_served"] = _delta(after["used"], before["used"])
    return summary


@contextmanager
def worker_on(
    vocab: int,
    slots: int,
    on: list[int],
    kind: str = "logits",
    drafter_ms: float = DRAFTER_MS,
    models: str = "toy",
    prepare: int = 0,
) -> Iterator[RunningWorker]:
    """``pp1-worker`` with the fixed-cost drafter of pair ``models`` and ``kind``, pinned to
    ``on``, metrics on a free port; with ``prepare``, ``--prepare prepare``."""
    cmd = worker_command(
        "--drafter", PAIRS[models][0][kind], "--max-slots", str(slots),
        "--metrics-port", "0", *(("--prepare", str(prepare)) if prepare else ()),
        vocab=vocab, seed=0,
    )  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",  # no BLAS threads spinning on the worker's CPU
        DRAFTER_MS_ENV: repr(drafter_ms),
    }
    with worker_process(command=pinned(cmd, on), env=env) as worker:
        yield worker


def warm_up_run(
    worker: RunningWorker,
    vocab: int,
    support: str,
    requests: int,
    tokens: int,
    on: list[int],
    models: str,
) -> None:
    """A fresh worker's first run, short (at most 8 tokens a request, t_t = 0) and not
    measured: it pays the first-call costs that no later run pays."""
    spark_run(
        worker, vocab=vocab, depth=DEPTH, support=support, target_ms=0.0,
        requests=requests, tokens=min(tokens, 8), on=on, models=models,
    )  # fmt: skip


def key_of(support: str) -> str:
    """``dense`` / ``sparse32``: a support as a JSON key."""
    return support.replace(":", "")


def figures(
    spec: dict[str, Any],
    plain: dict[str, Any],
    *,
    slots: int,
    target_ms: float,
    drafter_ms: float = DRAFTER_MS,
) -> dict[str, float]:
    """One repetition's figures for a cell, from its speculative and target-only runs."""
    t_t, t_d = target_ms / 1e3, drafter_ms / 1e3
    length = spec["mean_accepted_length"]
    ideal = slots * (length + 1) / (DEPTH * t_d + t_t)
    return {
        "tokens_per_second": spec["tokens_per_second"],
        "target_only_tokens_per_second": plain["tokens_per_second"],
        "speedup": spec["tokens_per_second"] / plain["tokens_per_second"],
        "ideal_tokens_per_second": ideal,
        "ideal_speedup": ideal / (slots / t_t),
        "measured_vs_ideal": spec["tokens_per_second"] / ideal,
        "target_only_vs_ideal": plain["tokens_per_second"] / (slots / t_t),
        "mean_accepted_length": length,
        "acceptance_rate": spec["acceptance_rate"],
        "fill": spec["step_fill"],
        "target_only_fill": plain["step_fill"],
        "round_trip_ms": spec["round_trip_ms_median"] or 0.0,
        # Where a step's time goes: the ideal step is d·t_d + t_t.
        "step_ms": 1e3 * spec["seconds"] / max(1, spec["steps"]),
        "ideal_step_ms": 1e3 * (DEPTH * t_d + t_t),
        "worker_cpu_ms_per_step": 1e3 * spec["worker_cpu_seconds"] / max(1, spec["steps"]),
        "spark_cpu_ms_per_step": 1e3 * spec["cpu_seconds"] / max(1, spec["steps"]),
        "seconds": spec["seconds"],
        "steps": spec["steps"],
        # CPU and what it bought, each side: the figures below are their ratios.
        "worker_cpu_seconds": spec["worker_cpu_seconds"],
        "worker_rows": spec["worker_rows"],
        "spark_cpu_seconds": spec["cpu_seconds"],
        "tokens": spec["tokens"],
        "target_only_spark_cpu_seconds": plain["cpu_seconds"],
        "target_only_tokens": plain["tokens"],
        "worker_cpu_ms_per_row": 1e3 * spec["worker_cpu_seconds"] / max(1.0, spec["worker_rows"]),
        "spark_cpu_ms_per_token": 1e3 * spec["cpu_seconds"] / max(1, spec["tokens"]),
        "target_only_spark_cpu_ms_per_token": 1e3 * plain["cpu_seconds"] / max(1, plain["tokens"]),
        "spark_cpu_ms_per_row": 1e3 * spec["cpu_seconds"] / max(1.0, spec["worker_rows"]),
    }


def prepared_figures(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """A preparing run's own figures (the module docstring's), from it and the run of the
    same cell without preparation in the same repetition."""
    blocks, served = on["prepared_blocks"], on["prepared_served"]
    blocks_total, served_total = sum(blocks.values()), sum(served.values())
    return {
        "on_vs_off": on["tokens_per_second"] / off["tokens_per_second"],
        "rounds": on["rounds"],
        "prepared_blocks": blocks,
        "prepared_served": served,
        "prepared_blocks_total": blocks_total,
        "prepared_served_total": served_total,
        "hit_rate": served_total / max(1, on["rounds"]),
        "prepared_use_rate": served_total / max(1.0, blocks_total),
        "hit_rate_by_hypothesis": {
            name: served.get(name, 0.0) / count for name, count in blocks.items() if count > 0
        },
    }


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median and min-max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_runs(runs: Sequence[dict[str, Any]], skip: Sequence[str]) -> dict[str, Any]:
    """Each figure of ``runs`` (one cell's) but ``skip``, summarized; a figure by hypothesis,
    each hypothesis over the runs that have it."""
    out: dict[str, Any] = {}
    for name, first in runs[0].items():
        if name in skip:
            continue
        if isinstance(first, dict):
            names = sorted({k for r in runs for k in r[name]})
            out[name] = {k: summarize([r[name][k] for r in runs if k in r[name]]) for k in names}
        else:
            out[name] = summarize([r[name] for r in runs])
    return out


def measure(
    *,
    vocabs: Sequence[int] = VOCABS,
    supports: Sequence[str] = SUPPORTS,
    target_ms: Sequence[float] = TARGET_MS,
    requests: int = 8,
    tokens: int = 64,
    reps: int = 3,
    warm_up: bool = True,
    kinds: Sequence[str] = ("logits",),
    floor: bool = True,
    models: Sequence[str] = ("toy",),
    drafter_ms: Sequence[float] = (DRAFTER_MS,),
    prepare: int = 0,
) -> dict[str, Any]:
    """Run the table (see the module docstring) for each pair of ``models`` (``PAIRS``),
    drafter kind and drafter cost (``drafter_ms``), and with ``prepare`` (1 to
    ``MAX_PREPARE``) each speculative cell again against a worker that prepares that many
    blocks; returns ``cells``, ``runs``, ``floors`` and headline keys (from the first
    pair, kind and drafter cost, without preparation).

    With ``warm_up``, each worker's first run (its warm-up) is not measured.

    Raises:
        ValueError: ``prepare`` out of 0 to ``MAX_PREPARE``, or a negative drafter cost.
    """
    if not 0 <= prepare <= MAX_PREPARE:
        raise ValueError(f"prepare must be 0 to {MAX_PREPARE}, not {prepare}")
    if any(not d >= 0 for d in drafter_ms):
        raise ValueError(f"drafter costs must be >= 0 ms, not {list(drafter_ms)}")
    worker_cores, spark_cores = cores()
    runs: list[dict[str, Any]] = []
    modes = (0, prepare) if prepare else (0,)
    combos = [(m, k, v, d) for m in models for k in kinds for v in vocabs for d in drafter_ms]
    for pair, kind, vocab, t_d in combos:
        # The last round's preparation outlasts a run: the counters are read once still
        # for about two preparations' drafter time.
        settle = 0.05 + 2e-3 * prepare * DEPTH * t_d
        with ExitStack() as stack:
            workers = {
                mode: stack.enter_context(
                    worker_on(
                        vocab, requests, worker_cores, kind,
                        drafter_ms=t_d, models=pair, prepare=mode,
                    )
                )
                for mode in modes
            }  # fmt: skip
            if warm_up:
                for worker in workers.values():
                    warm_up_run(worker, vocab, supports[0], requests, tokens, spark_cores, pair)
            order = [
                (t, s, mode)
                for t in target_ms
                for s, mode in [("target_only", 0), *((q, m) for q in supports for m in modes)]
            ]
            for rep in range(reps):
                turn = order[rep % len(order) :] + order[: rep % len(order)]
                got: dict[tuple[float, str, int], dict[str, Any]] = {}
                for t, s, mode in turn:
                    got[t, s, mode] = spark_run(
                        workers[mode],
                        vocab=vocab,
                        depth=0 if s == "target_only" else DEPTH,
                        support="dense" if s == "target_only" else s,
                        target_ms=t,
                        requests=requests,
                        tokens=tokens,
                        on=spark_cores,
                        models=pair,
                        settle=settle if mode else None,
                    )
                for t in target_ms:
                    for s in supports:
                        for mode in modes:
                            run = {
                                "models": pair,
                                "vocab": vocab,
                                "drafter": kind,
                                "drafter_ms": t_d,
                                "q": s,
                                "target_ms": t,
                                "prepare": mode,
                                "rep": rep,
                                **figures(
                                    got[t, s, mode],
                                    got[t, "target_only", 0],
                                    slots=requests,
                                    target_ms=t,
                                    drafter_ms=t_d,
                                ),
                            }
                            if mode:
                                run.update(prepared_figures(got[t, s, mode], got[t, s, 0]))
                            runs.append(run)
    cells = []
    labels = ("models", "vocab", "drafter", "drafter_ms", "target_ms", "q", "prepare")
    for pair, kind, vocab, t_d in combos:
        for t in target_ms:
            for s in supports:
                for mode in modes:
                    at = (pair, vocab, kind, t_d, t, s, mode)
                    mine = [r for r in runs if tuple(r[k] for k in labels) == at]
                    cell: dict[str, Any] = dict(zip(labels, at, strict=True))
                    cell.update(summarize_runs(mine, skip=(*labels, "rep")))
                    cells.append(cell)
    floors = [
        free_model_floor(
            vocab, kind, requests, tokens, reps, worker_cores, spark_cores, pair, warm_up=warm_up
        )
        for pair, kind, vocab in dict.fromkeys((m, k, v) for m, k, v, _ in combos)
        if floor
    ]
    out: dict[str, Any] = {
        "setup": {
            "requests": requests,
            "tokens": tokens,
            "concurrency": requests,
            "depth": DEPTH,
            "drafter_ms": list(drafter_ms),
            "prepare": prepare,
            "reps": reps,
            "worker_cores": worker_cores,
            "spark_cores": spark_cores,
            "drafter_kinds": list(kinds),
            "models": list(models),
        },
        "cells": cells,
        "runs": runs,
        "floors": floors,
    }
    first = [
        r
        for r in runs
        if (r["models"], r["drafter"], r["drafter_ms"], r["prepare"])
        == (models[0], kinds[0], drafter_ms[0], 0)
    ]
    out.update(headline(first, vocabs[0], 20.0 if 20.0 in target_ms else target_ms[0], supports))
    return out


def free_model_floor(
    vocab: int,
    kind: str,
    requests: int,
    tokens: int,
    reps: int,
    worker_cores: list[int],
    spark_cores: list[int],
    models: str = "toy",
    *,
    warm_up: bool = True,
) -> dict[str, Any]:
    """Dense q with free models (t_t = 0, a 0 ms drafter of pair ``models`` and ``kind``):
    what pp1wire itself allows, speculative and target-only, over ``reps`` interleaved
    repetitions. With ``warm_up``, the worker's first run (its warm-up) is not measured,
    as in :func:`measure`."""
    figures_of: dict[str, list[float]] = {}
    with worker_on(vocab, requests, worker_cores, kind, drafter_ms=0.0, models=models) as worker:
        if warm_up:
            warm_up_run(worker, vocab, "dense", requests, tokens, spark_cores, models)
        for _ in range(reps):
            spec, plain = (
                spark_run(
                    worker,
                    vocab=vocab,
                    depth=depth,
                    support="dense",
                    target_ms=0.0,
                    requests=requests,
                    tokens=tokens,
                    on=spark_cores,
                    models=models,
                )
                for depth in (DEPTH, 0)
            )
            rows = max(1.0, spec["worker_rows"])
            for name, value in (
                ("tokens_per_second", spec["tokens_per_second"]),
                ("target_only_tokens_per_second", plain["tokens_per_second"]),
                ("worker_cpu_ms_per_row", 1e3 * spec["worker_cpu_seconds"] / rows),
                ("spark_cpu_ms_per_row", 1e3 * spec["cpu_seconds"] / rows),
                ("mean_accepted_length", spec["mean_accepted_length"]),
            ):
                figures_of.setdefault(name, []).append(value)
    out: dict[str, Any] = {
        "models": models,
        "vocab": vocab,
        "drafter": kind,
        "q": "dense",
        "target_ms": 0.0,
    }
    out.update({name: summarize(values) for name, values in figures_of.items()})
    return out


def headline(
    runs: list[dict[str, Any]], vocab: int, target_ms: float, supports: Sequence[str]
) -> dict[str, Any]:
    """The keys ``benchmarks/run.py`` reads, all from one repetition: the one with the
    median dense speedup (the lower middle for an even count) at ``vocab``, ``target_ms``."""
    first = supports[0]
    at = [r for r in runs if r["vocab"] == vocab and r["target_ms"] == target_ms]
    ranked = sorted((r for r in at if r["q"] == first), key=lambda r: r["speedup"])
    rep = ranked[(len(ranked) - 1) // 2]["rep"]
    chosen = {r["q"]: r for r in at if r["rep"] == rep}
    base = chosen[first]
    out: dict[str, Any] = {
        "headline": {"vocab": vocab, "target_ms": target_ms, "rep": rep},
        "target_only_tokens_per_second": base["target_only_tokens_per_second"],
        "target_only_vs_ideal": base["target_only_vs_ideal"],
        "step_fill": base["fill"],
        "round_trip_ms": base["round_trip_ms"],
        "worker_cpu_ms_per_row": base["worker_cpu_ms_per_row"],
        "spark_cpu_ms_per_token": base["spark_cpu_ms_per_token"],
    }
    for s, r in chosen.items():
        key = key_of(s)
        out[f"{key}_tokens_per_second"] = r["tokens_per_second"]
        out[f"{key}_ideal_tokens_per_second"] = r["ideal_tokens_per_second"]
        out[f"e2e_vs_ideal_{key}"] = r["measured_vs_ideal"]
        out[f"speedup_{key}"] = r["speedup"]
        out[f"{key}_mean_accepted_length"] = r["mean_accepted_length"]
        out[f"{key}_acceptance_rate"] = r["acceptance_rate"]
    return out


def _cell_text(f: dict[str, float], digits: int = 2) -> str:
    return f"{f['median']:.{digits}f} ({f['min']:.{digits}f}-{f['max']:.{digits}f})"


def table(result: dict[str, Any]) -> str:
    """The cells as markdown tables, median (min-max) of the repetitions: those without
    preparation, those with it (``--prepare``) and the free-model floor."""
    head = [
        "| pair | V | drafter | t_d ms | q | t_t ms | speculative / target-only | ideal | "
        "measured / ideal | fill | STEP→proposal ms | step ms (ideal; worker, Spark CPU) | "
        "worker CPU ms/row | Spark CPU ms/row | Spark CPU ms/token (spec, target-only) | L |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = result["cells"]
    for c in (c for c in cells if not c.get("prepare")):
        head.append(
            f"| {c['models']} | {c['vocab']:,} | {c['drafter']} "
            f"| {c.get('drafter_ms', DRAFTER_MS):g} | {c['q']} | {c['target_ms']:g} "
            f"| {_cell_text(c['speedup'])}x "
            f"| {c['ideal_speedup']['median']:.2f}x | {_cell_text(c['measured_vs_ideal'])} "
            f"| {_cell_text(c['fill'])} | {_cell_text(c['round_trip_ms'], 1)} "
            f"| {c['step_ms']['median']:.1f} ({c['ideal_step_ms']['median']:.1f}; "
            f"{c['worker_cpu_ms_per_step']['median']:.1f}, "
            f"{c['spark_cpu_ms_per_step']['median']:.1f}) "
            f"| {_cell_text(c['worker_cpu_ms_per_row'], 3)} "
            f"| {_cell_text(c['spark_cpu_ms_per_row'], 3)} "
            f"| {c['spark_cpu_ms_per_token']['median']:.3f}, "
            f"{c['target_only_spark_cpu_ms_per_token']['median']:.3f} "
            f"| {c['mean_accepted_length']['median']:.2f} |"
        )
    prepared = [c for c in cells if c.get("prepare")]
    if prepared:
        head += [
            "",
            f"With prepared blocks (pp1-worker --prepare {prepared[0]['prepare']}); "
            "hit rate: served / rounds; by hypothesis: served / prepared:",
            "",
            "| pair | V | drafter | t_d ms | q | t_t ms | tokens/s | on / off | "
            "speculative / target-only | measured / ideal | hit rate | by hypothesis |",
            "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for c in prepared:
            hypotheses = ", ".join(
                f"{name} {f['median']:.2f}" for name, f in c["hit_rate_by_hypothesis"].items()
            )
            head.append(
                f"| {c['models']} | {c['vocab']:,} | {c['drafter']} | {c['drafter_ms']:g} "
                f"| {c['q']} | {c['target_ms']:g} | {_cell_text(c['tokens_per_second'], 0)} "
                f"| {_cell_text(c['on_vs_off'])} | {_cell_text(c['speedup'])}x "
                f"| {_cell_text(c['measured_vs_ideal'])} | {_cell_text(c['hit_rate'])} "
                f"| {hypotheses or '-'} |"
            )
    if result["floors"]:
        head += [
            "",
            "Free-model floor (dense, t_t = 0, drafter 0 ms):",
            "",
            "| pair | V | drafter | speculative tokens/s | target-only tokens/s | "
            "worker CPU ms/row | Spark CPU ms/row | L |",
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for f in result["floors"]:
            head.append(
                f"| {f['models']} | {f['vocab']:,} | {f['drafter']} "
                f"| {_cell_text(f['tokens_per_second'], 0)} "
                f"| {_cell_text(f['target_only_tokens_per_second'], 0)} "
                f"| {_cell_text(f['worker_cpu_ms_per_row'], 3)} "
                f"| {_cell_text(f['spark_cpu_ms_per_row'], 3)} "
                f"| {f['mean_accepted_length']['median']:.2f} |"
            )
    return "\n".join(head)


def main() -> None:
    """Measure and print the table (or ``--json``)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS), metavar="V")
    p.add_argument("--support", nargs="+", default=list(SUPPORTS), metavar="dense|sparse:K")
    p.add_argument(
        "--models", nargs="+", choices=list(PAIRS), default=list(PAIRS),
        help="the model pairs: toy (pp1wire.apps.models) and ngram (pp1wire.apps.ngram)",
    )  # fmt: skip
    p.add_argument("--target-ms", type=float, nargs="+", default=list(TARGET_MS), metavar="MS")
    p.add_argument("--requests", type=int, default=8, metavar="N")
    p.add_argument("--max-tokens", type=int, default=64, metavar="TOKENS")
    p.add_argument("--reps", type=int, default=3, metavar="N", help="interleaved repetitions")
    p.add_argument(
        "--drafter-kind",
        choices=("logits", "probs", "both"),
        default="logits",
        help="the paced drafter hands over logits, FP32 probabilities, or each in turn",
    )
    p.add_argument(
        "--drafter-ms", type=float, nargs="+", default=[DRAFTER_MS], metavar="MS",
        help=f"the drafter's cost per call, t_d, each a dimension of the cells (default: "
        f"{DRAFTER_MS})",
    )  # fmt: skip
    p.add_argument(
        "--prepare", type=int, default=0, choices=range(MAX_PREPARE + 1), metavar="N",
        help=f"also run each speculative cell against a worker started with --prepare N "
        f"(1 to {MAX_PREPARE}; 0, the default: none)",
    )  # fmt: skip
    p.add_argument("--no-floor", action="store_true", help="skip the free-model floor")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny table (V = 1,024, t_t = 2 ms, 2 requests x 4 tokens, 2 repetitions, "
        "each size one not given on the command line): checks that the benchmark works",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    if args.smoke:
        tiny = {"vocab": [1024], "target_ms": [2.0], "requests": 2, "max_tokens": 4, "reps": 2}
        for name, value in tiny.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    if any(not d >= 0 for d in args.drafter_ms):
        p.error(f"--drafter-ms: each must be >= 0, not {args.drafter_ms}")
    result = measure(
        vocabs=args.vocab,
        supports=args.support,
        target_ms=args.target_ms,
        requests=args.requests,
        tokens=args.max_tokens,
        reps=args.reps,
        warm_up=not args.smoke,
        kinds=("logits", "probs") if args.drafter_kind == "both" else (args.drafter_kind,),
        floor=not args.no_floor,
        models=args.models,
        drafter_ms=args.drafter_ms,
        prepare=args.prepare,
    )
    if args.json:
        print(json.dumps(result))
        return
    s = result["setup"]
    print(
        f"{s['requests']} requests x {s['tokens']} tokens, concurrency {s['concurrency']}, "
        f"depth {s['depth']}, drafter {', '.join(map(str, s['drafter_ms']))} ms per call; "
        f"worker on cores "
        f"{s['worker_cores']}, pp1-spark on {s['spark_cores']}; median (min-max) of "
        f"{s['reps']} interleaved repetitions\n"
    )
    print(table(result))


if __name__ == "__main__":
    main()
