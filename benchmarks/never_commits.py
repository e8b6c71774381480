"""A peer that never commits: worker memory and a second client's latency under attack.

Run: ``python benchmarks/never_commits.py [--steps N] [--vocab V]``.

Starts ``pp1-worker``, opens a slot from a raw socket, writes ``--steps`` STEPs
for distinct rounds (dense, depth 5) and never reads. Then a second client does
five handshake + OPEN + one-round probes. Prints the worker's RSS before and
after, and the probes' median and maximum. The same probes before the attack
are the baseline, measured in the same run. A worker that draws every STEP
stalls its loop (and grows its output buffers); one that allows one uncommitted
fresh proposal per slot answers the rest with small ERRORs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from pp1wire.apps.launch import worker_process
from pp1wire.testing.attacks import never_reads, probe, rss_mib


def main() -> None:
    """Run the attack once and print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    for flag, kind, default in (
        ("--steps", int, 1000),
        ("--vocab", int, 129_280),
        ("--probe-timeout", float, 120.0),
    ):
        p.add_argument(flag, type=kind, default=default)
    p.add_argument("--same-round", action="store_true", help="repeat one round (replays) instead")
    args = p.parse_args()
    with worker_process(vocab=args.vocab) as worker:
        pid = worker.process.pid
        base_rss = rss_mib(pid)

        async def probes() -> list[float]:
            return [
                await asyncio.wait_for(probe(worker.port, args.vocab), args.probe_timeout)
                for _ in range(5)
            ]

        before = asyncio.run(probes())
        sock = never_reads(worker.port, args.vocab, args.steps, same_round=args.same_round)
        time.sleep(0.5)
        try:
            during = asyncio.run(probes())
        except TimeoutError:
            during = [float("inf")]
        time.sleep(2.0)
        after_rss = rss_mib(pid)
        sock.close()
    kind = "identical (replayed)" if args.same_round else "uncommitted"
    print(f"{args.steps} {kind} STEPs, vocab {args.vocab}")
    print(f"worker RSS: {base_rss:.0f} MiB before, {after_rss:.0f} MiB after")
    medians = {}
    for name, xs in (("baseline", before), ("under attack", during)):
        medians[name] = statistics.median(xs)
        print(f"probe {name}: median {medians[name] * 1e3:.1f} ms, max {max(xs) * 1e3:.1f} ms")
    ratio = medians["under attack"] / medians["baseline"]
    print(f"ratio (under attack / baseline, medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
