"""Hostile clients for the tests and benchmarks that attack a worker: floods, draw loops,
squatters and a legitimate client's probe, on blocking sockets so no event loop paces them;
each may connect from its own loopback ``source`` and with a :class:`Key` of its own."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import msgspec

from pp1wire.aio.client import AsyncClient
from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q.proposal import PrefixDigest
from pp1wire.testing.builders import open_message, reply_step, token_bytes
from pp1wire.wire import framing
from pp1wire.wire.events import HandshakeDone
from pp1wire.wire.messages import Close, Commit, Error, Message, MsgType, Reset, Scope, Step
from pp1wire.wire.spark_core import SparkConfig, SparkProtocol
from pp1wire.wire.spark_events import SlotOpened


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (Linux; NaN where /proc has no figure)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def never_reads(port: int, vocab: int, steps: int, *, same_round: bool = False) -> socket.socket:
    """Open slot 0, then write ``steps`` dense depth-5 STEPs and never read again.

    Distinct rounds by default (each would need a fresh draw); ``same_round``
    repeats round 0 (each is a retry, answered from the replay cache). The
    receive buffer is shrunk first so the replies back up at the worker, not
    in this process's kernel buffers. The caller closes the socket.

    Raises:
        OSError: if the worker cannot be reached.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
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


def _connect(port: int, source: str | None) -> socket.socket:
    """A TCP connection to the worker on loopback, from ``source`` if given."""
    return socket.create_connection(
        ("127.0.0.1", port), timeout=30.0, source_address=None if source is None else (source, 0)
    )


@dataclass
class Key:
    """A pre-shared key an attacker holds, and its ID in the worker's table (§5)."""

    psk: bytes
    key_id: str = ""


class AttackLink(NamedTuple):
    """An attacker's connection: its socket, its session, and how it frames a message
    (tagged under the connection's key, docs/protocol.md §5.1, when it has one)."""

    sock: socket.socket
    session: int
    frame: Callable[[Message], bytes]


def open_link(
    port: int,
    vocab: int,
    slots: int,
    prefix: list[int],
    *,
    source: str | None = None,
    key: Key | None = None,
) -> AttackLink:
    """A connection (from ``source``, authenticated with ``key`` if given) with
    ``slots`` slots open at ``prefix``. It presents no lineage token: without a key,
    each connection is a new lineage (docs/protocol.md §4.4).

    Raises:
        OSError, ConnectionError: if the worker cannot be reached or closes the connection.
    """
    sock = _connect(port, source)
    psk, key_id = (key.psk, key.key_id) if key is not None else (None, "")
    config = SparkConfig(vocab_size=vocab, max_slots=slots, psk=psk, key_id=key_id)
    core = SparkProtocol(config, now=0.0)
    core.start(0.0)
    events: list[object] = []

    def exchange(done: Callable[[], bool]) -> None:
        for chunk in core.data_to_send():
            sock.sendall(chunk)
        while not done():
            data = sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the worker closed the connection")
            events.extend(core.receive_data(data, 0.0))
            for chunk in core.data_to_send():
                sock.sendall(chunk)

    try:
        exchange(lambda: any(isinstance(e, HandshakeDone) for e in events))
        for slot in range(slots):
            core.open_slot(slot, seed=slot + 1, prefix=prefix)
        exchange(lambda: sum(isinstance(e, SlotOpened) for e in events) == slots)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    # The core's own sealer: the frames it sent after AUTH (the OPENs) are numbered.
    sealer = core._sealer
    if sealer is None:
        return AttackLink(sock, core.session, framing.encode_frame)
    return AttackLink(
        sock, core.session, lambda msg: sealer.seal(framing.encode_frame(msg, tagged=True))
    )


def step_at(
    session: int,
    slot: int,
    round_id: int,
    prefix: PrefixDigest,
    *,
    depth: int = 5,
    generation: int = 0,
) -> Step:
    """A dense STEP of ``slot`` (of ``generation``) for ``round_id`` after ``prefix``."""
    at = {"session": session, "slot": slot, "generation": generation, "round": round_id}
    return reply_step(0, depth, **at, position=prefix.length, digest=prefix.value)


def commit_at(session: int, slot: int, round_id: int, prefix: PrefixDigest, token: int) -> Commit:
    """A COMMIT of ``slot`` (generation 0) for ``round_id`` with no draft accepted and
    ``token`` as its one token of its own, ``prefix`` being the prefix with ``token``."""
    at = {"session": session, "slot": slot, "generation": 0, "round": round_id}
    return Commit(**at, accepted=0, extra=token, position=prefix.length, digest=prefix.value)


def _send(sock: socket.socket, frames: list[bytes]) -> bool:
    """Send ``frames`` at once; False if the connection is gone (the loop ends)."""
    try:
        sock.sendall(b"".join(frames))
    except OSError:
        return False
    return True


def _answers(sock: socket.socket, decoder: framing.FrameDecoder, steps: int) -> tuple[int, int]:
    """Read until ``steps`` STEPs are answered: (drawn, refused DRAW_RATE_LIMITED); a
    closed connection answers the rest as neither.

    Raises:
        ProtocolError: if the worker answers another ERROR to a STEP (the loop is broken).
    """
    answered = drawn = limited = 0
    while answered < steps:
        try:
            data = sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            return drawn, limited
        for frame in decoder.feed(data):
            msg = frame.message
            if frame.type is MsgType.COMPLETION:
                answered += 1
                drawn += 1
            elif isinstance(msg, Error) and msg.scope == Scope.CONNECTION:
                return drawn, limited
            elif isinstance(msg, Error) and msg.answers == MsgType.STEP:
                answered += 1
                if msg.code != ErrorCode.DRAW_RATE_LIMITED:
                    raise ProtocolError(ErrorCode(msg.code), "the attack loop was refused")
                limited += 1
    return drawn, limited


def _on_links(
    one: Callable[[AttackLink], None],
    port: int,
    vocab: int,
    slots: int,
    prefix: list[int],
    connections: int,
    source: str | None,
    ready: Callable[[], object] | None,
    key: Key | None,
) -> None:
    """Open ``connections`` connections (from ``source``, with ``key``), each with
    ``slots`` slots at ``prefix``, call ``ready``, then run ``one(link)`` for each
    connection on a thread of its own until every one returns.

    Raises:
        OSError, ConnectionError: if the worker cannot be reached or drops a connection
            while it opens.
    """
    links = [
        open_link(port, vocab, slots, prefix, source=source, key=key) for _ in range(connections)
    ]
    if ready is not None:
        ready()
    threads = [threading.Thread(target=one, args=(link,), daemon=True) for link in links]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def reset_step_loop(
    port: int,
    vocab: int,
    *,
    connections: int = 4,
    slots: int = 4,
    running: _Switch,
    stop: _Switch,
    ready: Callable[[], object] | None = None,
    source: str | None = None,
    reconnect: bool = False,
    key: Key | None = None,
) -> tuple[int, int]:
    """Keep every slot of ``connections`` connections drawing: STEP, read the reply,
    RESET (a new generation), STEP again, for as long as ``running`` is on and until
    ``stop``. Each STEP is a fresh draw (dense, depth 5); no COMMIT is ever
    sent, so the one-uncommitted-STEP rule never applies. With ``reconnect``, a
    connection refused ``DRAW_RATE_LIMITED`` is closed and made again at once (a
    fresh session, and without a key a new lineage, as if budgets lived on the
    connection). ``key``: the key every connection authenticates with. ``ready`` is
    called once every slot is open. Returns the STEPs answered with a proposal and
    those refused.

    Raises:
        OSError, ConnectionError: if the worker cannot be reached or drops a connection.
    """
    prefix = [1, 2, 3]
    digest = PrefixDigest(prefix)
    tally: list[tuple[int, int]] = []  # (drawn, refused) per batch; append is thread-safe

    def one(link: AttackLink) -> None:
        decoder = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
        generation = 0
        try:
            while not stop.is_set():
                if not running.wait(0.05):
                    continue
                out = []
                session = link.session
                for slot in range(slots):
                    if generation:
                        out.append(
                            link.frame(Reset(session=session, slot=slot, generation=generation))
                        )
                    step = step_at(session, slot, 0, digest, generation=generation)
                    out.append(link.frame(step))
                if not _send(link.sock, out):
                    return
                drawn, refused = _answers(link.sock, decoder, slots)
                generation += 1
                tally.append((drawn, refused))
                if refused and reconnect:
                    link.sock.close()
                    while True:
                        try:
                            link = open_link(port, vocab, slots, prefix, source=source, key=key)
                            break
                        except (OSError, ConnectionError):
                            if stop.wait(0.01):
                                return
                    decoder = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
                    generation = 0
        finally:
            link.sock.close()

    _on_links(one, port, vocab, slots, prefix, connections, source, ready, key)
    return sum(d for d, _ in tally), sum(r for _, r in tally)


def commit_loop(
    port: int,
    vocab: int,
    *,
    connections: int = 4,
    slots: int = 4,
    running: _Switch,
    stop: _Switch,
    ready: Callable[[], object] | None = None,
    source: str | None = None,
    same_round: bool = False,
    key: Key | None = None,
) -> tuple[int, int]:
    """Keep every slot of ``connections`` connections drawing and throw every draw away:
    STEP round r (dense, depth 5), read the reply, COMMIT one token of its own for
    round r + 1, never stepped (a target-only COMMIT, passing round r's draw over),
    STEP round r + 2, for as long as ``running`` is on and until ``stop``; no RESET,
    no CLOSE. With ``same_round``, COMMIT round r itself with no draft accepted (as a
    Spark side whose target rejected the first draft) and STEP round r + 1: every
    round stepped is committed. ``key``: the key every connection authenticates
    with. ``ready`` is called once every slot is open. Returns the STEPs answered
    with a proposal and those refused.

    Raises:
        OSError, ConnectionError: if the worker cannot be reached.
    """
    start = [1, 2, 3]
    tally: list[tuple[int, int]] = []  # (drawn, refused) per batch; append is thread-safe

    def one(link: AttackLink) -> None:
        sock, session = link.sock, link.session
        decoder = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
        prefixes = [PrefixDigest(start) for _ in range(slots)]
        round_id = 0
        try:
            while not stop.is_set():
                if not running.wait(0.05):
                    continue
                out = [
                    link.frame(step_at(session, slot, round_id, prefixes[slot]))
                    for slot in range(slots)
                ]
                if not _send(sock, out):
                    return
                drawn, refused = _answers(sock, decoder, slots)
                if drawn + refused < slots:
                    return  # the worker closed the connection
                tally.append((drawn, refused))
                out = []
                for slot, prefix in enumerate(prefixes):
                    token = 4 + round_id % 50
                    prefix.extend([token])
                    commit = commit_at(
                        session, slot, round_id if same_round else round_id + 1, prefix, token
                    )
                    out.append(link.frame(commit))
                round_id += 1 if same_round else 2
                if not _send(sock, out):
                    return
        finally:
            sock.close()

    _on_links(one, port, vocab, slots, start, connections, source, ready, key)
    return sum(d for d, _ in tally), sum(r for _, r in tally)


def squat(
    port: int,
    vocab: int,
    *,
    period: float,
    stop: _Switch,
    source: str | None = None,
    ready: Callable[[], object] | None = None,
    reopen: bool = False,
) -> int:
    """Hold a connection without drawing: open slot 0, then every ``period`` seconds
    COMMIT one token of a round never stepped (a target-only COMMIT), or with
    ``reopen`` CLOSE slot 0 and OPEN it again, until ``stop``. A connection the
    worker closes is made again at once. ``ready`` is called once the first
    connection holds its slot. Returns how often the worker closed it.

    Raises:
        OSError, ConnectionError: if the worker cannot be reached at the start.
    """
    start = [1, 2, 3]
    closed = 0
    link: AttackLink | None
    link = open_link(port, vocab, 1, start, source=source)
    if ready is not None:
        ready()
    while not stop.is_set():
        if link is None:
            try:
                link = open_link(port, vocab, 1, start, source=source)
            except (OSError, ConnectionError):
                stop.wait(0.05)
                continue
        sock, session, _ = link
        prefix, round_id = PrefixDigest(start), 0
        decoder = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
        alive = True
        while alive and not stop.wait(period):
            if reopen:
                round_id += 1  # the generation of the next OPEN
                data = framing.encode_frame(Close(session=session, slot=0))
                data += framing.encode_frame(
                    open_message(session, 0, start, generation=round_id), token_bytes(start)
                )
                answer = MsgType.OPENED
            else:
                token = 4 + round_id % 50
                prefix.extend([token])
                commit = commit_at(session, 0, round_id, prefix, token)
                round_id += 1
                data, answer = framing.encode_frame(commit), MsgType.COMMITTED
            try:
                sock.sendall(data)
                sock.settimeout(5.0)
                frames = decoder.feed(sock.recv(1 << 16))
            except (OSError, ProtocolError):
                frames = []
            alive = any(f.type is answer for f in frames)
        if alive:  # stopped: was it closed meanwhile (an ERROR, or EOF, waiting)?
            sock.setblocking(False)
            try:
                left = sock.recv(1 << 16)
                alive = bool(left) and not any(f.type is MsgType.ERROR for f in decoder.feed(left))
            except BlockingIOError:
                pass
            except (OSError, ProtocolError):
                alive = False
        sock.close()
        link = None
        closed += not alive
    return closed
