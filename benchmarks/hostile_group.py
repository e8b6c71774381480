"""A legitimate sharded run's tokens/s while hostile links attack one rank, against the same run
without them, interleaved in one process.

Run from the repository root: ``python benchmarks/hostile_group.py [--vocab V] [--reps N]
[--max-tokens N] [--json]``.

One ``pp1-worker --tp 2 --vocab-shards 2`` group serves every run; each run is
``pp1-spark --tp 2 --vocab-shards 2`` (4 requests on 4 slots, depth 5, dense q).
Quiet and attacked runs alternate, ``--reps`` each. During an attacked run two
hostile connections run in this process, both with valid handshakes:

* **own keys** (rank 0's port): 4 slots, each sending a STEP of its own (its own
  prompt), then RESET and another, as fast as the worker answers;
* **replay** (rank 1's port): opens slots 0-3 with the legitimate run's prompt
  and sends, on each, the legitimate requests' first STEP (slot, generation 0,
  round 0, the prompt's digest: all predictable), reconnecting once answered.

A group that matches STEPs by key alone, in one queue, is stalled by the first
(every rank waits for a key no other link will send) and hands proposals to the
second; one that matches per group session is neither. Printed: tokens/s of the
quiet and attacked runs (median, min-max), their ratio (goal: at least 0.8), the
legitimate runs' fallbacks, and what the attackers got (STEPs sent, answered
with a proposal, answered otherwise).

Every process runs with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import statistics
import sys
import tempfile
from typing import Any

from extras import require

from pp1wire.apps.launch import spark_command, worker_group
from pp1wire.q.proposal import prefix_digest
from pp1wire.testing.conformance.core import Peer, Settings
from pp1wire.wire.messages import MsgType, Reset

SLOTS = 4
PROMPT = [1, 2, 3]  # pp1-spark's prompt when --prompts is not given


@dataclasses.dataclass
class Tally:
    """What one attacker sent and got."""

    steps: int = 0
    proposals: int = 0  # answered with status 0: rows drawn for the attacker
    refused: int = 0  # answered with another status, or an ERROR


async def _answers(peer: Peer, count: int, tally: Tally, timeout: float) -> None:
    """Read ``count`` STEP answers (COMPLETION or ERROR) on ``peer``."""
    got = 0
    while got < count:
        frame = await peer.next(timeout)
        if frame is None:
            raise ConnectionError("the worker stopped answering")
        if frame.type is MsgType.COMPLETION:
            got += 1
            if frame.message.status == 0:  # type: ignore[union-attr]
                tally.proposals += 1
            else:
                tally.refused += 1
        elif frame.type is MsgType.ERROR:
            got += 1
            tally.refused += 1


async def own_keys(s: Settings, stop: asyncio.Event, tally: Tally) -> None:
    """STEPs of this connection's own, on every slot, again and again."""
    peer = await Peer(s).connect()
    try:
        await peer.handshake()
        prompts = [[7, 7, 7 + slot] for slot in range(SLOTS)]
        for slot, prompt in enumerate(prompts):
            await peer.open_slot(slot, prefix=prompt, seed=slot)
        generation = 0
        while not stop.is_set():
            for slot, prompt in enumerate(prompts):
                step = peer.step_msg(
                    slot,
                    generation=generation,
                    digest=prefix_digest(prompt),
                    depth=5,
                    support=0,
                )
                peer.send_msg(step)
                tally.steps += 1
            await _answers(peer, SLOTS, tally, 60.0)
            generation += 1
            for slot in range(SLOTS):  # a new generation: a fresh STEP is allowed
                peer.send_msg(Reset(session=peer.session, slot=slot, generation=generation))
            for _ in range(SLOTS):
                await peer.expect(MsgType.RESET_DONE, 10.0)
    finally:
        peer.close()


async def replay(s: Settings, stop: asyncio.Event, tally: Tally) -> None:
    """The legitimate requests' first STEP, on every slot, from connection after connection."""
    while not stop.is_set():
        # A nonce of its own each time: a worker rank keeps a nonce whose link closed
        # out of use while its session could be matched (docs/protocol.md §6.7).
        peer = await Peer(dataclasses.replace(s, group=secrets.token_bytes(16))).connect()
        try:
            await peer.handshake()
            for slot in range(SLOTS):
                await peer.open_slot(slot, prefix=PROMPT, seed=99)
            for slot in range(SLOTS):
                peer.send_msg(peer.step_msg(slot, depth=5, support=0))
                tally.steps += 1
            await _answers(peer, SLOTS, tally, 60.0)
        finally:
            peer.close()


async def legitimate(address: str, vocab: int, max_tokens: int) -> dict[str, Any]:
    """One pp1-spark run's --json summary, with each request's tokens (from
    ``--output``) under ``"outputs"``."""
    with tempfile.TemporaryDirectory() as tmp:
        output = os.path.join(tmp, "out.jsonl")
        cmd = spark_command(
            address,
            "--requests", str(SLOTS), "--concurrency", str(SLOTS),
            "--max-tokens", str(max_tokens), "--depth", "5", "--support", "dense",
            "--temperature", "1.0", "--tp", "2", "--vocab-shards", "2",
            "--output", output, "--json",
            vocab=vocab,
        )  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"pp1-spark failed:\n{err.decode()[-2000:]}")
        with open(output, encoding="utf-8") as f:
            outputs = [json.loads(line)["tokens"] for line in f]
    line = next(x for x in out.decode().splitlines() if x.startswith("{"))
    summary: dict[str, Any] = json.loads(line)
    summary["outputs"] = outputs
    return summary


async def attacked(
    address: str, vocab: int, max_tokens: int, tallies: dict[str, Tally]
) -> dict[str, Any]:
    """A legitimate run while both attackers run."""
    host, port = address.rsplit(":", 1)
    base = Settings(host=host, port=int(port), vocab=vocab, shards=2, slots=SLOTS, timeout=60.0)
    stop = asyncio.Event()
    attacks = [
        asyncio.ensure_future(own_keys(base, stop, tallies["own_keys"])),
        asyncio.ensure_future(
            replay(dataclasses.replace(base, port=int(port) + 1, shard=1), stop, tallies["replay"])
        ),
    ]
    await asyncio.sleep(0.5)  # the attack is under way before the run starts
    try:
        return await legitimate(address, vocab, max_tokens)
    finally:
        stop.set()
        for task in attacks:
            task.cancel()
        await asyncio.gather(*attacks, return_exceptions=True)


def rate(summary: dict[str, Any]) -> float:
    """Tokens per second of one run (its own measured time)."""
    return float(summary["tokens"]) / float(summary["seconds"])


async def measure(address: str, args: argparse.Namespace) -> dict[str, Any]:
    """Quiet and attacked runs, alternating."""
    tallies = {"own_keys": Tally(), "replay": Tally()}
    quiet: list[dict[str, Any]] = []
    hostile: list[dict[str, Any]] = []
    for _ in range(args.reps):
        quiet.append(await legitimate(address, args.vocab, args.max_tokens))
        hostile.append(await attacked(address, args.vocab, args.max_tokens, tallies))
    q = [rate(r) for r in quiet]
    h = [rate(r) for r in hostile]
    return {
        "vocab": args.vocab,
        "reps": args.reps,
        "quiet_tokens_per_s": statistics.median(q),
        "attacked_tokens_per_s": statistics.median(h),
        "quiet_min_max": [min(q), max(q)],
        "attacked_min_max": [min(h), max(h)],
        "attacked_vs_quiet": statistics.median(h) / statistics.median(q),
        "quiet_fallbacks": sum(r["fallbacks"] for r in quiet),
        "attacked_fallbacks": sum(r["fallbacks"] for r in hostile),
        # Every run has the same seeds: an attack that changed a token shows here.
        "same_tokens": all(r["outputs"] == quiet[0]["outputs"] for r in quiet + hostile),
        "attackers": {k: dataclasses.asdict(v) for k, v in tallies.items()},
    }


def main() -> None:
    """Measure and print the figures."""
    require("torch")
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per request (default 24)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the worker ranks and pp1-spark
    with worker_group("--log-level", "error", vocab=args.vocab, seed=0) as group:
        out = asyncio.run(measure(group.address, args))
    if args.json:
        print(json.dumps(out))
        return
    qlo, qhi = out["quiet_min_max"]
    hlo, hhi = out["attacked_min_max"]
    print(f"vocab {args.vocab}, {SLOTS} requests x depth 5, {args.reps} runs each (median)")
    print(f"quiet     {out['quiet_tokens_per_s']:8.1f} tokens/s (range {qlo:.1f}-{qhi:.1f})")
    print(f"attacked  {out['attacked_tokens_per_s']:8.1f} tokens/s (range {hlo:.1f}-{hhi:.1f})")
    print(f"ratio (attacked / quiet, medians) {out['attacked_vs_quiet']:.2f}")
    print(f"fallbacks: quiet {out['quiet_fallbacks']}, attacked {out['attacked_fallbacks']}")
    for name, t in out["attackers"].items():
        print(
            f"attacker {name:8s}: {t['steps']} STEPs, {t['proposals']} answered with a "
            f"proposal, {t['refused']} refused or unmatched"
        )


if __name__ == "__main__":
    main()
