"""Attacks that budgets on the connection did not stop: a legitimate ``pp1-spark`` beside them.

Run: ``python benchmarks/principal_attacks.py [--attack NAME ...] [--seconds S] [WORKER FLAG ...]``.

Starts ``pp1-worker`` (its defaults, plus any flags given after the options)
and, for each attack, runs a legitimate ``pp1-spark --json`` from 127.0.0.1
alone (the baseline) and while the attack runs from 127.0.0.2 (another
principal: the worker keys budgets and draw shares by source address),
``--pairs`` times interleaved, in the same invocation (the attack pauses
during a baseline run). The attacks (``pp1wire.testing.attacks``):

* ``squat``: ``--squatters`` peers each hold a connection with one slot open and
  COMMIT one token of a round never stepped every ``--period`` seconds (a
  target-only COMMIT, no draw), reconnecting at once when closed; the worker
  runs with ``--max-connections`` = squatters. One pair: the legitimate run
  starts ``--squat-settle`` s after them, and must complete.
* ``commit``: ``--connections`` x ``--slots`` slots loop STEP round r -> COMMIT
  of round r + 1, never stepped (target-only) -> STEP round r + 2: every draw
  thrown away by a COMMIT passing over it (the abandon budget counts those).
* ``reject``: the same slots loop STEP round r -> COMMIT of round r with no draft
  accepted -> STEP round r + 1: what a Spark side whose target rejects every first
  draft sends, bounded only by the attacker's share of the draw threads.
* ``reconnect``: the RESET/STEP loop, on one connection with ``--slots`` slots,
  that reconnects at once whenever a STEP is refused ``DRAW_RATE_LIMITED``.

Prints for each: the legitimate runs' tokens per second alone and beside the
attack, the median and range of the per-pair ratios (the goal is >= 0.8),
whether they completed, and the attacker's fresh draws and refusals while it
ran (with, for ``reconnect``, the most the abandon budget lets one principal
draw in that time; ``commit`` is counted only while another principal draws,
so it draws freely in the seconds around each legitimate run). ``--json``
prints all of it as one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from pp1wire.apps import worker as worker_app
from pp1wire.apps.launch import spark_command, worker_process
from pp1wire.testing.attacks import commit_loop, reset_step_loop, squat

ATTACKER = "127.0.0.2"


def _attack(
    name: str, port: int, args: argparse.Namespace, running: Any, stop: Any, ready: Any, out: Any
) -> None:
    if name == "squat":
        # One process, one thread per squatter: each holds its own connection.
        counts: list[int] = []
        started = [threading.Event() for _ in range(args.squatters)]

        def one(i: int) -> None:
            counts.append(
                squat(
                    port,
                    args.vocab,
                    period=args.period,
                    stop=stop,
                    source=ATTACKER,
                    ready=started[i].set,
                )
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.squatters)]
        for t in threads:
            t.start()
        for e in started:
            e.wait(30)
        ready.set()
        for t in threads:
            t.join()
        out.put((0, sum(counts)))
        return
    if name in ("commit", "reject"):
        result = commit_loop(
            port,
            args.vocab,
            connections=args.connections,
            slots=args.slots,
            running=running,
            stop=stop,
            ready=ready.set,
            source=ATTACKER,
            same_round=name == "reject",
        )
    else:
        result = reset_step_loop(
            port,
            args.vocab,
            connections=1,
            slots=args.slots,
            running=running,
            stop=stop,
            ready=ready.set,
            source=ATTACKER,
            reconnect=True,
        )
    out.put(result)


def _spark(address: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = spark_command(
        address,
        "--json",
        "--requests",
        str(args.requests),
        "--max-tokens",
        str(args.max_tokens),
        vocab=args.vocab,
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
    summary: dict[str, Any] = json.loads(line) if line else {}
    summary["exit"] = done.returncode
    if done.returncode:
        summary["stderr"] = done.stderr[-400:]
    return summary


def _measure(name: str, args: argparse.Namespace, flags: list[str], ctx: Any) -> dict[str, Any]:
    """One worker; ``--pairs`` legitimate runs alone and beside the attack, interleaved
    (the squatters, which hold the worker, beside one run)."""
    alone: list[dict[str, Any]] = []
    beside: list[dict[str, Any]] = []
    attack_s = 0.0
    with worker_process(*flags, vocab=args.vocab, seed=0) as worker:
        running, stop, ready, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
        attacker = ctx.Process(
            target=_attack,
            args=(name, worker.port, args, running, stop, ready, out),
            daemon=True,
        )
        pairs = 1 if name == "squat" else args.pairs
        try:
            if name != "squat":
                attacker.start()
                if not ready.wait(60):
                    raise SystemExit(f"{name}: the attacker could not connect")
            for _ in range(pairs):
                alone.append(_spark(worker.address, args))
                if name == "squat":
                    attacker.start()
                    if not ready.wait(60):
                        raise SystemExit(f"{name}: the squatters could not connect")
                    time.sleep(args.squat_settle)
                t0 = time.perf_counter()
                running.set()
                if name != "squat":
                    time.sleep(args.settle)
                beside.append(_spark(worker.address, args))
                running.clear()
                attack_s += time.perf_counter() - t0
        finally:
            stop.set()
            running.set()
            attacker.join(60)
            if attacker.is_alive():
                attacker.kill()
        try:
            drawn, refused = out.get(timeout=10)
        except queue.Empty:
            drawn, refused = -1, -1
    ratios = [
        b.get("tokens_per_second", 0.0) / a["tokens_per_second"]
        for a, b in zip(alone, beside, strict=True)
        if a.get("tokens_per_second")
    ]
    return {
        "flags": flags,
        "alone": alone,
        "beside": beside,
        "ratios": ratios,
        "attack_seconds": attack_s,
        "attacker_draws": drawn,
        "attacker_refused": refused,
    }


def main() -> None:
    """Run each attack beside a legitimate run, and print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--attack", action="append", choices=["squat", "commit", "reject", "reconnect"]
    )
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pairs", type=int, default=3, help="alone/beside run pairs per loop")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--squatters", type=int, default=4)
    p.add_argument("--period", type=float, default=5.0, help="a squatter's COMMIT period, s")
    p.add_argument("--settle", type=float, default=1.0, help="attack time before a run, s")
    p.add_argument(
        "--squat-settle",
        type=float,
        default=None,
        help="squatting time before the run, s (default: the worker's --slot-idle-timeout "
        "+ 1, past it)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args, worker_flags = p.parse_known_args()
    worker_args = worker_app.build_parser().parse_args(worker_flags)
    limits = worker_app.config_from(worker_args)
    if args.squat_settle is None:
        args.squat_settle = worker_args.slot_idle_timeout + 1.0
    ctx = multiprocessing.get_context("spawn")
    results: dict[str, Any] = {}
    for name in args.attack or ["squat", "commit", "reject", "reconnect"]:
        flags = list(worker_flags)
        if name == "squat":
            flags += ["--max-connections", str(args.squatters)]
        res = results[name] = _measure(name, args, flags, ctx)
        if args.json:
            continue
        print(f"{name}: worker flags {' '.join(flags) or '(defaults)'}, vocab {args.vocab}")
        for label in ("alone", "beside"):
            for run in res[label]:
                print(
                    f"  legitimate run {label}: exit {run['exit']}, "
                    f"{run.get('finished', 0)}/{args.requests} finished, "
                    f"{run.get('tokens_per_second', 0.0):.1f} tokens/s, "
                    f"fallbacks {run.get('fallbacks_by_reason', {})}"
                    + (f"\n    {run['stderr']!r}" if "stderr" in run else "")
                )
        ratios = res["ratios"]
        if ratios:
            print(
                f"  ratio beside the attack / alone: median {statistics.median(ratios):.2f} "
                f"(range {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs; goal >= 0.8)"
            )
        seconds, drawn = res["attack_seconds"], res["attacker_draws"]
        if name == "squat":
            print(f"  squatters closed by the worker: {res['attacker_refused']}")
            continue
        print(
            f"  attacker over {seconds:.1f} s: {drawn} fresh draws ({drawn / seconds:.1f}/s), "
            f"{res['attacker_refused']} STEPs refused DRAW_RATE_LIMITED"
        )
        if name == "reconnect" and limits.abandon_rate is not None:
            # Each phase starts with the burst paid back, and each slot's first draw is
            # abandoned only by the RESET after it.
            bound = len(res["beside"]) * (limits.abandon_burst + args.slots)
            bound += limits.abandon_rate * seconds
            print(f"  the abandon budget allows one principal {bound:.0f} in that time")
        elif name == "commit":
            print(
                "  (a draw passed over counts only while another principal draws: the "
                "attack draws freely before and between the legitimate runs)"
            )
        sys.stdout.flush()
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
