"""Spark-side conformance: a hostile worker runs numbered cases against any Spark implementation.

``pp1-conformance --spark [--spark-cmd TEMPLATE]`` listens on loopback as a worker (a real
worker core whose frames a case may corrupt, reorder, delay, duplicate or cut)
and starts the Spark implementation once per case from ``TEMPLATE``. The
template's placeholders: ``{worker}`` (HOST:PORT to connect to), ``{vocab}``
(always 8: the cases' q rows are written for it), ``{support}`` (0 for dense q,
else the sparse support K), ``{q}`` (the same as ``dense`` or ``sparse:K``) and
``{psk_args}`` (``--psk-file FILE`` in the authentication cases, else empty).

``--listen HOST:PORT`` fixes where the suite listens, for a Spark side whose
worker address is configured elsewhere. The command must connect, run one
request of at least two rounds on one slot (depth 3 and at least 8 tokens, so
that a proposal can be corrupted and later rounds still run), and exit.
Everything it sends is recorded and graded against ``docs/protocol.md``:

- **discard** cases: the corrupted proposal must never be consumed. No COMMIT
  may name the corrupted round; the next COMMIT on that connection must be a
  target-only one (``accepted = 0``, a fresh round ID, §6.5).
- **drop** cases: the stray frames are extra; the honest proposal must still
  be used (a COMMIT names its round) and nothing falls back.
- **use** cases: an honest reply delivered oddly (1-byte or slow writes) must
  be used, with no fallback.
- **refuse** cases (handshake, authentication): the Spark side must send its
  fatal ERROR with the expected code and never OPEN or STEP there.

The reason is checked too when the command prints, as its last line on stdout,
a JSON object with ``fallbacks_by_reason``, ``frames_dropped`` and
``frames_rejected`` (code names in lower case, as ``pp1-spark --json`` does);
``--no-reasons`` skips that for implementations that report reasons elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgspec
import numpy as np

from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode
from pp1wire.q.dyadic import M
from pp1wire.testing.builders import completion, dense_payload, reply_row, whole_reply
from pp1wire.wire import framing
from pp1wire.wire.messages import (
    Challenge,
    Commit,
    Error,
    Hello,
    Message,
    MsgType,
    Scope,
    Step,
)
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol

VOCAB = 8
H, Q = 0.5, 0.25
GOOD = [M // 2, 0, M // 4, 0, 0, 0, 0, M // 4]
PSK = b"pp1-conformance-spark-side-key-0"
DEFAULT_SPARK_CMD = (
    "pp1-spark --worker {worker} --vocab {vocab} --requests 1 --concurrency 1 "
    "--max-tokens 12 --depth 3 --support {q} --reply-timeout 1 --connect-timeout 3 "
    "--json {psk_args}"
)


def _dense(values: list[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def _sparse(ids: list[int], values: list[float]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes() + np.asarray(values, dtype="<f4").tobytes()


def _ok(st: Step, i: int) -> bytes:
    if st.support:
        return reply_row(st, i, 7, _sparse([7], [1.0]))
    return reply_row(st, i, 0, dense_payload(GOOD))


def _first_bad(st: Step, row: bytes) -> bytes:
    """A reply whose row 0 is ``row`` and whose other rows are valid."""
    return whole_reply(st, row, *(_ok(st, i) for i in range(1, st.depth)))


Build = Callable[[Step], bytes]

# Every reply-side rejection class: name, sparse support (0 = dense), builder, code.
REPLY_CLASSES: list[tuple[str, int, Build, ErrorCode]] = [
    (
        "non_finite",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _dense([H, 0, Q, np.nan, 0, 0, 0, Q]))),
        ErrorCode.NON_FINITE,
    ),
    (
        "negative",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _dense([H, 0, Q, -0.0, 0, 0, 0, Q]))),
        ErrorCode.NEGATIVE,
    ),
    (
        "non_dyadic",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _dense([H, 0, Q, 2.0**-30, 0, 0, 0, Q]))),
        ErrorCode.NON_DYADIC,
    ),
    (
        "wrong_total_mass",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _dense([H, 0, Q, 0, 0, 0, 0, 0]))),
        ErrorCode.MASS_MISMATCH,
    ),
    (
        "zero_q_at_proposed",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 1, dense_payload(GOOD))),
        ErrorCode.ZERO_Q_AT_PROPOSED,
    ),
    (
        "proposed_out_of_range",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, VOCAB, dense_payload(GOOD))),
        ErrorCode.PROPOSED_OUT_OF_RANGE,
    ),
    (
        "unexpected_size",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 0, dense_payload(GOOD, VOCAB - 1))),
        ErrorCode.ROW_LENGTH,
    ),
    (
        "missing_q",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 0, b"", entries=0)),
        ErrorCode.MISSING_Q,
    ),
    (
        "row_checksum",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 0, dense_payload(GOOD), checksum=5)),
        ErrorCode.ROW_CHECKSUM_MISMATCH,
    ),
    (
        "rows_out_of_order",
        0,
        lambda st: whole_reply(st, _ok(st, 1), _ok(st, 0), _ok(st, 2)),
        ErrorCode.ROW_OUT_OF_ORDER,
    ),
    (
        "row_repeated",
        0,
        lambda st: whole_reply(st, _ok(st, 0), _ok(st, 0), _ok(st, 1)),
        ErrorCode.ROW_OUT_OF_ORDER,
    ),
    (
        "completion_early",
        0,
        lambda st: _ok(st, 0) + completion(st, _ok(st, 0), 1),
        ErrorCode.COMPLETION_EARLY,
    ),
    (
        "reply_checksum",
        0,
        lambda st: whole_reply(st, _ok(st, 0), _ok(st, 1), _ok(st, 2), reply_checksum=1),
        ErrorCode.REPLY_CHECKSUM_MISMATCH,
    ),
    (
        "reply_size",
        0,
        lambda st: whole_reply(st, _ok(st, 0), _ok(st, 1), _ok(st, 2), reply_bytes=7),
        ErrorCode.REPLY_SIZE_MISMATCH,
    ),
    (
        "wrong_position",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 0, dense_payload(GOOD), position=99)),
        ErrorCode.WRONG_POSITION,
    ),
    (
        "future_generation",
        0,
        lambda st: _first_bad(
            st, reply_row(st, 0, 0, dense_payload(GOOD), generation=st.generation + 1)
        ),
        ErrorCode.FUTURE_GENERATION,
    ),
    (
        "newer_round",
        0,
        lambda st: _first_bad(st, reply_row(st, 0, 0, dense_payload(GOOD), round=st.round + 1)),
        ErrorCode.ROW_OUT_OF_ORDER,
    ),
    (
        "sparse_duplicate_ids",
        3,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _sparse([0, 0, 7], [Q, Q, H]))),
        ErrorCode.SPARSE_DUPLICATE_ID,
    ),
    (
        "sparse_duplicate_zeros",
        3,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _sparse([0, 5, 5], [1.0, 0.0, 0.0]))),
        ErrorCode.SPARSE_DUPLICATE_ID,
    ),
    (
        "sparse_unsorted",
        3,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _sparse([7, 0], [H, H]))),
        ErrorCode.SPARSE_UNSORTED,
    ),
    (
        "sparse_padded_support",
        3,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _sparse([0, -1], [H, H]))),
        ErrorCode.SPARSE_ID_OUT_OF_RANGE,
    ),
    (
        "sparse_out_of_range",
        3,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _sparse([0, VOCAB], [H, H]))),
        ErrorCode.SPARSE_ID_OUT_OF_RANGE,
    ),
    (
        "sparse_zero_entry",
        3,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _sparse([0, 7], [1.0, 0.0]))),
        ErrorCode.SPARSE_ZERO_ENTRY,
    ),
    (
        "sparse_support_too_large",
        3,
        lambda st: _first_bad(st, reply_row(st, 0, 0, _sparse([0, 2, 5, 7], [Q, Q, Q, Q]))),
        ErrorCode.SUPPORT_TOO_LARGE,
    ),
    (
        "dense_row_for_sparse_step",
        3,
        lambda st: _first_bad(
            st, reply_row(st, 0, 0, dense_payload(GOOD), representation=0, entries=VOCAB)
        ),
        ErrorCode.BAD_REPRESENTATION,
    ),
]


# -- the hostile worker ---------------------------------------------------------------------


class Conn(asyncio.Protocol):
    """One connection to the Spark side under test: a worker core plus the case's hooks."""

    def __init__(self, worker: HostileWorker) -> None:
        self.worker = worker
        self.core = WorkerProtocol(
            worker.config, worker.drafter, session=len(worker.conns) + 1, now=time.monotonic()
        )
        self.decoder = framing.FrameDecoder(1 << 24)
        self.inbound: list[Message] = []
        self.honest: list[bytes] = []  # every honest reply the core produced, in order
        self.transport: asyncio.Transport | None = None
        self.greeting = worker.case.greeting

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Register the connection."""
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.worker.conns.append(self)

    def data_received(self, data: bytes) -> None:
        """Record what the Spark side sent, feed the worker core, pass its output on."""
        try:
            self.inbound += [f.message for f in self.decoder.feed(data)]
        except Exception:  # a broken frame is graded from the record
            self.inbound.append(Error(code=int(ErrorCode.HEADER_INVALID), answers=0, scope=0))
        greeting, self.greeting = self.greeting, None
        if greeting is not None:
            # After the Spark side's HELLO, before ours: it is waiting for HELLO.
            self.write(greeting)
        self.core.receive_data(data, time.monotonic())
        out = b"".join(self.core.data_to_send())
        if out:
            self._forward(out)

    def _forward(self, out: bytes) -> None:
        case = self.worker.case
        plain: list[bytes] = []
        reply: list[bytes] = []
        for f in framing.FrameDecoder(1 << 26).feed(out):
            raw = bytes(f.raw)
            edit = case.edits.get(f.type)
            if edit is not None:
                raw = framing.encode_frame(edit(f.message), bytes(f.payload))
            (reply if f.type in (MsgType.REPLY, MsgType.COMPLETION) else plain).append(raw)
        if plain:
            self.write(b"".join(plain))
        if not reply:
            return
        honest = b"".join(reply)
        index = len(self.honest)
        self.honest.append(honest)
        step = self.core.slots[0].fence.last_step if 0 in self.core.slots else None
        if case.reply is None or index != case.on_reply or step is None:
            self.write(honest)
            return
        self.worker.target_round = step.round
        result = case.reply(self, msgspec.structs.replace(step), honest)
        if result is not None:
            self.worker.tasks.append(asyncio.ensure_future(result))

    def write(self, data: bytes) -> None:
        """Send ``data`` to the Spark side if the connection is still open."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def abort(self) -> None:
        """Cut the connection without a goodbye."""
        if self.transport is not None:
            self.transport.abort()


ReplyHook = Callable[[Conn, Step, bytes], Awaitable[None] | None]


class Expect(Enum):
    """What a conforming Spark side does in a case."""

    DISCARD = "discard"  # never consume the proposal; decode the round target-only
    DROP = "drop"  # ignore the stray frames (counted as dropped); consume the honest proposal
    REJECT = "reject"  # as DROP, counted as rejected
    REFUSE = "refuse"  # fatal ERROR with the code; no OPEN or STEP on that connection
    USE = "use"  # an honest proposal delivered oddly: consume it, no fallback


@dataclass
class SparkCase:
    """One numbered Spark-side case."""

    id: str
    title: str
    rule: str
    expect: Expect
    code: ErrorCode | None
    support: int = 0
    reply: ReplyHook | None = None
    on_reply: int = 0  # which reply of the first connection the hook gets (0 = first)
    edits: dict[MsgType, Callable[[Any], Message]] = field(default_factory=dict)
    greeting: bytes | None = None
    worker_psk: bytes | None = None
    spark_psk: bytes | None = None
    also_dropped: ErrorCode | None = None  # a DISCARD case whose later frames must be dropped


@dataclass
class HostileWorker:
    """A listening worker core (toy drafter, vocabulary 8) whose frames ``case`` may change."""

    case: SparkCase
    conns: list[Conn] = field(default_factory=list)
    tasks: list[asyncio.Future[None]] = field(default_factory=list)
    target_round: int | None = None
    server: asyncio.Server | None = None

    def __post_init__(self) -> None:
        """Build the worker's configuration and drafter."""
        self.config = WorkerConfig(vocab_size=VOCAB, psk=self.case.worker_psk)
        self.drafter = ToyLM(VOCAB, 3, draft=True).logits

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (port 0: any free one); returns the port."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: Conn(self), host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Cancel pending hooks, abort every connection and stop listening."""
        for t in self.tasks:
            t.cancel()
        for c in self.conns:
            c.abort()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


# -- hooks ----------------------------------------------------------------------------------


def send(build: Build) -> ReplyHook:
    """Answer the STEP with ``build(step)`` instead of the honest reply."""

    def hook(conn: Conn, st: Step, _honest: bytes) -> None:
        conn.write(build(st))

    return hook


def before(build: Build) -> ReplyHook:
    """Send ``build(step)`` and then the honest reply."""

    def hook(conn: Conn, st: Step, honest: bytes) -> None:
        conn.write(build(st) + honest)

    return hook


def after(build: Callable[[Step, bytes], bytes]) -> ReplyHook:
    """Send the honest reply and then ``build(step, honest)``."""

    def hook(conn: Conn, st: Step, honest: bytes) -> None:
        conn.write(honest + build(st, honest))

    return hook


def trickle(chunk: int, pause: float) -> ReplyHook:
    """Send the honest reply ``chunk`` bytes at a time, ``pause`` seconds apart."""

    async def run(conn: Conn, honest: bytes) -> None:
        for i in range(0, len(honest), chunk):
            conn.write(honest[i : i + chunk])
            await asyncio.sleep(pause)

    def hook(conn: Conn, _st: Step, honest: bytes) -> Awaitable[None]:
        return run(conn, honest)

    return hook


def cut(keep: Callable[[bytes], int]) -> ReplyHook:
    """Send the first ``keep(honest)`` bytes of the honest reply, then abort the connection."""

    def hook(conn: Conn, _st: Step, honest: bytes) -> None:
        conn.write(honest[: keep(honest)])
        conn.abort()

    return hook


def silence(conn: Conn, _st: Step, _honest: bytes) -> None:
    """Never answer the STEP."""


def _frames(data: bytes) -> list[bytes]:
    return [bytes(f.raw) for f in framing.FrameDecoder(1 << 26).feed(data)]


def _hello(**over: Any) -> Callable[[Any], Message]:
    def edit(msg: Any) -> Message:
        assert isinstance(msg, Hello)
        return msgspec.structs.replace(msg, **over)

    return edit


def _bad_proof(msg: Any) -> Message:
    assert isinstance(msg, Challenge)
    return msgspec.structs.replace(msg, proof=bytes(b ^ 0xFF for b in msg.proof))


def _step_error(code: ErrorCode) -> Build:
    def build(st: Step) -> bytes:
        err = Error(
            code=int(code),
            answers=int(MsgType.STEP),
            scope=int(Scope.SLOT),
            slot=st.slot,
            generation=st.generation,
            round=st.round,
        )
        return framing.encode_frame(err)

    return build


# -- the cases ------------------------------------------------------------------------------


def _cases() -> list[SparkCase]:
    out: list[SparkCase] = []
    for n, (name, support, build, code) in enumerate(REPLY_CLASSES, 1):
        out.append(
            SparkCase(
                f"S1.{n}",
                f"reply class {name} discards the proposal",
                "§4.5, §4.6, §6.2: a row or reply that breaks the contract is discarded whole",
                Expect.DISCARD,
                code,
                support=support,
                reply=send(build),
            )
        )
    stale_round: Build = lambda st: _ok(msgspec.structs.replace(st, round=st.round - 1), 0)  # noqa: E731
    other_session: Build = lambda st: _ok(msgspec.structs.replace(st, session=st.session + 1), 0)  # noqa: E731
    other_slot: Build = lambda st: _ok(msgspec.structs.replace(st, slot=st.slot + 5), 0)  # noqa: E731
    out += [
        SparkCase(
            "S2.1",
            "a row of an earlier round, before the honest reply, is dropped",
            "§7: round older than the in-flight round: drop (ROUND_REUSED)",
            Expect.DROP,
            ErrorCode.ROUND_REUSED,
            reply=before(stale_round),
            on_reply=1,
        ),
        SparkCase(
            "S2.2",
            "a row of another session is rejected",
            "§7: session differs: reject (WRONG_SESSION)",
            Expect.REJECT,
            ErrorCode.WRONG_SESSION,
            reply=before(other_session),
        ),
        SparkCase(
            "S2.3",
            "a row for a slot that is not open is dropped",
            "§7: slot not open: drop (UNKNOWN_SLOT)",
            Expect.DROP,
            ErrorCode.UNKNOWN_SLOT,
            reply=before(other_slot),
        ),
        SparkCase(
            "S2.4",
            "a second COMPLETION of a used reply is dropped",
            "§7: in-flight proposal already completed: drop (COMPLETION_DUPLICATE)",
            Expect.DROP,
            ErrorCode.COMPLETION_DUPLICATE,
            reply=after(lambda _st, honest: _frames(honest)[-1]),
        ),
        SparkCase(
            "S2.5",
            "the previous round's whole reply, replayed after this round's, is dropped",
            "§7: round older than the in-flight round: drop (ROUND_REUSED)",
            Expect.DROP,
            ErrorCode.ROUND_REUSED,
            reply=lambda conn, _st, honest: conn.write(honest + conn.honest[-2]),
            on_reply=1,
        ),
        SparkCase(
            "S2.6",
            "frames after a discard are dropped as late, never consumed",
            "§7: in-flight proposal already discarded: drop (LATE_FRAME)",
            Expect.DISCARD,
            ErrorCode.ROW_CHECKSUM_MISMATCH,
            reply=send(
                lambda st: _first_bad(st, reply_row(st, 0, 0, dense_payload(GOOD), checksum=5))
            ),
            also_dropped=ErrorCode.LATE_FRAME,
        ),
        SparkCase(
            "S3.1",
            "the worker refuses the STEP with an ERROR: the round falls back",
            "§4.9, §6.5: an ERROR answering the in-flight STEP discards it",
            Expect.DISCARD,
            ErrorCode.DEPTH_OUT_OF_RANGE,
            reply=send(_step_error(ErrorCode.DEPTH_OUT_OF_RANGE)),
        ),
        SparkCase(
            "S3.2",
            "a COMPLETION with a failure status discards the proposal",
            "§4.6: status != 0: the proposal is discarded under that code",
            Expect.DISCARD,
            ErrorCode.ZERO_MASS,
            reply=send(lambda st: completion(st, b"", 0, status=int(ErrorCode.ZERO_MASS))),
        ),
        SparkCase(
            "S3.3",
            "no reply at all: the proposal times out",
            "§6.5: a timed-out proposal is discarded whole",
            Expect.DISCARD,
            ErrorCode.REPLY_TIMEOUT,
            reply=silence,
        ),
        SparkCase(
            "S3.4",
            "a reply trickled slower than the reply timeout is discarded",
            "§6.5: a proposal incomplete at its reply timeout is discarded whole",
            Expect.DISCARD,
            ErrorCode.REPLY_TIMEOUT,
            reply=trickle(64, 0.4),
        ),
        SparkCase(
            "S3.5",
            "an honest reply in 1-byte writes is used",
            "§2: frames are a byte stream; any segmentation is valid",
            Expect.USE,
            None,
            reply=trickle(1, 0.0005),
        ),
        SparkCase(
            "S3.6",
            "an honest reply in slow 7-byte writes within the timeout is used",
            "§2: any segmentation and pacing within the reply timeout is valid",
            Expect.USE,
            None,
            reply=trickle(7, 0.002),
        ),
        SparkCase(
            "S3.7",
            "connection closed after half a reply: nothing of it is used",
            "§6.5: a lost proposal is discarded whole",
            Expect.DISCARD,
            ErrorCode.CONNECTION_LOST,
            reply=cut(lambda honest: len(honest) // 2),
        ),
        SparkCase(
            "S3.8",
            "connection closed just before the COMPLETION: nothing is used",
            "§4.6: a proposal exists only once its COMPLETION validates",
            Expect.DISCARD,
            ErrorCode.CONNECTION_LOST,
            reply=cut(lambda honest: len(honest) - len(_frames(honest)[-1])),
        ),
        SparkCase(
            "S3.9",
            "garbage bytes in place of a reply: fatal BAD_MAGIC, nothing used",
            "§3.1: a bad magic is fatal; the in-flight proposal is discarded",
            Expect.DISCARD,
            ErrorCode.BAD_MAGIC,
            reply=send(lambda _st: b"\x00" * 64),
        ),
        SparkCase(
            "S3.10",
            "a frame declaring more than max_frame bytes: fatal before allocation",
            "§3.1, §8: FRAME_TOO_LARGE; the in-flight proposal is discarded",
            Expect.DISCARD,
            ErrorCode.FRAME_TOO_LARGE,
            reply=send(lambda st: _too_large(_ok(st, 0))),
        ),
    ]
    hello_cases: list[tuple[str, dict[str, Any], ErrorCode]] = [
        ("wire_version", {"wire_version": 99}, ErrorCode.WIRE_VERSION_MISMATCH),
        ("q_semantic", {"q_semantic": "float32-v0"}, ErrorCode.Q_SEMANTIC_MISMATCH),
        ("verifier", {"verifier": "other-verifier"}, ErrorCode.VERIFIER_MISMATCH),
        ("rng_abi", {"rng_abi": "xorshift-v0"}, ErrorCode.RNG_ABI_MISMATCH),
        ("precision", {"precision": "bf16"}, ErrorCode.PRECISION_MISMATCH),
        ("vocab_size", {"vocab_size": VOCAB - 1}, ErrorCode.VOCAB_SIZE_MISMATCH),
        ("vocab_hash", {"vocab_hash": 12345}, ErrorCode.VOCAB_HASH_MISMATCH),
        ("target_identity", {"target_identity": "other-target"}, ErrorCode.IDENTITY_MISMATCH),
    ]
    for n, (name, over, code) in enumerate(hello_cases, 1):
        out.append(
            SparkCase(
                f"S4.{n}",
                f"worker HELLO with another {name} is refused",
                "§4.1: every identity field must match exactly; refuse before any OPEN",
                Expect.REFUSE,
                code,
                edits={MsgType.HELLO: _hello(**over)},
            )
        )
    out += [
        SparkCase(
            "S4.9",
            "a COMPLETION before the worker's HELLO is fatal",
            "§5: before HELLO only HELLO, CHALLENGE, ERROR, PING, PONG may arrive",
            Expect.REFUSE,
            ErrorCode.HANDSHAKE_REQUIRED,
            greeting=completion(
                Step(
                    session=1,
                    slot=0,
                    generation=0,
                    round=0,
                    position=0,
                    digest=0,
                    depth=1,
                    temperature=1.0,
                    support=0,
                    context=0,
                ),
                b"",
                0,
            ),
        ),
        SparkCase(
            "S5.1",
            "the worker demands a key the Spark side does not have",
            "§5: CHALLENGE without a configured key: AUTH_REQUIRED, no OPEN",
            Expect.REFUSE,
            ErrorCode.AUTH_REQUIRED,
            worker_psk=PSK,
        ),
        SparkCase(
            "S5.2",
            "the worker's proof is made with another key",
            "§5: a CHALLENGE whose proof does not verify: AUTH_FAILED, no AUTH, no OPEN",
            Expect.REFUSE,
            ErrorCode.AUTH_FAILED,
            worker_psk=PSK,
            spark_psk=PSK[::-1],
        ),
        SparkCase(
            "S5.3",
            "a forged CHALLENGE proof (right key, flipped bytes)",
            "§5: the Spark side verifies the worker's proof before answering",
            Expect.REFUSE,
            ErrorCode.AUTH_FAILED,
            worker_psk=PSK,
            spark_psk=PSK,
            edits={MsgType.CHALLENGE: _bad_proof},
        ),
        SparkCase(
            "S5.4",
            "a worker that skips authentication when the Spark side requires it",
            "§5: a Spark side with a key never accepts an unauthenticated HELLO",
            Expect.REFUSE,
            ErrorCode.AUTH_REQUIRED,
            spark_psk=PSK,
        ),
    ]
    return out


def _too_large(frame: bytes) -> bytes:
    # The preamble's length fields are rewritten to claim a 1 GiB payload (and its
    # checksum recomputed) so only the size bound, not the checksum, can refuse it.
    header_len = int.from_bytes(frame[6:8], "little")
    header = frame[framing.PREAMBLE_SIZE : framing.PREAMBLE_SIZE + header_len]
    payload = frame[framing.PREAMBLE_SIZE + header_len :]
    return framing.encode_raw_frame(frame[3], header, payload, payload_len=1 << 30)[
        : framing.PREAMBLE_SIZE + header_len
    ]


SPARK_CASES: list[SparkCase] = _cases()


# -- running and grading --------------------------------------------------------------------


@dataclass
class SparkRun:
    """What one case's Spark process did."""

    returncode: int | None
    stdout: str
    stderr: str
    summary: dict[str, Any] | None


class CaseFailedError(Exception):
    """The Spark side under test broke the case's rule."""


async def _spark(cmd: str, timeout: float) -> SparkRun:
    proc = await asyncio.create_subprocess_shell(
        cmd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        out, err = await proc.communicate()
    text = out.decode(errors="replace")
    summary = None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines:
        with contextlib.suppress(ValueError):
            loaded = json.loads(lines[-1])
            summary = loaded if isinstance(loaded, dict) else None
    return SparkRun(proc.returncode, text, err.decode(errors="replace"), summary)


def _count(summary: dict[str, Any], key: str, code: ErrorCode) -> int:
    table = summary.get(key) or {}
    return int(table.get(code.name.lower(), 0)) if isinstance(table, dict) else 0


def grade(case: SparkCase, worker: HostileWorker, run: SparkRun, reasons: bool) -> None:
    """Check what the Spark side did against the case's rule.

    Raises:
        CaseFailedError: with one line saying what broke the rule.
    """
    if not worker.conns:
        raise CaseFailedError("the Spark side never connected")
    first = worker.conns[0].inbound
    kinds = [type(m).__name__ for m in first]
    commits = [m for m in first if isinstance(m, Commit)]
    if case.expect is Expect.REFUSE:
        if any(k in ("Open", "Step", "Commit") for k in kinds):
            raise CaseFailedError(f"the Spark side went on past a refused handshake: {kinds}")
        codes = [ErrorCode(m.code).name for m in first if isinstance(m, Error)]
        assert case.code is not None
        if case.code.name not in codes:
            raise CaseFailedError(f"expected a fatal ERROR {case.code.name}, got {codes or 'none'}")
        return
    if run.returncode != 0:
        raise CaseFailedError(f"exit status {run.returncode}: {run.stderr.strip()[-300:]}")
    target = worker.target_round
    if target is None:
        raise CaseFailedError("the Spark side never sent the STEP the case answers")
    used = [c for c in commits if c.round == target]
    if case.expect is Expect.DISCARD:
        if used:
            raise CaseFailedError(
                f"round {target} was committed (accepted={used[0].accepted}) from a bad proposal"
            )
        later = [c for c in commits if c.round > target]
        if later and later[0].accepted != 0:
            raise CaseFailedError(f"the fallback COMMIT has accepted={later[0].accepted}, not 0")
    elif not used:
        raise CaseFailedError(f"the honest proposal of round {target} was not used")
    if not reasons:
        return
    if run.summary is None:
        raise CaseFailedError("no JSON summary on the last stdout line (or pass --no-reasons)")
    fallbacks = run.summary.get("fallbacks_by_reason") or {}
    if case.expect is Expect.DISCARD:
        assert case.code is not None
        if _count(run.summary, "fallbacks_by_reason", case.code) < 1:
            raise CaseFailedError(f"fallback reasons {fallbacks}, expected {case.code.name}")
        if case.also_dropped and _count(run.summary, "frames_dropped", case.also_dropped) < 1:
            raise CaseFailedError(f"no frame dropped as {case.also_dropped.name}")
        return
    if fallbacks:
        raise CaseFailedError(f"fell back ({fallbacks}) where nothing was wrong with the proposal")
    if case.expect in (Expect.DROP, Expect.REJECT):
        assert case.code is not None
        key = "frames_dropped" if case.expect is Expect.DROP else "frames_rejected"
        if _count(run.summary, key, case.code) < 1:
            raise CaseFailedError(f"{key} {run.summary.get(key)}, expected {case.code.name}")


async def run_spark_case(
    case: SparkCase,
    template: str,
    *,
    reasons: bool = True,
    timeout: float = 20.0,
    host: str = "127.0.0.1",
    port: int = 0,
) -> str | None:
    """Run one case: None if the Spark side passed, else what it did wrong.

    ``host:port`` is where the hostile worker listens (a Spark side whose worker
    address is fixed is tested there; the command then only has to start it).

    Raises:
        OSError: the address cannot be listened on.
    """
    worker = HostileWorker(case)
    port = await worker.start(host, port)
    psk_args = ""
    with tempfile.TemporaryDirectory() as tmp:
        if case.spark_psk is not None:
            key = os.path.join(tmp, "psk")
            with open(key, "wb") as f:
                f.write(case.spark_psk)
            psk_args = f"--psk-file {shlex.quote(key)}"
        cmd = template.format(
            worker=f"{host}:{port}",
            vocab=VOCAB,
            support=case.support,
            q=f"sparse:{case.support}" if case.support else "dense",
            psk_args=psk_args,
        )
        try:
            run = await _spark(cmd, timeout)
            grade(case, worker, run, reasons)
        except CaseFailedError as exc:
            return str(exc)
        finally:
            await worker.stop()
    return None
