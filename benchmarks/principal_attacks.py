"""Attacks that budgets on the connection did not stop: a legitimate ``pp1-spark`` beside them.

Run: ``python benchmarks/principal_attacks.py [--attack NAME ...] [--acceptance] [FLAG ...]``.

Starts ``pp1-worker`` (its defaults, plus any flags given after the options)
and, for each attack, runs a legitimate ``pp1-spark --json`` from 127.0.0.1
alone (the baseline) and while the attack runs from 127.0.0.2 (other
principals, lineages of another source address, which share the draw threads
apart from the client's),
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

``--acceptance`` runs instead the scenarios of :data:`SCENARIOS`, every one
from the legitimate client's own address (127.0.0.1): with distinct keys for
the attacker and the client (a key table on the worker, each side its own key),
the ``reconnect`` and ``reject`` loops with no setting and with the cap the
docs/operators.md §3 recommends (:data:`RECOMMENDED_CAP`); and without keys the ``reconnect``
loop. It prints each scenario's per-pair ratios (median, min-max, goal), and
the ratio of the legitimate runs' whole wall-clock times (process start,
connection and handshake included) beside them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pp1wire.apps import worker as worker_app
from pp1wire.apps.launch import spark_command, worker_process
from pp1wire.testing.attacks import Key, commit_loop, reset_step_loop, squat

ATTACKER = "127.0.0.2"
LEGIT = "127.0.0.1"
#: The cap docs/operators.md §3 recommends: every principal 2 fresh draws a
#: second, and no cap for the key of the operator's own Spark side.
RECOMMENDED_CAP = ["--principal-rate", "2", "client=off"]
#: --acceptance: (attack, keys, cap, goal): each loop from the client's own address.
SCENARIOS: dict[str, tuple[str, bool, bool, float]] = {
    "keyed_reconnect": ("reconnect", True, False, 0.45),
    "keyed_reconnect_capped": ("reconnect", True, True, 0.8),
    "keyed_reject": ("reject", True, False, 0.45),
    "keyed_reject_capped": ("reject", True, True, 0.8),
    "keyless_same_address_reconnect": ("reconnect", False, False, 0.8),
}


def _attack(
    name: str,
    port: int,
    args: argparse.Namespace,
    running: Any,
    stop: Any,
    ready: Any,
    out: Any,
    source: str = ATTACKER,
    key: Key | None = None,
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
            source=source,
            same_round=name == "reject",
            key=key,
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
            source=source,
            reconnect=True,
            key=key,
        )
    out.put(result)


def _spark(
    address: str, args: argparse.Namespace, extra: list[str] | None = None
) -> dict[str, Any]:
    cmd = spark_command(
        address,
        "--json",
        "--requests",
        str(args.requests),
        "--max-tokens",
        str(args.max_tokens),
        *(extra or []),
        vocab=args.vocab,
    )
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    wall = time.perf_counter() - started
    line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
    summary: dict[str, Any] = json.loads(line) if line else {}
    summary["exit"] = done.returncode
    summary["wall_seconds"] = wall
    if done.returncode:
        summary["stderr"] = done.stderr[-400:]
    return summary


def _measure(
    name: str,
    args: argparse.Namespace,
    flags: list[str],
    ctx: Any,
    *,
    source: str = ATTACKER,
    key: Key | None = None,
    spark_flags: list[str] | None = None,
) -> dict[str, Any]:
    """One worker; ``--pairs`` legitimate runs alone and beside the attack, interleaved
    (the squatters, which hold the worker, beside one run). The attack connects from
    ``source`` (with ``key``); the legitimate runs take ``spark_flags``."""
    alone: list[dict[str, Any]] = []
    beside: list[dict[str, Any]] = []
    attack_s = 0.0
    with worker_process(*flags, vocab=args.vocab, seed=0) as worker:
        running, stop, ready, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
        attacker = ctx.Process(
            target=_attack,
            args=(name, worker.port, args, running, stop, ready, out, source, key),
            daemon=True,
        )
        pairs = 1 if name == "squat" else args.pairs
        try:
            if name != "squat":
                attacker.start()
                if not ready.wait(60):
                    raise SystemExit(f"{name}: the attacker could not connect")
            for _ in range(pairs):
                alone.append(_spark(worker.address, args, spark_flags))
                if name == "squat":
                    attacker.start()
                    if not ready.wait(60):
                        raise SystemExit(f"{name}: the squatters could not connect")
                    time.sleep(args.squat_settle)
                t0 = time.perf_counter()
                running.set()
                if name != "squat":
                    time.sleep(args.settle)
                beside.append(_spark(worker.address, args, spark_flags))
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
    walls = [
        a["wall_seconds"] / b["wall_seconds"] for a, b in zip(alone, beside, strict=True)
    ]
    return {
        "flags": flags,
        "alone": alone,
        "beside": beside,
        "ratios": ratios,
        "wall_ratios": walls,
        "attack_seconds": attack_s,
        "attacker_draws": drawn,
        "attacker_refused": refused,
    }


def _acceptance(args: argparse.Namespace, worker_flags: list[str], ctx: Any) -> dict[str, Any]:
    """Every scenario of :data:`SCENARIOS`, each on a worker of its own."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        client, attacker = secrets.token_hex(32), secrets.token_hex(32)
        table = Path(tmp, "keys")
        table.write_text(f"pp1-keys-v1\nclient {client}\nattacker {attacker}\n")
        mine = Path(tmp, "client.key")  # the client's one key, sent under its ID
        mine.write_text(client + "\n")
        for scenario, (attack, keyed, capped, goal) in SCENARIOS.items():
            flags = list(worker_flags)
            key = None
            spark_flags: list[str] = []
            if keyed:
                flags += ["--psk-file", str(table)]
                key = Key(attacker.encode(), "attacker")
                spark_flags = ["--psk-file", str(mine), "--key-id", "client"]
            if capped:
                flags += RECOMMENDED_CAP
            res = _measure(
                attack, args, flags, ctx, source=LEGIT, key=key, spark_flags=spark_flags
            )
            res["goal"] = goal
            results[scenario] = res
            if not args.json:
                _print_acceptance(scenario, res)
    return results


def _spread(values: list[float]) -> str:
    if not values:
        return "no pairs"
    return f"median {statistics.median(values):.2f} (min-max {min(values):.2f}-{max(values):.2f})"


def _print_runs(
    res: dict[str, Any], detail: Callable[[dict[str, Any]], str], *, tokens_first: bool = False
) -> None:
    """One line for each legitimate run alone and beside the attack: its exit status,
    ``detail(run)`` (before the tokens/s, or after them with ``tokens_first``), its
    fallbacks, and its stderr if it failed."""
    for label in ("alone", "beside"):
        for run in res[label]:
            rate = f"{run.get('tokens_per_second', 0.0):.1f} tokens/s, "
            middle = rate + detail(run) if tokens_first else detail(run) + rate
            print(
                f"  legitimate run {label}: exit {run['exit']}, {middle}"
                f"fallbacks {run.get('fallbacks_by_reason', {})}"
                + (f"\n    {run['stderr']!r}" if "stderr" in run else "")
            )


def _print_acceptance(scenario: str, res: dict[str, Any]) -> None:
    ratios, goal = res["ratios"], res["goal"]
    met = bool(ratios) and statistics.median(ratios) >= goal
    print(f"{scenario}: worker flags {' '.join(res['flags']) or '(defaults)'}")
    _print_runs(res, lambda run: f"{run['wall_seconds']:.2f} s wall, ", tokens_first=True)
    verdict = "met" if met else "NOT met"
    print(f"  tokens/s beside / alone: {_spread(ratios)}, goal >= {goal}: {verdict}")
    print(f"  wall time alone / beside: {_spread(res['wall_ratios'])}")
    seconds, drawn = res["attack_seconds"], res["attacker_draws"]
    print(
        f"  attacker over {seconds:.1f} s: {drawn} fresh draws "
        f"({drawn / max(seconds, 1e-9):.1f}/s), "
        f"{res['attacker_refused']} STEPs refused DRAW_RATE_LIMITED"
    )
    sys.stdout.flush()


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
    p.add_argument(
        "--acceptance",
        action="store_true",
        help="run the scenarios of SCENARIOS instead (keys, the recommended cap, the same "
        "address)",
    )
    args, worker_flags = p.parse_known_args()
    worker_args = worker_app.build_parser().parse_args(worker_flags)
    limits = worker_app.config_from(worker_args)
    if args.squat_settle is None:
        args.squat_settle = worker_args.slot_idle_timeout + 1.0
    ctx = multiprocessing.get_context("spawn")
    if args.acceptance:
        accepted = _acceptance(args, worker_flags, ctx)
        if args.json:
            print(json.dumps(accepted))
        return
    results: dict[str, Any] = {}
    for name in args.attack or ["squat", "commit", "reject", "reconnect"]:
        flags = list(worker_flags)
        if name == "squat":
            flags += ["--max-connections", str(args.squatters)]
        res = results[name] = _measure(name, args, flags, ctx)
        if args.json:
            continue
        print(f"{name}: worker flags {' '.join(flags) or '(defaults)'}, vocab {args.vocab}")
        _print_runs(res, lambda run: f"{run.get('finished', 0)}/{args.requests} finished, ")
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
