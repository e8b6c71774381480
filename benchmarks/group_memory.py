"""Rank 0's memory under STEPs its group never matches, against the §8 bound, and after.

Run from the repository root: ``python benchmarks/group_memory.py [--connections N]
[--vocab V] [--hold S] [--json]``.

One ``pp1-worker --tp 2 --vocab-shards 2`` group (default limits: 4 slots,
1,048,576-token prefixes). ``--connections`` peers connect to rank 0's port only,
each with the largest limits the worker allows, OPEN every slot with a
1,048,576-token prefix and send a STEP on each: no other link sends those STEPs,
so rank 0 holds them until its match timeout. Rank 0's resident memory
(``VmRSS``) is sampled before, while the STEPs are held (the peak over
``--hold`` seconds), and after the peers close. The bound is ``docs/protocol.md``
§8's per connection — 64 KiB + one frame + max_slots x (4 x max_prefix + R) +
1 MiB + R, R a depth-5 reply of this rank's dense shard — times the connections.

Linux only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from extras import require

from pp1wire.apps.launch import worker_group
from pp1wire.testing.conformance.core import Peer, Settings
from pp1wire.wire.messages import MsgType, Open

SLOTS = 4
PREFIX = 1 << 20
MIB = 1 << 20


def rank_pid(port: int, rank: int) -> int:
    """The PID of the worker rank listening on ``port`` + ``rank`` (from ``/proc``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        flags = [c.decode(errors="replace") for c in cmd]
        if "pp1wire.apps.worker" in flags and str(port) in flags and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise SystemExit(f"no worker rank {rank} for port {port}")


def rss(pid: int) -> int:
    """Resident bytes of ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no VmRSS for {pid}")


def bound(connections: int, shard_entries: int) -> int:
    """§8's memory bound for ``connections`` peers at this worker's default limits."""
    reply = 5 * (4 * shard_entries + 256)  # R: depth 5, each row with its frame overhead
    frame = 16 + 4096 + 4 * PREFIX + 16
    per_connection = 64 * 1024 + frame + SLOTS * (4 * PREFIX + reply) + MIB + reply
    return connections * per_connection


async def hold(s: Settings) -> Peer:
    """A peer with every slot open at a long prefix and a STEP sent on each."""
    peer = await Peer(s).connect()
    await peer.handshake(peer.hello(max_prefix=PREFIX, max_slots=SLOTS, max_frame=64 * MIB))
    tokens = (np.arange(PREFIX, dtype="<i4") % 97).astype("<i4")
    payload = tokens.tobytes()
    digest = xxhash.xxh3_64_intdigest(payload)
    for slot in range(SLOTS):
        msg = Open(
            session=peer.session,
            slot=slot,
            generation=0,
            seed=slot,
            context=0,
            eos=None,
            prefix_len=PREFIX,
            digest=digest,
        )
        peer.send_msg(msg, payload)
        await peer.expect(MsgType.OPENED, 30.0)
    for slot in range(SLOTS):
        peer.send_msg(peer.step_msg(slot, position=PREFIX, digest=digest, depth=5, support=0))
    return peer


async def measure(address: str, args: argparse.Namespace) -> dict[str, Any]:
    """Baseline, peak while held, and after close, of rank 0's RSS."""
    host, port = address.rsplit(":", 1)
    pid = rank_pid(int(port), 0)
    await asyncio.sleep(1.0)
    before = rss(pid)
    peers = []
    for _ in range(args.connections):
        # A Settings of its own: a group session of its own (one link per session and rank).
        s = Settings(host=host, port=int(port), vocab=args.vocab, shards=2, slots=SLOTS)
        s.timeout = 30.0
        peers.append(await hold(s))
    peak = rss(pid)
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        peak = max(peak, rss(pid))
    for peer in peers:
        peer.close()
    await asyncio.sleep(args.settle)
    after = rss(pid)
    limit = bound(args.connections, args.vocab // 2)
    return {
        "connections": args.connections,
        "slots": SLOTS,
        "prefix_tokens": PREFIX,
        "baseline_mib": before / MIB,
        "peak_mib": peak / MIB,
        "growth_mib": (peak - before) / MIB,
        "bound_mib": limit / MIB,
        "growth_within_bound": peak - before <= limit,
        "after_close_mib": after / MIB,
        "after_close_growth_mib": (after - before) / MIB,
    }


def main() -> None:
    """Measure and print the figures."""
    require("torch")
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--hold", type=float, default=3.0, help="seconds the STEPs are held")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after the peers close")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with worker_group("--log-level", "error", vocab=args.vocab, seed=0) as group:
        out = asyncio.run(measure(group.address, args))
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{out['connections']} connections x {SLOTS} slots, {PREFIX:,}-token prefixes, "
        f"STEPs held by rank 0"
    )
    print(
        f"rank 0 RSS: {out['baseline_mib']:.0f} MiB before, {out['peak_mib']:.0f} MiB peak "
        f"(+{out['growth_mib']:.0f} MiB, §8 bound {out['bound_mib']:.0f} MiB: "
        f"{'within' if out['growth_within_bound'] else 'ABOVE'}), "
        f"{out['after_close_mib']:.0f} MiB after the peers closed "
        f"(+{out['after_close_growth_mib']:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
