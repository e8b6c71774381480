"""Round-trip time of proposal rounds between real daemons on loopback.

Run: ``python benchmarks/rtt.py [--rounds N] [--json]``.

Starts ``pp1-worker`` (toy drafter, vocabulary 129,280) and measures, with the
embeddable client, the median time from sending STEP to holding a fully
validated proposal:

* ``dense4_fresh``: 4 requests at once, depth 5, dense q: the worker draws and
  builds every row (drafter and q construction included).
* ``dense4_replay``: the same STEPs retried: the worker answers from its replay
  cache, so this is transport plus Spark-side validation only (10.3 MB of q).
* ``sparse32_fresh`` / ``sparse32_replay``: one request, depth 5, top-32 q.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import DENSE_SLOTS, SPARSE_SLOT, VOCAB, Pp1

from pp1wire.apps.launch import worker_process
from pp1wire.apps.settings import install_uvloop


async def measure(port: int, rounds: int) -> dict[str, list[float]]:
    pp1 = await Pp1.setup(port)
    client = pp1.client
    out: dict[str, list[float]] = {
        k: [] for k in ("dense4_fresh", "dense4_replay", "sparse32_fresh", "sparse32_replay")
    }

    async def fresh(slots: list[int], support: int) -> None:
        proposals = await asyncio.gather(
            *(
                client.propose(s, round_id=client.next_round(s), depth=5, support=support)
                for s in slots
            )
        )
        for p in proposals:
            client.release(p)

    async def reset_all() -> None:
        # One fresh proposal per slot until COMMIT or RESET (STEP_UNCOMMITTED):
        # a RESET, untimed, lets the next round draw afresh.
        for slot in [*DENSE_SLOTS, SPARSE_SLOT]:
            await client.reset(slot)

    await reset_all()  # setup drew one proposal per slot
    for i in range(rounds + 2):
        t0 = time.perf_counter()
        await fresh(DENSE_SLOTS, 0)
        t1 = time.perf_counter()
        await pp1.replay(DENSE_SLOTS)
        t2 = time.perf_counter()
        await fresh([SPARSE_SLOT], 32)
        t3 = time.perf_counter()
        await pp1.replay([SPARSE_SLOT])
        t4 = time.perf_counter()
        await reset_all()
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
    install_uvloop()
    with worker_process("--max-slots", "8", vocab=VOCAB) as worker:
        res = asyncio.run(measure(worker.port, args.rounds))
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
