"""pp1wire against the machine's limit and the stacks a user would pick instead.

Run: ``python benchmarks/run.py [--quick] [--json]`` (needs ``pip install -e .[bench]``).

Every comparison is measured in the same run, variants interleaved round by
round, and reported as the median of the per-round ratios with the min-max
across rounds beside it:

(a) dense round: 4 requests x depth 5 at vocabulary 129,280 (10.3 MB of q):
    pp1wire STEPs answered from the worker's replay cache, every row validated
    and checksummed and each COMPLETION validated, vs. the same bytes over a
    raw blocking socket, ZeroMQ REQ/REP and gRPC unary (all unvalidated).
(a') ``fresh_dense_vs_ideal``: the same 4 x 5 dense round drawn fresh (toy
    drafter, q construction, encoding, transfer, every row validated) over the
    drafter's own time for those 20 rows plus the raw-socket transfer of the
    same bytes, all three measured in the same round.
(b) sparse round: one request, depth 5, k = 32, the same four ways, and a fifth:
    the raw protocol between two asyncio protocols on uvloop that do nothing per
    frame (``loop_sparse``), the floor of any implementation on an event loop;
    ``sparse_loop_floor_vs_raw`` is that floor over the raw socket and
    ``sparse_vs_loop`` what pp1wire's per-frame work adds on top of it.
(c) dense row validation vs. one numpy max() pass; sparse row validation.
(d) q construction from logits (dense, sparse k = 32) vs. a float64 softmax.
(e) wire overhead: encoded bytes / payload bytes, dense and sparse k = 16..256.
(f) RSS of both daemons after 100 and after 10,000 dense rounds.
(h) ``benchmarks/speedup.py``'s table (``e2e``; a small one with ``--quick``) and,
    from its headline repetition (the first vocabulary at t_t = 20 ms),
    ``e2e_vs_ideal`` (dense; ``e2e_vs_ideal_sparse32``), ``speedup_over_target_only``,
    ``step_fill``, ``round_trip_ms``, ``worker_cpu_ms_per_row`` and
    ``spark_cpu_ms_per_token``: ``pp1-spark`` tokens/s with fixed-cost plugins against
    target-only and against the ideal their costs and the measured acceptance imply
    (``benchmarks/speedup.py`` states the formula).
(g) ``ping_during_draft_ms``: a PING's round trip while the same connection's
    slot draws a 200 ms proposal (drafter 40 ms per call, a sleep), with draws
    on the worker's pool (``--draw-threads 2``) and, for contrast, on its event
    loop (``--draw-threads 0``).

The transport comparison runs twice: with the daemons as configured by default
(event loops that sleep when idle), then with ``--busy-poll`` on both pp1wire
ends (``busy_poll_*`` keys), which spends a core to skip the idle-CPU wake-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import micro  # noqa: E402
import sizes  # noqa: E402
import speedup  # noqa: E402
from extras import require  # noqa: E402
from soak import rss_mb  # noqa: E402

from pp1wire.aio.client import AsyncClient  # noqa: E402
from pp1wire.apps.launch import worker_process  # noqa: E402
from pp1wire.apps.models import drafter_factory  # noqa: E402
from pp1wire.apps.settings import install_uvloop  # noqa: E402
from pp1wire.wire.assembly import ReplyAssembly  # noqa: E402
from pp1wire.wire.messages import Step  # noqa: E402
from pp1wire.wire.spark_core import SparkConfig  # noqa: E402

VOCAB = 129_280
DENSE_SLOTS = [0, 1, 2, 3]
SPARSE_SLOT = 4


def start(cmd: list[str]) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    return proc, int(line.rsplit(":", 1)[-1].rsplit(" ", 1)[-1])


class Pp1:
    """A client with 4 dense slots and 1 sparse slot whose last STEPs are replayed."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.steps: dict[int, Step] = {}
        self.reply_bytes: dict[int, int] = {}

    @classmethod
    async def setup(cls, port: int, busy_poll: bool = False, psk: bytes | None = None) -> Pp1:
        client = await AsyncClient.connect(
            "127.0.0.1",
            port,
            SparkConfig(vocab_size=VOCAB, max_slots=5, max_support=32, psk=psk),
            busy_poll=busy_poll,
        )
        self = cls(client)
        original = client.core.step

        def spy(slot: int, **kw: Any) -> int:
            r = original(slot, **kw)
            flight = client.core.slots[slot].flight
            assert flight is not None
            self.steps[slot] = flight.step
            return r

        client.core.step = spy  # type: ignore[method-assign]
        for slot in [*DENSE_SLOTS, SPARSE_SLOT]:
            await client.open(slot, seed=slot + 1, prefix=[1, 2, 3])
            support = 32 if slot == SPARSE_SLOT else 0
            p = await client.propose(
                slot, round_id=client.next_round(slot), depth=5, support=support
            )
            client.release(p)
        return self

    async def fresh(self, slots: list[int], reps: int) -> float:
        """Median time of fresh rounds on ``slots`` (each after an untimed COMMIT of the
        slot's last round, so the worker draws: drafter, construction, encoding,
        transfer, validation).

        The last round is committed (one target-only token), as a Spark side does,
        rather than reset: a RESET would abandon its draw uncommitted, and the
        worker's default abandon budget refuses a client that keeps doing so
        (``DRAW_RATE_LIMITED``)."""
        client, samples = self.client, []
        for _ in range(reps):
            await asyncio.gather(
                *(
                    client.commit(slot, round_id=self.steps[slot].round, tokens=[1], accepted=0)
                    for slot in slots
                )
            )
            t0 = time.perf_counter()
            proposals = await asyncio.gather(
                *(
                    client.propose(
                        s,
                        round_id=client.next_round(s),
                        depth=5,
                        support=32 if s == SPARSE_SLOT else 0,
                    )
                    for s in slots
                )
            )
            samples.append(time.perf_counter() - t0)
            for p in proposals:
                client.release(p)
        return statistics.median(samples)

    async def replay(self, slots: list[int]) -> None:
        """Re-send each slot's last STEP; the worker answers with its cached bytes."""
        client, core = self.client, self.client.core
        futs = []
        for slot in slots:
            step = self.steps[slot]
            state = core.slots[slot]
            state.flight = state.fence.in_flight = ReplyAssembly(
                step=step, deadline=time.monotonic() + 30
            )
            fut = client.loop.create_future()
            client._proposals[slot] = fut
            core._send(step)  # tagged too, on a keyed connection
            futs.append(fut)
        client._flush()
        if client.busy_poll and client._spinner is None:
            client._spinner = asyncio.ensure_future(client._spin())
        for p in await asyncio.gather(*futs):
            client.release(p)


class Raw:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(16 << 20)

    def rtt(self, n: int) -> None:
        self.sock.sendall(struct.pack("<II", 8, n))
        view = memoryview(self.buf)
        got = 0
        while got < n:
            got += self.sock.recv_into(view[got:n])


class Loop(asyncio.Protocol):
    """The raw protocol from an asyncio protocol: with the ``loop`` peer, the event-loop floor."""

    def __init__(self) -> None:
        self.want = 0
        self.waiter: asyncio.Future[None] | None = None

    @classmethod
    async def connect(cls, port: int) -> Loop:
        transport, self = await asyncio.get_running_loop().create_connection(cls, "127.0.0.1", port)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport
        return self

    def data_received(self, data: bytes) -> None:
        self.want -= len(data)
        if self.want <= 0 and self.waiter is not None:
            self.waiter.set_result(None)
            self.waiter = None

    async def rtt(self, n: int) -> None:
        self.want = n
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(struct.pack("<II", 8, n))
        await self.waiter


class Zmq:
    def __init__(self, port: int) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def rtt(self, n: int) -> None:
        self.sock.send(struct.pack("<I", n))
        self.sock.recv(copy=False)


class Grpc:
    def __init__(self, port: int) -> None:
        import grpc

        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
            ],
        )
        self.call = self.channel.unary_unary("/bench.Bench/Get")

    def rtt(self, n: int) -> None:
        self.call(struct.pack("<I", n))


async def timed(fn: Callable[[], Awaitable[None] | None], reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        if out is not None:
            await out
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def transports(
    pp1: Pp1,
    raw: Raw,
    zmq: Zmq,
    grpc: Grpc,
    loop: Loop,
    rounds: int,
    reps: int,
    dense_bytes: int,
    sparse_bytes: int,
) -> dict[str, list[float]]:
    cases: dict[str, Callable[[], Any]] = {
        "pp1_dense": lambda: pp1.replay(DENSE_SLOTS),
        "raw_dense": lambda: raw.rtt(dense_bytes),
        "zmq_dense": lambda: zmq.rtt(dense_bytes),
        "grpc_dense": lambda: grpc.rtt(dense_bytes),
        "pp1_sparse": lambda: pp1.replay([SPARSE_SLOT]),
        "raw_sparse": lambda: raw.rtt(sparse_bytes),
        "zmq_sparse": lambda: zmq.rtt(sparse_bytes),
        "grpc_sparse": lambda: grpc.rtt(sparse_bytes),
        "loop_sparse": lambda: loop.rtt(sparse_bytes),
    }
    drafter = drafter_factory(VOCAB, 3)  # the worker's (worker_process's seed)

    def draft_rows() -> None:
        # The drafter's own time for the rows of one fresh dense round: 4 slots x 5.
        for slot in DENSE_SLOTS:
            for i in range(5):
                drafter([1, 2, 3, slot, i])

    cases["drafter_dense"] = draft_rows
    cases["pp1_fresh_dense"] = lambda: None  # timed by Pp1.fresh below
    names = list(cases)
    for name in names:  # warm-up
        if name != "pp1_fresh_dense":
            await timed(cases[name], 3)
    await pp1.fresh(DENSE_SLOTS, 2)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            n = reps if name.endswith("dense") else reps * 20
            if name == "pp1_fresh_dense":
                out[name].append(await pp1.fresh(DENSE_SLOTS, max(1, reps // 3)))
                continue
            out[name].append(await timed(cases[name], n))
    return out


async def rss_growth(pp1: Pp1, worker_pid: int, early: int, late: int) -> dict[str, float]:
    marks: dict[int, tuple[float, float]] = {}
    for i in range(1, late + 1):
        await pp1.replay(DENSE_SLOTS)
        if i in (early, late):
            marks[i] = (rss_mb(worker_pid), rss_mb())
    return {
        "worker_rss_mb_early": marks[early][0],
        "worker_rss_mb_late": marks[late][0],
        "spark_rss_mb_early": marks[early][1],
        "spark_rss_mb_late": marks[late][1],
        "rounds_early": early,
        "rounds_late": late,
    }


async def ping_during_draft(reps: int, draw_threads: int) -> list[float]:
    """PING round trips (s) on a connection whose slot is drawing a 200 ms proposal."""
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    with worker_process(
        "--drafter", "paced:slow_drafter_factory", "--draw-threads", str(draw_threads),
        vocab=1024, env=env,
    ) as worker:  # fmt: skip
        client = await AsyncClient.connect(
            "127.0.0.1", worker.port, SparkConfig(vocab_size=1024, max_slots=1, max_depth=5)
        )
        out = []
        try:
            await client.open(0, seed=1, prefix=[1, 2, 3])
            for _ in range(reps):
                slow = asyncio.ensure_future(
                    client.propose(0, round_id=client.next_round(0), depth=5)
                )
                await asyncio.sleep(0.02)  # the draw has started
                out.append(await client.ping())
                proposal = await slow
                # Accept the first draft, then a correction: the next STEP draws afresh.
                first = proposal.tokens[0]
                client.commit(0, round_id=proposal.round_id, tokens=[first, 0], accepted=1)
                client.release(proposal)
        finally:
            await client.close()
    return out


def ratio(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rounds, reps = (1, 2) if args.smoke else (3, 5) if args.quick else (8, 15)
    peers: list[tuple[subprocess.Popen[str], int]] = []
    try:
        with worker_process("--max-slots", "8", vocab=VOCAB) as worker:
            pp1 = await Pp1.setup(worker.port)
            # The baselines carry exactly the bytes the pp1wire replies take on the wire.
            decoder = pp1.client.core.decoder
            before = decoder.bytes_received
            await pp1.replay(DENSE_SLOTS)
            dense_bytes = decoder.bytes_received - before
            before = decoder.bytes_received
            await pp1.replay([SPARSE_SLOT])
            sparse_bytes = decoder.bytes_received - before
            for kind in ("raw", "zmq", "grpc", "loop"):
                peers.append(
                    start(
                        [sys.executable, str(HERE / "peers.py"), kind, "--size", str(dense_bytes)]
                    )
                )
            raw, zmq, grpc = Raw(peers[0][1]), Zmq(peers[1][1]), Grpc(peers[2][1])
            loop = await Loop.connect(peers[3][1])
            t = await transports(pp1, raw, zmq, grpc, loop, rounds, reps, dense_bytes, sparse_bytes)
            early, late = (5, 20) if args.smoke else (100, 1000) if args.quick else (100, 10_000)
            mem = await rss_growth(pp1, worker.process.pid, early, late)
            await pp1.client.close()
        # The same comparison with both pp1wire ends busy-polling (--busy-poll).
        with worker_process("--max-slots", "8", "--busy-poll", vocab=VOCAB) as worker:
            spin = await Pp1.setup(worker.port, busy_poll=True)
            t_spin = await transports(
                spin, raw, zmq, grpc, loop, max(2, rounds // 2), reps, dense_bytes, sparse_bytes
            )
            await spin.client.close()
    finally:
        for proc, _ in peers:
            proc.terminate()
    trials, mreps = (1, 3) if args.smoke else (3, 20) if args.quick else (9, 200)
    micro_res = micro.run_cases(trials, mreps)
    size_table = {
        name: sizes.reply_size(k)
        for name, k in [
            ("dense", None),
            ("sparse16", 16),
            ("sparse32", 32),
            ("sparse64", 64),
            ("sparse256", 256),
        ]
    }
    # pp1 against each other transport, in the same run, per row kind.
    vs = [("dense", "raw"), ("dense", "zmq"), ("dense", "grpc")]
    vs += [("sparse", "raw"), ("sparse", "zmq"), ("sparse", "grpc")]
    spun = [("dense", "raw"), ("dense", "zmq"), ("sparse", "raw"), ("sparse", "grpc")]
    ratios = {
        **{f"{k}_vs_{b}": ratio(t[f"pp1_{k}"], t[f"{b}_{k}"]) for k, b in vs},
        "sparse_loop_floor_vs_raw": ratio(t["loop_sparse"], t["raw_sparse"]),
        "sparse_vs_loop": ratio(t["pp1_sparse"], t["loop_sparse"]),
        **{f"busy_poll_{k}_vs_{b}": ratio(t_spin[f"pp1_{k}"], t_spin[f"{b}_{k}"]) for k, b in spun},
        "fresh_dense_vs_ideal": [
            f / (d + r)
            for f, d, r in zip(
                t["pp1_fresh_dense"], t["drafter_dense"], t["raw_dense"], strict=True
            )
        ],
        "validate_vs_max": micro_res["validate_vs_max"],
        "construct_vs_softmax": micro_res["construct_vs_softmax"],
    }
    overhead = {f"overhead_{k}": (v[0] - v[1]) / v[1] for k, v in size_table.items()}
    growth = max(
        mem["worker_rss_mb_late"] / mem["worker_rss_mb_early"],
        mem["spark_rss_mb_late"] / mem["spark_rss_mb_early"],
    )
    times = {k: summarize(v) for k, v in t.items()}
    times.update({f"busy_poll_{k}": summarize(v) for k, v in t_spin.items() if k.startswith("pp1")})
    pings = 2 if args.smoke else 5
    ping = {
        "ping_during_draft": summarize(await ping_during_draft(pings, draw_threads=2)),
        "ping_during_draft_on_loop": summarize(await ping_during_draft(pings, draw_threads=0)),
    }
    if args.smoke:
        table = functools.partial(
            speedup.measure,
            vocabs=[1024], target_ms=[2.0], requests=2, tokens=4, reps=1, warm_up=False,
        )  # fmt: skip
    elif args.quick:
        table = functools.partial(speedup.measure, vocabs=[32_000], target_ms=[20.0], reps=1)
    else:
        table = speedup.measure  # the whole table
    e2e = await asyncio.to_thread(table)
    return {
        "e2e": e2e,
        "ping": ping,
        "times": times,
        "ratios": {k: summarize(v) for k, v in ratios.items()},
        "micro": {k: summarize(v) for k, v in micro_res.items()},
        "overhead": overhead,
        "memory": mem,
        "rss_growth": growth,
        "bytes": {"dense_reply": dense_bytes, "sparse_reply": sparse_bytes},
    }


GOALS = {
    "dense_vs_raw": 1.2,
    "dense_vs_zmq": 1.0,
    "sparse_vs_raw": 1.3,
    "sparse_vs_grpc": 0.2,
    "validate_vs_max": 8.0,
    "construct_vs_softmax": 3.0,
    "fresh_dense_vs_ideal": 1.3,
}


def main() -> int:
    require("zmq", "grpc")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few iterations only: checks that the benchmark works",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    install_uvloop()
    res = asyncio.run(main_async(args))
    flat = {k: v["median"] for k, v in res["ratios"].items()}
    flat["overhead_dense"] = res["overhead"]["overhead_dense"]
    flat["overhead_sparse32"] = res["overhead"]["overhead_sparse32"]
    flat["rss_growth"] = res["rss_growth"]
    flat["ping_during_draft_ms"] = res["ping"]["ping_during_draft"]["median"] * 1e3
    flat["e2e_vs_ideal"] = res["e2e"]["e2e_vs_ideal_dense"]
    flat["e2e_vs_ideal_sparse32"] = res["e2e"]["e2e_vs_ideal_sparse32"]
    flat["speedup_over_target_only"] = res["e2e"]["speedup_dense"]
    for key in ("step_fill", "round_trip_ms", "worker_cpu_ms_per_row", "spark_cpu_ms_per_token"):
        flat[key] = res["e2e"][key]
    if args.json:
        print(json.dumps({**flat, "detail": res}))
        return 0
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    print(f"pp1wire benchmarks ({mode} run), vocabulary {VOCAB}")
    print(f"\n{'transport round trip':26s} {'median ms':>10s} {'min..max ms':>20s}")
    for k, v in res["times"].items():
        print(f"{k:26s} {v['median'] * 1e3:10.3f} {v['min'] * 1e3:9.3f}..{v['max'] * 1e3:<9.3f}")
    print(f"\n{'ratio (same round)':26s} {'median':>10s} {'min..max':>20s} {'goal':>8s}")
    for k, v in res["ratios"].items():
        goal = f"<= {GOALS[k]}" if k in GOALS else ""
        print(f"{k:26s} {v['median']:10.3f} {v['min']:9.3f}..{v['max']:<9.3f} {goal:>8s}")
    print(f"\n{'per row (micro)':26s} {'median us':>10s} {'min..max':>20s}")
    for k, v in res["micro"].items():
        if k.endswith("_us"):
            print(f"{k:26s} {v['median']:10.1f} {v['min']:9.1f}..{v['max']:<9.1f}")
    print("\nwire overhead (encoded / payload - 1):")
    for k, v in res["overhead"].items():
        print(f"  {k:24s} {v:10.4%}")
    print("\nend to end (benchmarks/speedup.py), median (min-max) of its repetitions:")
    print(speedup.table(res["e2e"]))
    print("\nPING round trip while the same connection draws a 200 ms proposal:")
    for k, v in res["ping"].items():
        print(f"  {k:26s} {v['median'] * 1e3:8.2f} ms ({v['min'] * 1e3:.2f}..{v['max'] * 1e3:.2f})")
    m = res["memory"]
    print(
        f"\nRSS after {m['rounds_early']} / {m['rounds_late']} dense rounds: worker "
        f"{m['worker_rss_mb_early']:.1f} / {m['worker_rss_mb_late']:.1f} MB, spark "
        f"{m['spark_rss_mb_early']:.1f} / {m['spark_rss_mb_late']:.1f} MB; "
        f"rss_growth {res['rss_growth']:.4f} (goal <= 1.02)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
