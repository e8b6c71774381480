"""Hostile clients, for the tests and benchmarks that attack a worker.

A peer that opens a slot and then floods STEPs without reading, peers that
keep every slot drawing with a RESET/STEP loop, and the probe a legitimate
client runs meanwhile. Blocking sockets on purpose: the
attacker must not be paced by an event loop the worker might share.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from pp1wire.aio.client import AsyncClient
from pp1wire.q.proposal import prefix_digest
from pp1wire.wire import framing
from pp1wire.wire.events import HandshakeDone
from pp1wire.wire.messages import Error, MsgType, Reset, Step
from pp1wire.wire.spark_core import SparkConfig, SparkProtocol
from pp1wire.wire.spark_events import SlotOpened


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
        OSError, RefusedError, ConnectionLostError: if the worker refuses or drops the client.
    """
    started = time.perf_counter()
    client = await AsyncClient.connect("127.0.0.1", port, config or SparkConfig(vocab_size=vocab))
    await client.open(0, seed=2, prefix=[1, 2])
    proposal = await client.propose(0, round_id=0, depth=5)
    proposal.release()
    await client.close()
    return time.perf_counter() - started


class _Switch(Protocol):
    """What :func:`reset_step_loop` reads of its pause and stop switches
    (``threading.Event`` and ``multiprocessing.Event`` both fit)."""

    def is_set(self) -> bool:
        """Whether the switch is on."""

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until it is on (or ``timeout`` s); whether it is."""


def _handshake_and_open(
    port: int, vocab: int, slots: int, prefix: list[int]
) -> tuple[socket.socket, int]:
    """A connection with ``slots`` slots open at ``prefix``; the socket and its session."""
    sock = socket.create_connection(("127.0.0.1", port))
    core = SparkProtocol(SparkConfig(vocab_size=vocab, max_slots=slots), now=0.0)
    core.start(0.0)
    events: list[object] = []

    def exchange(done: Callable[[], bool]) -> None:
        for chunk in core.data_to_send():
            sock.sendall(chunk)
        sock.settimeout(30.0)
        while not done():
            data = sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the worker closed the connection")
            events.extend(core.receive_data(data, 0.0))
            for chunk in core.data_to_send():
                sock.sendall(chunk)

    exchange(lambda: any(isinstance(e, HandshakeDone) for e in events))
    for slot in range(slots):
        core.open_slot(slot, seed=slot + 1, prefix=prefix)
    exchange(lambda: sum(isinstance(e, SlotOpened) for e in events) == slots)
    sock.settimeout(None)
    return sock, core.session


def reset_step_loop(
    port: int,
    vocab: int,
    *,
    connections: int = 4,
    slots: int = 4,
    depth: int = 5,
    running: _Switch,
    stop: _Switch,
    ready: Callable[[], object] | None = None,
) -> tuple[int, int]:
    """Keep every slot of ``connections`` connections drawing: STEP, read the reply,
    RESET (a new generation), STEP again, for as long as ``running`` is on and until
    ``stop``. Each STEP is a fresh draw (dense, ``depth`` rows); no COMMIT is ever
    sent, so the one-uncommitted-STEP rule never applies. ``ready`` is called once
    every slot is open. Returns the STEPs answered with a proposal and those refused.

    Raises:
        OSError, ConnectionError: if the worker cannot be reached or drops a connection.
    """
    prefix = [1, 2, 3]
    digest = prefix_digest(prefix)
    totals = [0, 0]
    lock = threading.Lock()

    def one(sock: socket.socket, session: int) -> None:
        decoder = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
        generation = 0
        while not stop.is_set():
            if not running.wait(0.05):
                continue
            out = []
            for slot in range(slots):
                if generation:
                    out.append(
                        framing.encode_frame(
                            Reset(session=session, slot=slot, generation=generation)
                        )
                    )
                out.append(
                    framing.encode_frame(
                        Step(
                            session=session,
                            slot=slot,
                            generation=generation,
                            round=0,
                            position=len(prefix),
                            digest=digest,
                            depth=depth,
                            temperature=1.0,
                            support=0,
                            context=0,
                        )
                    )
                )
            sock.sendall(b"".join(out))
            answered = drawn = 0
            while answered < slots:
                data = sock.recv(1 << 20)
                if not data:
                    return
                for frame in decoder.feed(data):
                    if frame.type is MsgType.COMPLETION:
                        answered += 1
                        drawn += 1
                    elif isinstance(frame.message, Error) and frame.message.answers == MsgType.STEP:
                        answered += 1
            generation += 1
            with lock:
                totals[0] += drawn
                totals[1] += answered - drawn

    links = [_handshake_and_open(port, vocab, slots, prefix) for _ in range(connections)]
    if ready is not None:
        ready()
    threads = [threading.Thread(target=one, args=link, daemon=True) for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sock, _ in links:
        sock.close()
    return totals[0], totals[1]
