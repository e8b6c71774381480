"""A longer fuzzing run of the frame decoder and both protocol cores.

Usage: ``python fuzz/run.py [--seconds 300] [--seed 1]``.

A mutational fuzzer seeded with every golden vector and a session of valid
traffic: each input is a corpus entry with random byte flips, insertions,
deletions, splices, truncations and length-field edits, fed to a fresh
decoder, a fresh worker core (before and after the handshake) and a Spark core
with a STEP in flight. Only the protocol's own errors may escape the decoder;
the cores must never raise and must only ever emit valid frames. Each input has
a watchdog (a hang is a failure) and resident memory must stay bounded. Prints
the number of executed inputs per target and exits 1 on the first failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import signal
import struct
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pp1wire.apps.models import ToyLM  # noqa: E402
from pp1wire.errors import ProtocolError  # noqa: E402
from pp1wire.wire import framing  # noqa: E402
from pp1wire.wire.spark_core import SparkConfig, SparkProtocol  # noqa: E402
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol  # noqa: E402

VOCAB = 8
DRAFTER = ToyLM(VOCAB, 1, draft=True).logits


class Hang(Exception):  # noqa: N818
    pass


def _alarm(_signum: int, _frame: object) -> None:
    raise Hang


def corpus() -> list[bytes]:
    vectors = json.loads((ROOT / "golden" / "vectors.json").read_text())["vectors"]
    seeds = [bytes.fromhex(v["hex"]) for v in vectors]
    # A real session's traffic in both directions.
    worker = WorkerProtocol(
        WorkerConfig(vocab_size=VOCAB, max_support=4), DRAFTER, session=7, now=0.0
    )
    spark = SparkProtocol(SparkConfig(vocab_size=VOCAB, max_support=4), now=0.0)
    spark.start(0.0)
    for _ in range(3):
        for c in spark.data_to_send():
            seeds.append(c)
            worker.receive_data(c, 0.0)
        for c in worker.data_to_send():
            seeds.append(c)
            spark.receive_data(c, 0.0)
    spark.open_slot(0, seed=1, prefix=[1, 2])
    spark.step(0, round_id=spark.next_round(0), depth=3, temperature=1.0, support=0, now=0.0)
    for c in spark.data_to_send():
        seeds.append(c)
        worker.receive_data(c, 0.0)
    seeds.extend(worker.data_to_send())
    return seeds


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1:
            b[rng.randint(0, len(b)) : rng.randint(0, len(b))] = bytes(
                rng.randrange(256) for _ in range(rng.randint(1, 8))
            )
        elif op == 2 and b:
            i = rng.randrange(len(b))
            del b[i : i + rng.randint(1, 8)]
        elif op == 3:
            b += rng.choice(pool)
        elif op == 4 and b:
            b = b[: rng.randrange(len(b))]
        elif op == 5 and len(b) >= 16:
            field = rng.choice([(6, "<H"), (8, "<I")])
            struct.pack_into(
                field[1],
                b,
                field[0],
                rng.choice([0, 1, 4096, 4097, 0xFFFF, 0xFFFFFFFF, rng.randrange(1 << 16)])
                & (0xFFFF if field[1] == "<H" else 0xFFFFFFFF),
            )
        elif op == 6 and len(b) >= 16:
            # Keep the header checksum valid so the mutation reaches the decoder's later layers.
            hlen = struct.unpack_from("<H", b, 6)[0]
            header = bytes(b[16 : 16 + hlen])
            struct.pack_into("<I", b, 12, framing.header_checksum(bytes(b[:12]), header))
    return bytes(b)


def valid(chunks: list[bytes]) -> None:
    d = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
    for c in chunks:
        d.feed(c)


def run_decoder(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        framing.FrameDecoder(1 << 20).feed(data)


def run_worker(data: bytes, handshake: bool) -> None:
    worker = WorkerProtocol(
        WorkerConfig(vocab_size=VOCAB, max_support=4), DRAFTER, session=7, now=0.0
    )
    if handshake:
        spark = SparkProtocol(SparkConfig(vocab_size=VOCAB, max_support=4), now=0.0)
        spark.start(0.0)
        for c in spark.data_to_send():
            worker.receive_data(c, 0.0)
        worker.data_to_send()
    for i in range(0, len(data), 97):
        worker.receive_data(data[i : i + 97], 0.0)
        valid(worker.data_to_send())


def run_spark(data: bytes) -> None:
    spark = SparkProtocol(SparkConfig(vocab_size=VOCAB, max_support=4), now=0.0)
    worker = WorkerProtocol(
        WorkerConfig(vocab_size=VOCAB, max_support=4), DRAFTER, session=7, now=0.0
    )
    spark.start(0.0)
    for _ in range(2):
        for c in spark.data_to_send():
            worker.receive_data(c, 0.0)
        for c in worker.data_to_send():
            spark.receive_data(c, 0.0)
    spark.open_slot(0, seed=1, prefix=[1, 2])
    spark.step(0, round_id=spark.next_round(0), depth=3, temperature=1.0, support=0, now=0.0)
    spark.data_to_send()
    spark.receive_data(data, 0.0)
    valid(spark.data_to_send())
    spark.handle_timer(1e9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-rss-mb", type=float, default=1024.0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pool = corpus()
    counts = {"decoder": 0, "worker": 0, "worker_after_hello": 0, "spark": 0}
    signal.signal(signal.SIGALRM, _alarm)
    started = time.monotonic()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    while time.monotonic() - started < args.seconds:
        data = mutate(rng, rng.choice(pool), pool)
        for target in counts:
            signal.setitimer(signal.ITIMER_REAL, 2.0)
            try:
                if target == "decoder":
                    run_decoder(data)
                elif target == "worker":
                    run_worker(data, handshake=False)
                elif target == "worker_after_hello":
                    run_worker(data, handshake=True)
                else:
                    run_spark(data)
            except Hang:
                print(f"HANG in {target} on input {data.hex()}", file=sys.stderr)
                return 1
            except Exception:
                print(f"FAILURE in {target} on input {data.hex()}", file=sys.stderr)
                traceback.print_exc()
                return 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            counts[target] += 1
        if rng.random() < 0.01:
            pool.append(data)  # grow the corpus with survivors
            if len(pool) > 5000:
                pool.pop(rng.randrange(len(pool)))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    total = sum(counts.values())
    print(
        json.dumps(
            {
                "seconds": round(time.monotonic() - started, 1),
                "executions": total,
                "per_target": counts,
                "max_rss_mb": round(rss, 1),
                "start_rss_mb": round(rss0, 1),
            }
        )
    )
    if rss > args.max_rss_mb:
        print(f"memory grew to {rss:.0f} MB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
