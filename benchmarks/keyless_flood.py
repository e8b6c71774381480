"""A keyless connection flood against a worker with a key: does it evict authenticated clients?

Run: ``python benchmarks/keyless_flood.py [--seconds S] [--clients N] [WORKER FLAG ...]``.

Starts ``pp1-worker --psk-file KEY`` (``--max-connections`` = ``--clients``) and
that many clients holding the key. Every ``--period`` seconds each makes one
request (OPEN, a depth-1 proposal, a COMMIT of its round, CLOSE), idling in
between with no slot open; a client closed by the worker reconnects. For ``--seconds``
nothing else happens (the baseline), then for as long a peer without the key
opens a bare TCP connection every ``--every`` seconds and holds it. Prints,
for each phase, the requests made and the authenticated clients the worker
closed (``CONNECTION_LIMIT``); the goal is 0 evicted by the flood.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time

from pp1wire.aio.client import (
    AsyncClient,
    ConnectionLostError,
    ProposalUnavailableError,
    RefusedError,
)
from pp1wire.apps.launch import worker_process
from pp1wire.errors import ErrorCode
from pp1wire.wire.spark_core import SparkConfig

VOCAB = 1024


class Tally:
    def __init__(self) -> None:
        self.requests = 0
        self.evicted = 0


async def client_loop(port: int, psk: bytes, period: float, until: float, tally: Tally) -> None:
    config = SparkConfig(vocab_size=VOCAB, psk=psk, max_depth=1)
    while time.monotonic() < until:
        try:
            client = await AsyncClient.connect("127.0.0.1", port, config, timeout=5.0)
        except (OSError, RefusedError, ConnectionLostError, TimeoutError):
            await asyncio.sleep(0.1)
            continue
        try:
            while time.monotonic() < until:
                await asyncio.sleep(period)  # idle between requests, holding no slot
                await client.open(0, seed=1, prefix=[1, 2, 3])
                round_id = client.next_round(0)
                proposal = await client.propose(0, round_id=round_id, depth=1)
                client.release(proposal)
                await client.commit(0, round_id=round_id, tokens=[4], accepted=0)
                await client.close_slot(0)
                tally.requests += 1
        except (RefusedError, ConnectionLostError, ProposalUnavailableError, OSError):
            if client.failed is ErrorCode.CONNECTION_LIMIT:
                tally.evicted += 1
        finally:
            await client.close()


async def flood(port: int, every: float, until: float) -> int:
    held = []
    while time.monotonic() < until:
        with contextlib.suppress(OSError):
            held.append(await asyncio.open_connection("127.0.0.1", port))
        await asyncio.sleep(every)
    for _, writer in held:
        writer.close()
    return len(held)


async def phase(args: argparse.Namespace, port: int, psk: bytes, attack: bool) -> tuple[Tally, int]:
    tally = Tally()
    until = time.monotonic() + args.seconds
    clients = [client_loop(port, psk, args.period, until, tally) for _ in range(args.clients)]
    jobs = [*clients, flood(port, args.every, until)] if attack else clients
    done = await asyncio.gather(*jobs)
    return tally, done[-1] if attack else 0


def main() -> None:
    """Run the baseline, then the flood, and print the figures."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--period", type=float, default=1.5, help="seconds between a client's requests")
    p.add_argument("--every", type=float, default=0.1, help="seconds between flood connections")
    args, worker_flags = p.parse_known_args()
    psk = os.urandom(32).hex().encode()
    with tempfile.NamedTemporaryFile() as key:
        key.write(psk)
        key.flush()
        flags = ["--psk-file", key.name, "--max-connections", str(args.clients), *worker_flags]
        with worker_process(*flags, vocab=VOCAB) as worker:
            base, _ = asyncio.run(phase(args, worker.port, psk, attack=False))
            hit, floods = asyncio.run(phase(args, worker.port, psk, attack=True))
    print(
        f"{args.clients} keyed clients, one request each per {args.period} s, "
        f"{args.seconds:.0f} s per phase"
    )
    print(f"baseline: {base.requests} requests, {base.evicted} authenticated clients evicted")
    print(
        f"keyless flood ({floods} bare connections, one per {args.every} s): "
        f"{hit.requests} requests, {hit.evicted} authenticated clients evicted (goal: 0)"
    )


if __name__ == "__main__":
    main()
