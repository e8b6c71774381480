"""Round-trip time of proposal rounds between real daemons on loopback.

Run: ``python benchmarks/rtt.py [--rounds N] [--json]``.

Starts ``pp1-worker`` (toy drafter, vocabulary 129,280) as a subprocess and
measures, with the embeddable client, the median time from sending STEP to
holding a fully validated proposal:

* ``dense4_fresh``: 4 requests at once, depth 5, dense q: the worker draws
  and builds every row (drafter + q construction included).
* ``dense4_replay``: the same STEPs retried: the worker answers from its replay
  cache, so this is transport plus Spark-side validation only (10.3 MB of q).
* ``sparse32_fresh`` / ``sparse32_replay``: one request, depth 5, top-32 q.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from pp1wire import framing
from pp1wire.client import AsyncClient
from pp1wire.fencing import SparkInFlight
from pp1wire.spark_core import SparkConfig, _Flight

VOCAB = 129_280


def start_worker() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pp1wire.worker",
            "--port",
            "0",
            "--vocab",
            str(VOCAB),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.rsplit(" ", 1)[1].strip()


async def replay(client: AsyncClient, slots: list[int], steps: dict[int, object]) -> None:
    """Re-send each slot's last STEP unchanged and wait for the validated replies."""
    core = client.core
    futs = []
    for slot in slots:
        step = steps[slot]
        state = core.slots[slot]
        state.flight = _Flight(step=step, deadline=time.monotonic() + 30)  # type: ignore[arg-type]
        state.fence.in_flight = SparkInFlight(step.generation, step.round)  # type: ignore[attr-defined]
        fut = client.loop.create_future()
        client._proposals[slot] = fut
        core._out.append(framing.encode_frame(step))  # type: ignore[arg-type]
        futs.append(fut)
    client._flush()
    for p, slot in zip(await asyncio.gather(*futs), slots, strict=True):
        client.release(p, slot)


async def measure(address: str, rounds: int) -> dict[str, list[float]]:
    host, port = address.rsplit(":", 1)
    client = await AsyncClient.connect(
        host, int(port), SparkConfig(vocab_size=VOCAB, max_support=32)
    )
    for slot in range(4):
        await client.open(slot, seed=slot, prefix=[1, 2, 3])
    out: dict[str, list[float]] = {
        k: [] for k in ("dense4_fresh", "dense4_replay", "sparse32_fresh", "sparse32_replay")
    }

    async def fresh(slots: list[int], support: int) -> None:
        proposals = await asyncio.gather(
            *(client.propose(s, depth=5, support=support) for s in slots)
        )
        for p, s in zip(proposals, slots, strict=True):
            client.release(p, s)

    last_step: dict[int, object] = {}
    original = client.core.step

    def spy(slot: int, **kw: object) -> int:
        r = original(slot, **kw)  # type: ignore[arg-type]
        last_step[slot] = client.core.slots[slot].flight.step  # type: ignore[union-attr]
        return r

    client.core.step = spy  # type: ignore[method-assign]
    for i in range(rounds + 2):
        t0 = time.perf_counter()
        await fresh([0, 1, 2, 3], 0)
        t1 = time.perf_counter()
        await replay(client, [0, 1, 2, 3], last_step)
        t2 = time.perf_counter()
        await fresh([0], 32)
        t3 = time.perf_counter()
        await replay(client, [0], last_step)
        t4 = time.perf_counter()
        if i >= 2:  # warm-up
            out["dense4_fresh"].append(t1 - t0)
            out["dense4_replay"].append(t2 - t1)
            out["sparse32_fresh"].append(t3 - t2)
            out["sparse32_replay"].append(t4 - t3)
    await client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    proc, address = start_worker()
    try:
        res = asyncio.run(measure(address, args.rounds))
    finally:
        proc.terminate()
        proc.wait()
    summary = {
        k: {
            "median_ms": statistics.median(v) * 1e3,
            "min_ms": min(v) * 1e3,
            "max_ms": max(v) * 1e3,
            "n": len(v),
        }
        for k, v in res.items()
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"loopback proposal round trips, vocabulary {VOCAB}, depth 5 ({args.rounds} rounds)")
    for k, v in summary.items():
        print(
            f"  {k:18s} median {v['median_ms']:8.3f} ms   [{v['min_ms']:.3f} .. {v['max_ms']:.3f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
