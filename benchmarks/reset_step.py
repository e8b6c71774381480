"""A RESET/STEP loop on every slot of several connections: a legitimate round's latency.

Run: ``python benchmarks/reset_step.py [--vocab V] [--pairs N] [--rounds M] [WORKER FLAG ...]``.

Starts ``pp1-worker`` (its defaults, plus any flags given after the options) and
a legitimate client holding one slot (from 127.0.0.1). Another process runs the
attack from :func:`pp1wire.testing.attacks.reset_step_loop` (from 127.0.0.2, another
principal): ``--connections`` connections x ``--slots`` slots, each slot looping
STEP -> read the reply -> RESET -> STEP,
so every STEP is a fresh dense depth-5 draw. The legitimate client measures
``--rounds`` rounds (a dense depth-5 proposal, then a COMMIT of its round) with
the attack paused, then as many with it running, ``--pairs`` times,
interleaved; the first rounds after each switch are not counted (the attack
settles in or drains).

Two legitimate clients are measured, one after the other:

* ``spark-like``: between rounds it waits as long as a round took without the
  attack (a Spark side scoring the proposal with a target as costly as the
  drafter), so it asks for less than its share of the draw threads. This is
  the figure the goal (<= 1.5x) is about.
* ``back-to-back``: it asks for its next proposal at once, wanting a draw
  thread all the time. Shared fairly with N busy connections it gets about
  1/(N + 1) of the threads, whatever the scheduler: this ratio shows the share,
  not a delay one peer imposes on another.

Prints each phase's median round, the median of the per-pair ratios (under
attack / baseline) with their range, and the attack's fresh draws and
refusals per second.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from typing import Any

from pp1wire.aio.client import AsyncClient
from pp1wire.apps.launch import worker_process
from pp1wire.apps.metrics import scrape_page
from pp1wire.testing.attacks import reset_step_loop
from pp1wire.wire.spark_core import SparkConfig

SETTLE_ROUNDS = 2
# The attack's source address: a principal apart from the legitimate client's 127.0.0.1,
# whose budgets and share of the draw threads it would otherwise be spending.
ATTACKER = "127.0.0.2"


def _attack(
    port: int, vocab: int, connections: int, slots: int, running: Any, stop: Any, ready: Any
) -> None:
    reset_step_loop(
        port,
        vocab,
        connections=connections,
        slots=slots,
        running=running,
        stop=stop,
        ready=ready.set,
        source=ATTACKER,
    )


def _counter(page: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name) and (not label or label in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _rounds(client: AsyncClient, n: int, think: float) -> list[float]:
    out = []
    for i in range(n + SETTLE_ROUNDS):
        started = time.perf_counter()
        round_id = client.next_round(0)
        proposal = await client.propose(0, round_id=round_id, depth=5)
        took = time.perf_counter() - started
        client.release(proposal)
        # The round it stepped, accepting nothing: a COMMIT of a later round would
        # throw the draw away, which the worker counts against the abandon budget.
        await client.commit(0, round_id=round_id, tokens=[10 + i % 50], accepted=0)
        if i >= SETTLE_ROUNDS:
            out.append(took)
        if think:
            await asyncio.sleep(think)  # the Spark side's target, scoring the proposal
    return out


Phases = tuple[list[list[float]], list[list[float]], list[float]]


def main() -> None:
    """Run the interleaved measurement once and print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--pairs", type=int, default=3, help="baseline/attack phase pairs")
    p.add_argument("--rounds", type=int, default=8, help="rounds measured per phase")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    args, worker_flags = p.parse_known_args()
    ctx = multiprocessing.get_context("spawn")
    running, stop, ready = ctx.Event(), ctx.Event(), ctx.Event()
    with worker_process("--metrics-port", "0", *worker_flags, vocab=args.vocab, seed=0) as worker:
        assert worker.metrics is not None
        attacker = ctx.Process(
            target=_attack,
            args=(worker.port, args.vocab, args.connections, args.slots, running, stop, ready),
            daemon=True,
        )
        attacker.start()
        if not ready.wait(60):
            raise SystemExit("the attacker could not connect")

        async def measure(think: float | None) -> tuple[Phases, float]:
            client = await AsyncClient.connect(
                "127.0.0.1", worker.port, SparkConfig(vocab_size=args.vocab, max_slots=1)
            )
            await client.open(0, seed=7, prefix=[4, 5, 6])
            if think is None:  # spark-like: wait as long as a quiet round takes
                think = statistics.median(await _rounds(client, args.rounds, 0.0))
            base, attacked, draws = [], [], [0.0, 0.0, 0.0]
            for _ in range(args.pairs):
                running.clear()
                base.append(await _rounds(client, args.rounds, think))
                before = scrape_page(worker.metrics or "")
                t0 = time.perf_counter()
                running.set()
                attacked.append(await _rounds(client, args.rounds, think))
                seconds = time.perf_counter() - t0
                after = scrape_page(worker.metrics or "")
                steps = _counter(after, "pp1_worker_steps_total") - _counter(
                    before, "pp1_worker_steps_total"
                )
                limited = _counter(
                    after, "pp1_worker_refusals_total", 'code="draw_rate_limited"'
                ) - _counter(before, "pp1_worker_refusals_total", 'code="draw_rate_limited"')
                draws[0] += steps - args.rounds - SETTLE_ROUNDS
                draws[1] += limited
                draws[2] += seconds
            running.clear()
            await client.close()
            return (base, attacked, draws), think

        try:
            results = {
                "spark-like": asyncio.run(measure(None)),
                "back-to-back": asyncio.run(measure(0.0)),
            }
        finally:
            stop.set()
            running.set()
            attacker.join(30)
            if attacker.is_alive():
                attacker.kill()
    flags = " ".join(worker_flags) or "(defaults)"
    print(
        f"RESET/STEP loop: {args.connections} connections x {args.slots} slots, "
        f"vocab {args.vocab}, worker flags {flags}"
    )
    for mode, ((base, attacked, draws), think) in results.items():
        ratios = [
            statistics.median(a) / statistics.median(b) for a, b in zip(attacked, base, strict=True)
        ]
        print(f"{mode} client (waits {think * 1e3:.0f} ms between rounds):")
        for name, phases in (("baseline", base), ("under attack", attacked)):
            flat = [x for phase in phases for x in phase]
            print(
                f"  round {name}: median {statistics.median(flat) * 1e3:.1f} ms, "
                f"max {max(flat) * 1e3:.1f} ms ({len(flat)} rounds)"
            )
        goal = "; goal <= 1.5" if mode == "spark-like" else ""
        print(
            f"  ratio under attack / baseline (median of {len(ratios)} pairs): "
            f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}{goal})"
        )
        print(
            f"  attack: {draws[0] / draws[2]:.1f} fresh draws/s, "
            f"{draws[1] / draws[2]:.1f} STEPs/s refused DRAW_RATE_LIMITED"
        )


if __name__ == "__main__":
    main()
