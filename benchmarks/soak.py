"""Soak: 4 dense slots through one worker for a long time; RSS at start and end, errors.

Run: ``python benchmarks/soak.py [--minutes 10] [--vocab 129280] [--json]``.

Starts ``pp1-worker`` as a subprocess and drives 4 slots with dense depth-5
proposals, verifying each against the toy target and committing, for the
given time. Reports the resident memory of the worker and of this process
after 100 rounds (warm) and at the end, rounds, fallbacks and rejected frames. Not part
of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from pp1wire.aio.client import AsyncClient, ProposalUnavailableError
from pp1wire.apps.launch import worker_process
from pp1wire.apps.models import toy_target
from pp1wire.q.rng import derive_seed
from pp1wire.q.verify import RequestVerifier
from pp1wire.wire.spark_core import SparkConfig


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def drive(
    address: str, vocab: int, seconds: float, mark: int, worker_pid: int
) -> dict[str, object]:
    """Run 4 slots for ``seconds``; RSS of both sides after ``mark`` rounds and at the end."""
    host, port = address.rsplit(":", 1)
    client = await AsyncClient.connect(host, int(port), SparkConfig(vocab_size=vocab))
    target = toy_target(vocab, 0)
    stats: dict[str, object] = {}
    counters = {"rounds": 0, "fallbacks": 0}
    marked: list[tuple[float, float]] = []
    deadline = time.monotonic() + seconds

    async def slot_loop(slot: int) -> None:
        request = slot
        while time.monotonic() < deadline:
            seed = derive_seed(7, request)
            generation = await client.open(slot, seed=seed, prefix=[1, 2, 3])
            v = RequestVerifier(
                session=client.session,
                seed=seed,
                vocab_size=vocab,
                prefix=[1, 2, 3],
                target=target.probs,
                generation=generation,
            )
            for _ in range(16):  # a request of 16 rounds, then a fresh one
                try:
                    p = await client.propose(slot, round_id=client.next_round(slot), depth=5)
                    res = v.verify(p)
                    client.release(p)
                except ProposalUnavailableError:
                    counters["fallbacks"] += 1
                    res = v.decode_target_only(client.next_round(slot))
                client.commit(slot, round_id=res.round_id, tokens=res.tokens, accepted=res.accepted)
                counters["rounds"] += 1
                if counters["rounds"] == mark:
                    marked.append((rss_mb(worker_pid), rss_mb()))
            await client.close_slot(slot)
            request += 4

    await asyncio.gather(*(slot_loop(s) for s in range(4)))
    stats.update(counters)
    stats["errors"] = int(sum(client.rejected.values()))
    stats["worker_rss_mb_after_warmup"], stats["spark_rss_mb_after_warmup"] = marked[0]
    stats["worker_rss_mb_end"], stats["spark_rss_mb_end"] = rss_mb(worker_pid), rss_mb()
    await client.close()
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--vocab", type=int, default=129_280)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with worker_process(vocab=args.vocab) as worker:
        stats = asyncio.run(
            drive(worker.address, args.vocab, args.minutes * 60, 100, worker.process.pid)
        )
    out = {"minutes": args.minutes, **stats}
    print(json.dumps(out) if args.json else "\n".join(f"{k:28s} {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
