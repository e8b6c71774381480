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
import socket
import statistics
import time
from pathlib import Path

import msgspec

from pp1wire.aio.client import AsyncClient
from pp1wire.apps.launch import worker_process
from pp1wire.wire import framing
from pp1wire.wire.spark_core import SparkConfig, SparkProtocol


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def attack(port: int, vocab: int, steps: int) -> socket.socket:
    """Open slot 0 and write ``steps`` distinct-round STEPs; the socket is never read again."""
    sock = socket.create_connection(("127.0.0.1", port))
    core = SparkProtocol(SparkConfig(vocab_size=vocab), now=0.0)
    core.start(0.0)

    def pump() -> None:
        for chunk in core.data_to_send():
            sock.sendall(chunk)
        sock.settimeout(0.5)
        try:
            while data := sock.recv(1 << 20):
                core.receive_data(data, 0.0)
        except TimeoutError:
            pass

    pump()
    core.open_slot(0, seed=1, prefix=[1, 2, 3])
    pump()
    core.step(0, depth=5, temperature=1.0, support=0, now=0.0)
    (frame,) = framing.FrameDecoder(1 << 20).feed(b"".join(core.data_to_send()))
    sock.sendall(
        b"".join(
            framing.encode_frame(msgspec.structs.replace(frame.message, round=r))
            for r in range(steps)
        )
    )
    return sock


async def probe(port: int, vocab: int) -> float:
    """Seconds for handshake + OPEN + one dense depth-5 round from a fresh client."""
    started = time.perf_counter()
    client = await AsyncClient.connect("127.0.0.1", port, SparkConfig(vocab_size=vocab))
    await client.open(0, seed=2, prefix=[1, 2])
    proposal = await client.propose(0, depth=5)
    client.release(proposal, 0)
    await client.close()
    return time.perf_counter() - started


def main() -> None:
    """Run the attack once and print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    for flag, kind, default in (
        ("--steps", int, 1000),
        ("--vocab", int, 129_280),
        ("--probe-timeout", float, 120.0),
    ):
        p.add_argument(flag, type=kind, default=default)
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
        sock = attack(worker.port, args.vocab, args.steps)
        time.sleep(0.5)
        try:
            during = asyncio.run(probes())
        except TimeoutError:
            during = [float("inf")]
        time.sleep(2.0)
        after_rss = rss_mib(pid)
        sock.close()
    print(f"{args.steps} uncommitted STEPs, vocab {args.vocab}")
    print(f"worker RSS: {base_rss:.0f} MiB before, {after_rss:.0f} MiB after")
    medians = {}
    for name, xs in (("baseline", before), ("under attack", during)):
        medians[name] = statistics.median(xs)
        print(f"probe {name}: median {medians[name] * 1e3:.1f} ms, max {max(xs) * 1e3:.1f} ms")
    ratio = medians["under attack"] / medians["baseline"]
    print(f"ratio (under attack / baseline, medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
