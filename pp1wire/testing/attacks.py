"""Hostile clients, for the tests and benchmarks that attack a worker.

A peer that opens a slot and then floods STEPs without reading, and the
probe a legitimate client runs meanwhile. Blocking sockets on purpose: the
attacker must not be paced by an event loop the worker might share.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import msgspec

from pp1wire.aio.client import AsyncClient
from pp1wire.wire import framing
from pp1wire.wire.spark_core import SparkConfig, SparkProtocol


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (Linux; NaN where /proc has no figure)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def never_reads(
    port: int, vocab: int, steps: int, *, same_round: bool = False, recv_buffer: int = 4096
) -> socket.socket:
    """Open slot 0, then write ``steps`` dense depth-5 STEPs and never read again.

    Distinct rounds by default (each would need a fresh draw); ``same_round``
    repeats round 0 (each is a retry, answered from the replay cache). The
    receive buffer is shrunk first so the replies back up at the worker, not
    in this process's kernel buffers. The caller closes the socket.

    Raises:
        OSError: if the worker cannot be reached.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)
    sock.connect(("127.0.0.1", port))
    core = SparkProtocol(SparkConfig(vocab_size=vocab), now=0.0)
    core.start(0.0)

    def exchange() -> None:
        for chunk in core.data_to_send():
            sock.sendall(chunk)
        sock.settimeout(0.5)
        try:
            while data := sock.recv(1 << 20):
                core.receive_data(data, 0.0)
        except TimeoutError:
            pass

    exchange()
    core.open_slot(0, seed=1, prefix=[1, 2, 3])
    exchange()
    core.step(0, round_id=0, depth=5, temperature=1.0, support=0, now=0.0)
    (frame,) = framing.FrameDecoder(1 << 20).feed(b"".join(core.data_to_send()))
    sock.sendall(
        b"".join(
            framing.encode_frame(
                msgspec.structs.replace(frame.message, round=0 if same_round else r)
            )
            for r in range(steps)
        )
    )
    return sock


async def probe(port: int, vocab: int, config: SparkConfig | None = None) -> float:
    """Seconds for a fresh client's handshake + OPEN + one dense depth-5 round.

    Raises:
        OSError, ClientClosedError: if the worker refuses or drops the client.
    """
    started = time.perf_counter()
    client = await AsyncClient.connect("127.0.0.1", port, config or SparkConfig(vocab_size=vocab))
    await client.open(0, seed=2, prefix=[1, 2])
    proposal = await client.propose(0, round_id=0, depth=5)
    client.release(proposal, 0)
    await client.close()
    return time.perf_counter() - started
