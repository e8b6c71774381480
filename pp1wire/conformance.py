"""``pp1-conformance``: numbered protocol cases run against any worker endpoint.

In the manner of h2spec and Autobahn|Testsuite: every case is numbered by the
section of ``docs/protocol.md`` it checks, quotes the rule, sends one exact
stimulus and expects one exact reaction (an ERROR code, a reply, a closed
connection). Cases that the worker should survive then check that nothing
changed: the slot's last STEP, retried, must still get the byte-identical
reply, and fatal cases check that a fresh connection still works.

Grades: ``pass``; ``non-strict`` (the reaction is safe but not the one the
document prefers, e.g. a fatal error closed the connection without an ERROR
frame; counted as a failure with ``--strict``); ``fail``; ``informational``
(reported, never fails the run). The exit code is 0 only when every
non-informational case passes.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import math
import secrets
import ssl as ssl_module
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any

import msgspec
import numpy as np

from pp1wire import dyadic, framing, messages
from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.handshake import AUTH_SPARK_LABEL, AUTH_WORKER_LABEL
from pp1wire.messages import (
    Auth,
    Close,
    Commit,
    Error,
    Hello,
    Message,
    MsgType,
    Open,
    Ping,
    Reset,
    Role,
    Step,
)
from pp1wire.proposal import prefix_digest
from pp1wire.rng import ABI_NAME
from pp1wire.settings import SettingsError, host_port, parse


class Grade(Enum):
    """How a case ended."""

    PASS = "pass"  # noqa: S105 - a grade name, not a secret
    NON_STRICT = "non-strict"
    FAIL = "fail"
    INFO = "informational"


@dataclass
class Outcome:
    """A grade and what was seen."""

    grade: Grade
    detail: str = ""


class CaseFailed(Exception):  # noqa: N818 - a control-flow signal, not an error type
    """Raised inside a case to fail it with a message."""


class NonStrict(Exception):  # noqa: N818 - a control-flow signal, not an error type
    """Raised inside a case when the reaction is safe but not the preferred one."""


class NonStrictSkip(Exception):  # noqa: N818 - a control-flow signal
    """The case cannot run with the given settings (reported as informational)."""


@dataclass
class Settings:
    """What the suite needs to know about the worker under test."""

    host: str
    port: int
    vocab: int = 129_280
    vocab_hash: int = 0
    target_identity: str = "pp1-toy-target"
    psk: bytes | None = None
    ssl: ssl_module.SSLContext | None = None
    timeout: float = 3.0
    slots: int = 2
    support: int = 8
    handshake_wait: float = 12.0


# -- a raw peer ------------------------------------------------------------------


class Peer:
    """A raw connection that sends exact bytes and reads decoded frames."""

    def __init__(self, settings: Settings) -> None:
        """Prepare (call :meth:`connect`)."""
        self.s = settings
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.decoder = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
        self.pending: list[framing.Frame] = []
        self.raw_log = bytearray()
        self.session = 0
        self.hello_msg: Hello = self.hello()
        self.eof = False

    async def connect(self) -> Peer:
        """Open the TCP (or TLS) connection."""
        self.reader, self.writer = await asyncio.open_connection(
            self.s.host, self.s.port, ssl=self.s.ssl, limit=1 << 26
        )
        return self

    def send(self, data: bytes) -> None:
        """Write raw bytes."""
        assert self.writer is not None
        self.writer.write(data)

    def send_msg(self, msg: Message, payload: bytes = b"") -> None:
        """Write one framed message."""
        self.send(framing.encode_frame(msg, payload))

    async def _read_more(self, deadline: float) -> bool:
        assert self.reader is not None
        remaining = deadline - time.monotonic()
        if remaining <= 0 or self.eof:
            return False
        try:
            data = await asyncio.wait_for(self.reader.read(1 << 20), remaining)
        except TimeoutError:
            return False
        except (ConnectionError, OSError):
            self.eof = True
            return False
        if not data:
            self.eof = True
            return False
        self.raw_log += data
        try:
            self.pending += self.decoder.feed(data)
        except ProtocolError as exc:
            raise CaseFailed(f"worker sent an undecodable frame: {exc.code.name}") from None
        return True

    async def next(self, timeout: float | None = None) -> framing.Frame | None:
        """The next frame, or None on timeout or EOF."""
        deadline = time.monotonic() + (self.s.timeout if timeout is None else timeout)
        while not self.pending:
            if not await self._read_more(deadline):
                return None
        return self.pending.pop(0)

    async def expect(self, kind: MsgType, timeout: float | None = None) -> framing.Frame:
        """The next frame, which must be of ``kind``.

        Raises:
            CaseFailed: on timeout, EOF, or another frame type (ERROR code included).
        """
        frame = await self.next(timeout)
        if frame is None:
            raise CaseFailed(f"expected {kind.name}, got {'EOF' if self.eof else 'nothing'}")
        if frame.type is not kind:
            raise CaseFailed(f"expected {kind.name}, got {describe(frame)}")
        return frame

    async def expect_error(
        self, code: ErrorCode, *, fatal: bool, answers: MsgType | None = None
    ) -> None:
        """Expect ERROR with ``code`` (and, if fatal, scope 2 and then EOF).

        Raises:
            CaseFailed: wrong reaction; NonStrict: closed without an ERROR frame.
        """
        frame = await self.next()
        if frame is None:
            if fatal and self.eof:
                raise NonStrict(f"closed without an ERROR frame (expected {code.name})")
            raise CaseFailed(f"expected ERROR {code.name}, got {'EOF' if self.eof else 'nothing'}")
        if frame.type is not MsgType.ERROR:
            raise CaseFailed(f"expected ERROR {code.name}, got {describe(frame)}")
        err = frame.message
        assert isinstance(err, Error)
        if err.code != code:
            raise CaseFailed(f"expected ERROR {code.name}, got {describe(frame)}")
        if answers is not None and err.answers not in (0, int(answers)):
            raise CaseFailed(f"ERROR answers type {err.answers}, expected {int(answers)}")
        if fatal:
            if err.scope != 2:
                raise CaseFailed(f"{code.name} must be fatal (scope 2), got scope {err.scope}")
            if not await self.closed():
                raise CaseFailed("connection still open after a fatal ERROR")
        elif err.scope != 0:
            raise CaseFailed(f"{code.name} must refuse only the message, got scope {err.scope}")

    async def closed(self, timeout: float | None = None) -> bool:
        """True if the worker closes the connection (frames in between are ignored)."""
        deadline = time.monotonic() + (self.s.timeout if timeout is None else timeout)
        while not self.eof:
            self.pending.clear()
            if not await self._read_more(deadline) and not self.eof:
                return False
        return True

    async def quiet(self, timeout: float = 0.3) -> bool:
        """True if nothing arrives for ``timeout`` seconds."""
        frame = await self.next(timeout)
        if frame is not None:
            self.pending.insert(0, frame)
        return frame is None

    def close(self) -> None:
        """Close our side."""
        if self.writer is not None:
            self.writer.close()

    # -- protocol helpers --------------------------------------------------

    def hello(self, **overrides: Any) -> Hello:
        """The suite's HELLO (with any field overridden)."""
        s = self.s
        fields: dict[str, Any] = {
            "role": int(Role.SPARK),
            "wire_version": messages.WIRE_VERSION,
            "q_semantic": dyadic.SEMANTIC_ID,
            "verifier": messages.VERIFIER_ID,
            "rng_abi": ABI_NAME,
            "precision": messages.PRECISION,
            "vocab_size": s.vocab,
            "vocab_hash": s.vocab_hash,
            "draft_identity": "",
            "draft_native": True,
            "target_identity": s.target_identity,
            "max_slots": s.slots,
            "max_depth": 5,
            "max_support": min(s.support, s.vocab),
            "row_entries": s.vocab,
            "max_frame": 4 * s.vocab + 8192,
            "max_prefix": 4096,
            "nonce": secrets.token_bytes(32),
        }
        fields.update(overrides)
        return Hello(**fields)

    async def handshake(self, hello: Hello | None = None) -> Hello:
        """Complete HELLO (and AUTH when a key is configured); returns the worker's HELLO.

        Raises:
            CaseFailed: if the worker does not answer with HELLO.
        """
        ours = hello or self.hello()
        frame = framing.encode_frame(ours)
        self.send(frame)
        reply = await self.next()
        if reply is not None and reply.type is MsgType.CHALLENGE and self.s.psk is not None:
            ch = reply.message
            assert isinstance(ch, messages.Challenge)
            want = hmac.new(self.s.psk, AUTH_WORKER_LABEL + ours.nonce + ch.nonce, hashlib.sha256)
            if not hmac.compare_digest(want.digest(), ch.proof):
                raise CaseFailed("the worker's CHALLENGE proof is wrong")
            header = frame[framing.PREAMBLE_SIZE :]
            msg = AUTH_SPARK_LABEL + ch.nonce + ours.nonce + hashlib.sha256(header).digest()
            self.send_msg(Auth(proof=hmac.new(self.s.psk, msg, hashlib.sha256).digest()))
            reply = await self.next()
        if reply is None or reply.type is not MsgType.HELLO:
            raise CaseFailed(f"handshake: expected HELLO, got {describe(reply)}")
        worker = reply.message
        assert isinstance(worker, Hello)
        self.hello_msg = worker
        self.session = worker.session
        return worker

    async def open_slot(
        self,
        slot: int = 0,
        prefix: Sequence[int] = (1, 2, 3),
        seed: int = 7,
        eos: int | None = None,
        generation: int = 0,
    ) -> None:
        """OPEN and wait for OPENED.

        Raises:
            CaseFailed: if OPENED does not come.
        """
        tokens = np.asarray(list(prefix), dtype="<i4")
        self.send_msg(
            Open(
                session=self.session,
                slot=slot,
                generation=generation,
                seed=seed,
                context=0,
                eos=eos,
                prefix_len=len(tokens),
                digest=prefix_digest(list(prefix)),
            ),
            tokens.tobytes(),
        )
        await self.expect(MsgType.OPENED)

    def step_msg(self, slot: int = 0, **over: Any) -> Step:
        """A valid sparse STEP for a slot opened at the default prefix."""
        fields: dict[str, Any] = {
            "session": self.session,
            "slot": slot,
            "generation": 0,
            "round": 0,
            "position": 3,
            "digest": prefix_digest([1, 2, 3]),
            "depth": 2,
            "temperature": 1.0,
            "support": min(self.s.support, self.s.vocab),
            "context": 0,
        }
        fields.update(over)
        return Step(**fields)

    async def reply(self, step: Step) -> tuple[bytes, list[framing.Frame]]:
        """Send STEP and collect its reply (REPLY frames and COMPLETION); returns (bytes, frames).

        Raises:
            CaseFailed: if the reply does not complete.
        """
        self.send_msg(step)
        frames = []
        while True:
            frame = await self.next()
            if frame is None:
                raise CaseFailed(f"no complete reply to STEP round {step.round}")
            if frame.type is MsgType.ERROR:
                raise CaseFailed(f"STEP refused: {describe(frame)}")
            frames.append(frame)
            if frame.type is MsgType.COMPLETION:
                return b"".join(bytes(f.raw) for f in frames), frames


def describe(frame: framing.Frame | None) -> str:
    """A short human description of a frame."""
    if frame is None:
        return "nothing"
    if frame.type is MsgType.ERROR:
        err = frame.message
        assert isinstance(err, Error)
        try:
            name = ErrorCode(err.code).name
        except ValueError:
            name = str(err.code)
        return f"ERROR {name} (scope {err.scope})"
    return frame.type.name


# -- the cases ---------------------------------------------------------------------

CaseFn = Callable[[Settings], Awaitable[None]]


@dataclass
class Case:
    """One numbered conformance case."""

    id: str
    category: str
    title: str
    rule: str
    fn: CaseFn
    informational: bool = False


CASES: list[Case] = []
_counters: dict[str, int] = {}


def case(
    section: str, category: str, title: str, rule: str, *, informational: bool = False
) -> Callable[[CaseFn], CaseFn]:
    """Register a case numbered ``section.N``."""

    def register(fn: CaseFn) -> CaseFn:
        _counters[section] = _counters.get(section, 0) + 1
        CASES.append(
            Case(f"{section}.{_counters[section]}", category, title, rule, fn, informational)
        )
        return fn

    return register


async def fresh(s: Settings) -> Peer:
    """A connected, handshaken peer."""
    peer = await Peer(s).connect()
    await peer.handshake()
    return peer


async def still_serves(s: Settings) -> None:
    """A new connection still completes a handshake and a STEP.

    Raises:
        CaseFailed: if not.
    """
    peer = await fresh(s)
    try:
        await peer.open_slot()
        await peer.reply(peer.step_msg())
    finally:
        peer.close()


async def ready(s: Settings) -> tuple[Peer, Step, bytes]:
    """A peer with slot 0 open and one STEP answered: (peer, that STEP, its reply bytes)."""
    peer = await fresh(s)
    await peer.open_slot()
    step = peer.step_msg()
    data, _ = await peer.reply(step)
    return peer, step, data


async def unchanged(peer: Peer, step: Step, data: bytes) -> None:
    """The slot's last STEP, retried, gets the byte-identical reply.

    Raises:
        CaseFailed: if not.
    """
    again, _ = await peer.reply(step)
    if again != data:
        raise CaseFailed("state changed: the retried STEP got a different reply")


raw_frame = framing.encode_raw_frame


PING_HEADER = messages.encode(Ping(nonce=1))


def _fatal_framing_case(
    section: str,
    title: str,
    rule: str,
    data: Callable[[], bytes],
    code: ErrorCode,
    *,
    after_handshake: bool = True,
) -> None:
    async def run(s: Settings) -> None:
        peer = await Peer(s).connect()
        try:
            if after_handshake:
                await peer.handshake()
            peer.send(data())
            await peer.expect_error(code, fatal=True)
        finally:
            peer.close()
        await still_serves(s)

    case(section, "framing", title, rule)(run)


R_MAGIC = "magic: bytes 0x50 0x57 ... a wrong magic is BAD_MAGIC; every framing error is fatal"
for magic in (0x0000, 0x5058, 0x5750 ^ 0xFFFF):
    _fatal_framing_case(
        "3.1",
        f"bad magic {magic:#06x}",
        R_MAGIC,
        partial(raw_frame, 16, PING_HEADER, magic=magic),
        ErrorCode.BAD_MAGIC,
    )
for version in (0, 1, 3, 255):
    _fatal_framing_case(
        "3.1",
        f"wire version {version}",
        "version: 2 ... else UNSUPPORTED_VERSION (fatal)",
        partial(raw_frame, 16, PING_HEADER, version=version),
        ErrorCode.UNSUPPORTED_VERSION,
    )
for kind in (0, 18, 99, 255):
    _fatal_framing_case(
        "3.1",
        f"unknown message type {kind}",
        "type is a code of §4 (UNKNOWN_MESSAGE_TYPE)",
        partial(raw_frame, kind, PING_HEADER),
        ErrorCode.UNKNOWN_MESSAGE_TYPE,
    )
for bit in range(8):
    _fatal_framing_case(
        "3.1",
        f"flags bit {bit} set",
        "flags: 0; every bit is reserved (BAD_FLAGS)",
        partial(raw_frame, 16, PING_HEADER, flags=1 << bit),
        ErrorCode.BAD_FLAGS,
    )
_fatal_framing_case(
    "3.1",
    "reserved byte set",
    "reserved: 0 (BAD_FLAGS)",
    lambda: raw_frame(16, PING_HEADER, reserved=1),
    ErrorCode.BAD_FLAGS,
)
_fatal_framing_case(
    "3.1",
    "zero-length header",
    "header_len ≠ 0 (ZERO_LENGTH_HEADER)",
    lambda: raw_frame(16, b""),
    ErrorCode.ZERO_LENGTH_HEADER,
)
_fatal_framing_case(
    "3.1",
    "header longer than 4096",
    "header_len ≤ 4096 (FRAME_TOO_LARGE), before buffering",
    lambda: raw_frame(16, PING_HEADER, header_len=4097),
    ErrorCode.FRAME_TOO_LARGE,
)
_fatal_framing_case(
    "3.1",
    "payload declared 4 GiB",
    "payload_len ≤ the current payload limit (FRAME_TOO_LARGE)",
    lambda: raw_frame(4, PING_HEADER, payload_len=0xFFFFFFFF),
    ErrorCode.FRAME_TOO_LARGE,
)
_fatal_framing_case(
    "3.1",
    "payload before the handshake",
    "payload before the handshake completes: 0 bytes (§8)",
    lambda: raw_frame(4, PING_HEADER, payload_len=4) + b"\0" * 4,
    ErrorCode.FRAME_TOO_LARGE,
    after_handshake=False,
)
for kind in (MsgType.PING, MsgType.STEP, MsgType.COMMIT):
    _fatal_framing_case(
        "3.1",
        f"payload on {kind.name}",
        "payload_len = 0 unless the type is OPEN or REPLY",
        partial(raw_frame, int(kind), PING_HEADER, b"\0" * 8),
        ErrorCode.PAYLOAD_LENGTH,
    )
_fatal_framing_case(
    "3.1",
    "header checksum mismatch",
    "checksum: low 32 bits of xxh3_64(bytes[0:12] ‖ header) (PREAMBLE_CHECKSUM)",
    lambda: raw_frame(16, PING_HEADER, checksum=0x12345678),
    ErrorCode.PREAMBLE_CHECKSUM,
)


@case(
    "3.1",
    "framing",
    "trailing garbage after a valid frame",
    "frames follow each other with no padding: the next bytes must be a preamble; the "
    "valid frame ahead of the error is still handled",
)
async def _trailing(s: Settings) -> None:
    peer = await fresh(s)
    try:
        peer.send(framing.encode_frame(Ping(nonce=3)) + b"\0" * 16)
        await peer.expect(MsgType.PONG)
        await peer.expect_error(ErrorCode.BAD_MAGIC, fatal=True)
    finally:
        peer.close()
    await still_serves(s)


for name, header in [
    ("not msgpack", b"\xc1"),
    ("trailing bytes after the array", PING_HEADER + b"\x00"),
    ("an extra element", b"\x93\x10\x01\x02"),
    ("a missing element", b"\x91\x10"),
    ("a negative integer", b"\x92\x10\xff"),
    ("a float for an integer", b"\x92\x10\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00"),
    ("a map instead of an array", b"\x81\xa5nonce\x01"),
    ("a tag different from the frame type", messages.encode(messages.Pong(nonce=1))),
    ("a string for an integer", b"\x92\x10\xa1x"),
]:
    _fatal_framing_case(
        "3.2",
        f"header with {name}",
        "the header is one msgpack array ... anything else is HEADER_INVALID",
        partial(raw_frame, 16, header),
        ErrorCode.HEADER_INVALID,
    )


@case(
    "3.2", "framing", "slot above uint16", "an integer outside its stated range is HEADER_INVALID"
)
async def _slot_range(s: Settings) -> None:
    peer = await fresh(s)
    try:
        # CLOSE = [6, session, slot] with slot 65536.
        header = b"\x93\x06" + msgspec.msgpack.encode(peer.session) + b"\xce\x00\x01\x00\x00"
        peer.send(raw_frame(int(MsgType.CLOSE), header))
        await peer.expect_error(ErrorCode.HEADER_INVALID, fatal=True)
    finally:
        peer.close()


@case(
    "3.1",
    "framing",
    "truncated preamble, then silence",
    "a receiver buffers a partial frame and waits; it is not an error by itself",
    informational=True,
)
async def _truncated(s: Settings) -> None:
    peer = await fresh(s)
    try:
        peer.send(framing.encode_frame(Ping(nonce=9))[:10])
        if not await peer.quiet(0.5):
            raise CaseFailed("the worker reacted to half a preamble")
    finally:
        peer.close()


@case(
    "3.1",
    "framing",
    "handshake split at every byte",
    "frames may arrive in any number of reads; bytes are a stream",
)
async def _split(s: Settings) -> None:
    peer = await Peer(s).connect()
    try:
        frame = framing.encode_frame(peer.hello())
        assert peer.writer is not None
        for i in range(len(frame)):
            peer.send(frame[i : i + 1])
            await peer.writer.drain()
        reply = await peer.next()
        if reply is None or reply.type not in (MsgType.HELLO, MsgType.CHALLENGE):
            raise CaseFailed(f"expected HELLO, got {describe(reply)}")
    finally:
        peer.close()


@case(
    "3.1",
    "framing",
    "several frames in one read",
    "frames follow each other with no padding; each is handled in order",
)
async def _batched(s: Settings) -> None:
    peer = await fresh(s)
    try:
        peer.send(b"".join(framing.encode_frame(Ping(nonce=n)) for n in (1, 2, 3)))
        got = []
        for _ in range(3):
            frame = await peer.expect(MsgType.PONG)
            got.append(frame.message.nonce)  # type: ignore[union-attr]
        if got != [1, 2, 3]:
            raise CaseFailed(f"PONGs out of order: {got}")
    finally:
        peer.close()


@case(
    "3.1",
    "framing",
    "a STEP split across two reads inside its header",
    "frames may arrive in any number of reads",
)
async def _split_step(s: Settings) -> None:
    peer = await fresh(s)
    try:
        await peer.open_slot()
        frame = framing.encode_frame(peer.step_msg())
        assert peer.writer is not None
        peer.send(frame[:20])
        await peer.writer.drain()
        await asyncio.sleep(0.05)
        peer.send(frame[20:])
        while (f := await peer.next()) is not None and f.type is MsgType.REPLY:
            pass
        if f is None or f.type is not MsgType.COMPLETION:
            raise CaseFailed(f"expected a reply, got {describe(f)}")
    finally:
        peer.close()


# -- handshake ---------------------------------------------------------------------


def _before_hello(kind: str, build: Callable[[Peer], tuple[Message, bytes]]) -> None:
    async def run(s: Settings) -> None:
        peer = await Peer(s).connect()
        try:
            msg, payload = build(peer)
            if payload:
                # A payload before the handshake is itself a framing error; send headers only.
                payload = b""
            peer.send_msg(msg, payload)
            await peer.expect_error(ErrorCode.HANDSHAKE_REQUIRED, fatal=True)
        finally:
            peer.close()
        await still_serves(s)

    case(
        "5",
        "handshake",
        f"{kind} before HELLO",
        "any message before the handshake completes (other than PING/PONG/ERROR) is fatal "
        "(HANDSHAKE_REQUIRED)",
    )(run)


_before_hello("STEP", lambda p: (p.step_msg(), b""))
_before_hello(
    "OPEN",
    lambda p: (
        Open(
            session=0,
            slot=0,
            generation=0,
            seed=1,
            context=0,
            eos=None,
            prefix_len=0,
            digest=prefix_digest([]),
        ),
        b"",
    ),
)
_before_hello(
    "COMMIT",
    lambda p: (
        Commit(session=0, slot=0, generation=0, round=0, accepted=0, extra=1, position=4, digest=0),
        b"",
    ),
)
_before_hello("RESET", lambda p: (Reset(session=0, slot=0, generation=1), b""))
_before_hello("CLOSE", lambda p: (Close(session=0, slot=0), b""))
_before_hello("AUTH", lambda p: (Auth(proof=bytes(32)), b""))


@case("5", "handshake", "second HELLO", "a second HELLO is fatal (DUPLICATE_HELLO)")
async def _second_hello(s: Settings) -> None:
    peer = await fresh(s)
    try:
        peer.send_msg(peer.hello())
        await peer.expect_error(ErrorCode.DUPLICATE_HELLO, fatal=True)
    finally:
        peer.close()


@case(
    "4.10",
    "handshake",
    "PING before HELLO is answered",
    "either side MAY send PING at any time (also before the handshake)",
)
async def _ping_first(s: Settings) -> None:
    peer = await Peer(s).connect()
    try:
        peer.send_msg(Ping(nonce=77))
        frame = await peer.expect(MsgType.PONG)
        if frame.message.nonce != 77:  # type: ignore[union-attr]
            raise CaseFailed("PONG nonce differs")
        await peer.handshake()
    finally:
        peer.close()


def _mismatch(title: str, overrides: dict[str, Any], code: ErrorCode, rule: str) -> None:
    async def run(s: Settings) -> None:
        await _mismatch_run(s, overrides, code)

    case("4.1", "handshake", title, rule)(run)


async def _auth_reply(peer: Peer, hello: Hello) -> None:
    frame = await peer.expect(MsgType.CHALLENGE)
    ch = frame.message
    assert isinstance(ch, messages.Challenge)
    if peer.s.psk is None:
        raise CaseFailed("the worker wants a key; run with --psk-file")
    header = framing.encode_frame(hello)[framing.PREAMBLE_SIZE :]
    msg = AUTH_SPARK_LABEL + ch.nonce + hello.nonce + hashlib.sha256(header).digest()
    peer.send_msg(Auth(proof=hmac.new(peer.s.psk, msg, hashlib.sha256).digest()))


for field_name, value, code in [
    ("wire_version", 3, ErrorCode.WIRE_VERSION_MISMATCH),
    ("wire_version", 1, ErrorCode.WIRE_VERSION_MISMATCH),
    ("q_semantic", "dyadic16-standard-v1", ErrorCode.Q_SEMANTIC_MISMATCH),
    ("q_semantic", "", ErrorCode.Q_SEMANTIC_MISMATCH),
    ("verifier", "pp1-standard-verifier-v0", ErrorCode.VERIFIER_MISMATCH),
    ("rng_abi", "pp1-philox4x32-10-v2", ErrorCode.RNG_ABI_MISMATCH),
    ("precision", "bf16", ErrorCode.PRECISION_MISMATCH),
    ("vocab_hash", 0xDEADBEEF, ErrorCode.VOCAB_HASH_MISMATCH),
    ("target_identity", "some-other-target", ErrorCode.IDENTITY_MISMATCH),
    ("draft_identity", "a-pinned-unknown-drafter", ErrorCode.IDENTITY_MISMATCH),
    ("role", int(Role.WORKER), ErrorCode.UNEXPECTED_MESSAGE),
]:
    _mismatch(
        f"HELLO with {field_name} = {value!r}",
        {field_name: value},
        code,
        f"{field_name}: exact, else {code.name}",
    )


def _vocab_mismatch(delta: int) -> None:
    async def run(s: Settings) -> None:
        v = s.vocab + delta
        await _mismatch_run(
            s,
            {"vocab_size": v, "row_entries": v, "max_support": min(s.support, v)},
            ErrorCode.VOCAB_SIZE_MISMATCH,
        )

    case(
        "4.1",
        "handshake",
        f"HELLO with vocab_size {delta:+d}",
        "vocab_size: exact, else VOCAB_SIZE_MISMATCH",
    )(run)


async def _mismatch_run(s: Settings, overrides: dict[str, Any], code: ErrorCode) -> None:
    peer = await Peer(s).connect()
    try:
        hello = peer.hello(**overrides)
        peer.send_msg(hello)
        reply = await peer.next()
        if reply is not None and reply.type is MsgType.CHALLENGE:
            peer.pending.insert(0, reply)
            await _auth_reply(peer, hello)
        elif reply is not None:
            peer.pending.insert(0, reply)
        await peer.expect_error(code, fatal=True, answers=MsgType.HELLO)
    finally:
        peer.close()
    await still_serves(s)


_vocab_mismatch(+1)
_vocab_mismatch(-1)


def _limit(title: str, overrides: Callable[[Settings], dict[str, Any]]) -> None:
    async def run(s: Settings) -> None:
        await _mismatch_run(s, overrides(s), ErrorCode.LIMIT_EXCEEDED)

    case(
        "4.1",
        "handshake",
        title,
        "max_slots, max_depth, max_support: each ≤ the worker's limit; row_entries equal; "
        "max_frame, max_prefix ≤ the worker's; else LIMIT_EXCEEDED",
    )(run)


_limit("max_slots 65535", lambda s: {"max_slots": 65535})
_limit("row_entries not the worker's", lambda s: {"row_entries": s.vocab + 1})
_limit("max_frame 4 GiB - 1", lambda s: {"max_frame": 0xFFFFFFFF})
_limit("max_prefix 4 G tokens", lambda s: {"max_prefix": 0xFFFFFFFF})


@case(
    "4.1",
    "handshake",
    "HELLO with row_entries below vocab_size",
    "cross-field rules (HEADER_INVALID if broken): row_entries ≥ vocab_size",
)
async def _cross_field(s: Settings) -> None:
    peer = await Peer(s).connect()
    try:
        hello = peer.hello()
        body = msgspec.structs.asdict(hello)
        array = [int(MsgType.HELLO), *body.values()]
        array[list(body).index("row_entries") + 1] = s.vocab - 1
        peer.send(raw_frame(int(MsgType.HELLO), msgspec.msgpack.encode(array)))
        await peer.expect_error(ErrorCode.HEADER_INVALID, fatal=True)
    finally:
        peer.close()


@case(
    "4.1",
    "handshake",
    "the worker's HELLO echoes our limits and assigns a session",
    "the worker answers ... with its own HELLO, which echoes the Spark side's limits unchanged",
)
async def _echo(s: Settings) -> None:
    peer = await Peer(s).connect()
    try:
        ours = peer.hello()
        theirs = await peer.handshake(ours)
        for name in (
            "max_slots",
            "max_depth",
            "max_support",
            "row_entries",
            "max_frame",
            "max_prefix",
            "vocab_size",
            "vocab_hash",
        ):
            if getattr(theirs, name) != getattr(ours, name):
                raise CaseFailed(f"{name}: sent {getattr(ours, name)}, got {getattr(theirs, name)}")
        if theirs.role != Role.WORKER:
            raise CaseFailed("worker HELLO role is not 1")
    finally:
        peer.close()


async def _challenged(s: Settings) -> tuple[Peer, Hello, framing.Frame]:
    """A connection whose HELLO the worker answered with CHALLENGE: (peer, our HELLO, CHALLENGE).

    Raises:
        NonStrictSkip: without ``--psk-file``; CaseFailed: if no CHALLENGE comes.
    """
    if s.psk is None:
        raise NonStrictSkip("needs --psk-file")
    peer = await Peer(s).connect()
    hello = peer.hello()
    peer.send_msg(hello)
    try:
        frame = await peer.expect(MsgType.CHALLENGE)
    except CaseFailed:
        peer.close()
        raise
    return peer, hello, frame


@case("5", "handshake", "forged AUTH proof", "a wrong proof is fatal (AUTH_FAILED)")
async def _bad_auth(s: Settings) -> None:
    peer, _, _ = await _challenged(s)
    try:
        peer.send_msg(Auth(proof=bytes(32)))
        await peer.expect_error(ErrorCode.AUTH_FAILED, fatal=True)
    finally:
        peer.close()


@case(
    "5",
    "handshake",
    "STEP instead of AUTH",
    "any message other than AUTH while the worker waits for it is fatal (HANDSHAKE_REQUIRED)",
)
async def _step_not_auth(s: Settings) -> None:
    peer, _, _ = await _challenged(s)
    try:
        peer.send_msg(peer.step_msg())
        await peer.expect_error(ErrorCode.HANDSHAKE_REQUIRED, fatal=True)
    finally:
        peer.close()


@case(
    "5",
    "handshake",
    "AUTH proof bound to the HELLO bytes",
    "proof = HMAC-SHA256(psk, label ‖ N_w ‖ N_s ‖ SHA256(H)), H = our HELLO header bytes",
)
async def _auth_binding(s: Settings) -> None:
    peer, hello, frame = await _challenged(s)
    try:
        ch = frame.message
        assert isinstance(ch, messages.Challenge)
        assert s.psk is not None  # _challenged skips the case otherwise
        other = framing.encode_frame(peer.hello())[framing.PREAMBLE_SIZE :]  # another nonce
        msg = AUTH_SPARK_LABEL + ch.nonce + hello.nonce + hashlib.sha256(other).digest()
        peer.send_msg(Auth(proof=hmac.new(s.psk, msg, hashlib.sha256).digest()))
        await peer.expect_error(ErrorCode.AUTH_FAILED, fatal=True)
    finally:
        peer.close()


@case(
    "5",
    "handshake",
    "worker requires a key the suite was not given",
    "a worker with a PSK answers HELLO with CHALLENGE",
    informational=True,
)
async def _auth_info(s: Settings) -> None:
    peer = await Peer(s).connect()
    try:
        peer.send_msg(peer.hello())
        frame = await peer.next()
        if frame is None:
            raise CaseFailed("no answer to HELLO")
        if frame.type is MsgType.CHALLENGE and s.psk is None:
            raise CaseFailed("the worker requires a key; pass --psk-file for the auth cases")
    finally:
        peer.close()


@case(
    "5",
    "handshake",
    "handshake timeout drops a silent peer",
    "a worker drops a connection whose handshake does not complete within its handshake "
    "timeout (HANDSHAKE_TIMEOUT)",
)
async def _handshake_timeout(s: Settings) -> None:
    peer = await Peer(s).connect()
    try:
        peer.send(framing.encode_frame(Ping(nonce=1))[:5])  # a slow-loris start
        frame = await peer.next(s.handshake_wait)
        if frame is None:
            if peer.eof:
                raise NonStrict("closed without an ERROR frame")
            raise CaseFailed(f"still open after {s.handshake_wait:.0f} s")
        if frame.type is not MsgType.ERROR or frame.message.code != ErrorCode.HANDSHAKE_TIMEOUT:  # type: ignore[union-attr]
            raise CaseFailed(f"expected HANDSHAKE_TIMEOUT, got {describe(frame)}")
        if not await peer.closed():
            raise CaseFailed("not closed after HANDSHAKE_TIMEOUT")
    finally:
        peer.close()


# -- slots and STEP ------------------------------------------------------------------


def _step_refusal(
    title: str, section: str, rule: str, code: ErrorCode, build: Callable[[Peer, Step], Step]
) -> None:
    async def run(s: Settings) -> None:
        peer, step, data = await ready(s)
        try:
            peer.send_msg(build(peer, step))
            await peer.expect_error(code, fatal=False, answers=MsgType.STEP)
            await unchanged(peer, step, data)
        finally:
            peer.close()

    case(section, "session and STEP", title, rule)(run)


def _replace(step: Step, **kw: Any) -> Step:
    return msgspec.structs.replace(step, **kw)


def _with_temperature(_peer: Peer, step: Step, *, value: float) -> Step:
    return _replace(step, round=1, temperature=value)


_step_refusal(
    "STEP on an unknown slot",
    "7",
    "session and slot first for every message: UNKNOWN_SLOT",
    ErrorCode.UNKNOWN_SLOT,
    lambda p, st: _replace(st, slot=1),
)
_step_refusal(
    "STEP on slot 65535",
    "7",
    "UNKNOWN_SLOT",
    ErrorCode.UNKNOWN_SLOT,
    lambda p, st: _replace(st, slot=65535),
)
_step_refusal(
    "STEP with another session",
    "7",
    "session and slot first for every message: WRONG_SESSION",
    ErrorCode.WRONG_SESSION,
    lambda p, st: _replace(st, session=st.session + 1000),
)
_step_refusal(
    "depth 0",
    "4.4",
    "depth (1..max_depth) else DEPTH_OUT_OF_RANGE",
    ErrorCode.DEPTH_OUT_OF_RANGE,
    lambda p, st: _replace(st, round=1, depth=0),
)
_step_refusal(
    "depth 6",
    "4.4",
    "depth (1..max_depth) else DEPTH_OUT_OF_RANGE",
    ErrorCode.DEPTH_OUT_OF_RANGE,
    lambda p, st: _replace(st, round=1, depth=6),
)
_step_refusal(
    "depth 255",
    "4.4",
    "depth (1..max_depth) else DEPTH_OUT_OF_RANGE",
    ErrorCode.DEPTH_OUT_OF_RANGE,
    lambda p, st: _replace(st, round=1, depth=255),
)
_step_refusal(
    "support above the negotiated limit",
    "4.4",
    "support ≤ max_support ... else SUPPORT_OUT_OF_RANGE",
    ErrorCode.SUPPORT_OUT_OF_RANGE,
    lambda p, st: _replace(st, round=1, support=p.hello_msg.max_support + 1),
)
_step_refusal(
    "future generation",
    "7",
    "STEP generation > slot generation: FUTURE_GENERATION",
    ErrorCode.FUTURE_GENERATION,
    lambda p, st: _replace(st, round=1, generation=1),
)
_step_refusal(
    "reused round with other content",
    "7",
    "round = last STEP round, any field different: ROUND_REUSED",
    ErrorCode.ROUND_REUSED,
    lambda p, st: _replace(st, depth=1),
)
_step_refusal(
    "reused round, other temperature",
    "7",
    "round = last STEP round, any field different: ROUND_REUSED",
    ErrorCode.ROUND_REUSED,
    lambda p, st: _replace(st, temperature=0.5),
)
_step_refusal(
    "wrong first-draft position",
    "4.4",
    "position (WRONG_POSITION)",
    ErrorCode.WRONG_POSITION,
    lambda p, st: _replace(st, round=1, position=4),
)
_step_refusal(
    "position 0 after a 3-token prefix",
    "4.4",
    "position (WRONG_POSITION)",
    ErrorCode.WRONG_POSITION,
    lambda p, st: _replace(st, round=1, position=0),
)
_step_refusal(
    "wrong prefix digest",
    "4.4",
    "digest (PREFIX_DIGEST_MISMATCH)",
    ErrorCode.PREFIX_DIGEST_MISMATCH,
    lambda p, st: _replace(st, round=1, digest=st.digest ^ 1),
)
_step_refusal(
    "wrong context version",
    "4.4",
    "context (CONTEXT_MISMATCH)",
    ErrorCode.CONTEXT_MISMATCH,
    lambda p, st: _replace(st, round=1, context=5),
)
for label, value in (("NaN", math.nan), ("+inf", math.inf), ("negative", -1.0)):
    _step_refusal(
        f"temperature {label}",
        "4.4",
        "temperature finite and ≥ 0 (BAD_TEMPERATURE)",
        ErrorCode.BAD_TEMPERATURE,
        partial(_with_temperature, value=value),
    )


@case(
    "7",
    "session and STEP",
    "older round after a newer one",
    "STEP round < last STEP round: ROUND_REUSED",
)
async def _older_round(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        newer = _replace(step, round=5)
        data5, _ = await peer.reply(newer)
        peer.send_msg(_replace(step, round=3))
        await peer.expect_error(ErrorCode.ROUND_REUSED, fatal=False, answers=MsgType.STEP)
        await unchanged(peer, newer, data5)
    finally:
        peer.close()


@case(
    "7",
    "session and STEP",
    "retried STEP gets the byte-identical reply",
    "a retried STEP therefore returns the byte-identical reply or is refused; it is never "
    "answered with a fresh draw",
)
async def _retry(s: Settings) -> None:
    peer, step, data = await ready(s)
    try:
        for _ in range(3):
            await unchanged(peer, step, data)
    finally:
        peer.close()


@case(
    "6.4",
    "session and STEP",
    "the same STEP on two connections gets the same reply",
    "draws are keyed by (seed, generation, round, position, domain): no hidden state",
)
async def _deterministic(s: Settings) -> None:
    a, step, data = await ready(s)
    a.close()
    b = await fresh(s)
    try:
        await b.open_slot()
        other, _ = await b.reply(_replace(step, session=b.session))
        strip = [bytes(f.payload) for f in framing.FrameDecoder(1 << 26).feed(data)]
        strip2 = [bytes(f.payload) for f in framing.FrameDecoder(1 << 26).feed(other)]
        if strip != strip2:
            raise CaseFailed("payloads differ across connections for the same key")
    finally:
        b.close()


@case(
    "4.5",
    "session and STEP",
    "reply rows are well formed",
    "REPLY frames for positions 0, 1, … in order, then COMPLETION; row checksum; q contract",
)
async def _rows(s: Settings) -> None:
    peer, step, data = await ready(s)
    peer.close()
    frames = framing.FrameDecoder(1 << 26).feed(data)
    rows = [f for f in frames if f.type is MsgType.REPLY]
    done = frames[-1].message
    assert isinstance(done, messages.Completion)
    import xxhash  # noqa: PLC0415

    body = b"".join(bytes(f.raw) for f in rows)
    if done.reply_bytes != len(body) or done.reply_checksum != xxhash.xxh3_64_intdigest(body):
        raise CaseFailed("COMPLETION size or checksum does not match the rows")
    for i, f in enumerate(rows):
        r = f.message
        assert isinstance(r, messages.Reply)
        if r.index != i or r.position != step.position + i:
            raise CaseFailed(f"row {i} has index {r.index}, position {r.position}")
        if r.checksum != xxhash.xxh3_64_intdigest(bytes(f.payload)):
            raise CaseFailed(f"row {i} checksum wrong")
        split = 4 * r.entries
        dyadic.validate_sparse(
            bytes(f.payload)[:split], bytes(f.payload)[split:], s.vocab, step.support, r.token
        )


@case(
    "4.5",
    "session and STEP",
    "a dense reply validates",
    "dense: entries = row_entries FP32 values; padding +0.0; the q contract of §6.2",
)
async def _dense(s: Settings) -> None:
    peer = await fresh(s)
    try:
        await peer.open_slot()
        data, frames = await peer.reply(peer.step_msg(depth=1, support=0))
        (row,) = [f for f in frames if f.type is MsgType.REPLY]
        r = row.message
        assert isinstance(r, messages.Reply)
        if r.representation != 0 or r.entries != s.vocab:
            raise CaseFailed("dense row with wrong representation or entries")
        dyadic.validate_dense(bytes(row.payload), s.vocab, r.token)
        _ = data
    finally:
        peer.close()


@case("4.3", "session and STEP", "more slots than negotiated", "slot < max_slots (SLOT_LIMIT)")
async def _slot_limit(s: Settings) -> None:
    peer = await fresh(s)
    try:
        peer.send_msg(
            Open(
                session=peer.session,
                slot=s.slots,
                generation=0,
                seed=1,
                context=0,
                eos=None,
                prefix_len=0,
                digest=prefix_digest([]),
            )
        )
        await peer.expect_error(ErrorCode.SLOT_LIMIT, fatal=False, answers=MsgType.OPEN)
        await peer.open_slot(0)
        await peer.reply(peer.step_msg())
    finally:
        peer.close()


def _open_refusal(
    title: str, rule: str, code: ErrorCode, build: Callable[[Peer], tuple[Open, bytes]]
) -> None:
    async def run(s: Settings) -> None:
        peer, step, data = await ready(s)
        try:
            msg, payload = build(peer)
            peer.send_msg(msg, payload)
            await peer.expect_error(code, fatal=False, answers=MsgType.OPEN)
            await unchanged(peer, step, data)
        finally:
            peer.close()

    case("4.3", "session and STEP", title, rule)(run)


def _open(peer: Peer, slot: int = 1, tokens: Sequence[int] = (1, 2), **kw: Any) -> Open:
    import xxhash  # noqa: PLC0415

    fields: dict[str, Any] = {
        "session": peer.session,
        "slot": slot,
        "generation": 0,
        "seed": 1,
        "context": 0,
        "eos": None,
        "prefix_len": len(tokens),
        "digest": xxhash.xxh3_64_intdigest(_tok(tokens)),
    }
    fields.update(kw)
    return Open(**fields)


def _tok(tokens: Sequence[int]) -> bytes:
    return np.asarray(list(tokens), dtype="<i4").tobytes()


_open_refusal(
    "OPEN of a slot in use",
    "slot free (SLOT_IN_USE)",
    ErrorCode.SLOT_IN_USE,
    lambda p: (_open(p, slot=0, seed=99), _tok((1, 2))),
)
_open_refusal(
    "OPEN with a wrong digest",
    "digest (PREFIX_DIGEST_MISMATCH)",
    ErrorCode.PREFIX_DIGEST_MISMATCH,
    lambda p: (_open(p, digest=5), _tok((1, 2))),
)
_open_refusal(
    "OPEN with a token outside the vocabulary",
    "every token and eos < vocab_size (TOKEN_OUT_OF_RANGE)",
    ErrorCode.TOKEN_OUT_OF_RANGE,
    lambda p: (_open(p, tokens=(1, p.s.vocab)), _tok((1, p.s.vocab))),
)
_open_refusal(
    "OPEN with a negative token",
    "every token < vocab_size (TOKEN_OUT_OF_RANGE)",
    ErrorCode.TOKEN_OUT_OF_RANGE,
    lambda p: (_open(p, tokens=(1, -1)), _tok((1, -1))),
)
_open_refusal(
    "OPEN with eos outside the vocabulary",
    "every token and eos < vocab_size",
    ErrorCode.TOKEN_OUT_OF_RANGE,
    lambda p: (_open(p, eos=p.s.vocab), _tok((1, 2))),
)
_open_refusal(
    "OPEN whose payload is shorter than prefix_len",
    "payload_len = 4 x prefix_len (PAYLOAD_LENGTH)",
    ErrorCode.PAYLOAD_LENGTH,
    lambda p: (_open(p, tokens=(1, 2), prefix_len=3), _tok((1, 2))),
)
_open_refusal(
    "OPEN with another session",
    "session (WRONG_SESSION)",
    ErrorCode.WRONG_SESSION,
    lambda p: (_open(p, session=p.session + 1), _tok((1, 2))),
)


@case(
    "4.3",
    "session and STEP",
    "an identical OPEN is acknowledged again",
    "an identical OPEN of a slot with no commit yet is answered with OPENED again",
)
async def _open_twice(s: Settings) -> None:
    peer = await fresh(s)
    try:
        await peer.open_slot(0)
        await peer.open_slot(0)
    finally:
        peer.close()


@case(
    "8",
    "session and STEP",
    "OPEN prefix longer than negotiated",
    "payload ≤ min(4 x max_prefix, max_frame), checked from the preamble",
)
async def _open_too_long(s: Settings) -> None:
    peer = await fresh(s)
    try:
        n = peer.hello_msg.max_prefix + 1
        peer.send_msg(_open(peer, slot=0, tokens=[1] * n), _tok([1] * n))
        await peer.expect_error(ErrorCode.FRAME_TOO_LARGE, fatal=True)
    finally:
        peer.close()


# -- COMMIT, RESET, CLOSE ------------------------------------------------------------------


async def _drafts(peer: Peer, step: Step) -> list[int]:
    _data, frames = await peer.reply(step)
    return [f.message.token for f in frames if f.type is MsgType.REPLY]  # type: ignore[union-attr]


def _commit(peer: Peer, step: Step, tokens: Sequence[int], accepted: int, **kw: Any) -> Commit:
    new = [1, 2, 3, *tokens]
    extra = tokens[-1] if len(tokens) > accepted else None
    fields: dict[str, Any] = {
        "session": peer.session,
        "slot": step.slot,
        "generation": step.generation,
        "round": step.round,
        "accepted": accepted,
        "extra": extra,
        "position": len(new),
        "digest": prefix_digest(new),
    }
    fields.update(kw)
    return Commit(**fields)


def _commit_refusal(
    title: str, rule: str, code: ErrorCode, build: Callable[[Peer, Step, list[int]], Commit]
) -> None:
    async def run(s: Settings) -> None:
        peer, step, data = await ready(s)
        try:
            drafts = await _drafts(peer, step)
            peer.send_msg(build(peer, step, drafts))
            await peer.expect_error(code, fatal=False, answers=MsgType.COMMIT)
            await unchanged(peer, step, data)
            # The round can still be committed correctly.
            peer.send_msg(_commit(peer, step, [drafts[0], 0], 1))
            await peer.expect(MsgType.COMMITTED)
        finally:
            peer.close()

    case("4.7", "COMMIT and RESET", title, rule)(run)


_commit_refusal(
    "accepted larger than the depth",
    "accepted ≤ the drafts of that round (COMMIT_INVALID)",
    ErrorCode.COMMIT_INVALID,
    lambda p, st, d: _commit(p, st, [*d, 0, 0, 0], 4),
)
_commit_refusal(
    "accepted drafts that were not drafted",
    "accepted ≤ the drafts of that round",
    ErrorCode.COMMIT_INVALID,
    lambda p, st, d: _commit(p, _replace(st, round=st.round + 1), [d[0], 0], 1),
)
_commit_refusal(
    "wrong new position",
    "position (WRONG_POSITION)",
    ErrorCode.WRONG_POSITION,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, position=99),
)
_commit_refusal(
    "wrong new digest",
    "digest (PREFIX_DIGEST_MISMATCH)",
    ErrorCode.PREFIX_DIGEST_MISMATCH,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, digest=1),
)
_commit_refusal(
    "extra nil without an accepted terminal token",
    "extra nil only after an accepted eos (COMMIT_INVALID)",
    ErrorCode.COMMIT_INVALID,
    lambda p, st, d: _commit(p, st, [d[0]], 1),
)
_commit_refusal(
    "extra outside the vocabulary",
    "extra < vocab_size (TOKEN_OUT_OF_RANGE)",
    ErrorCode.TOKEN_OUT_OF_RANGE,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, extra=p.s.vocab),
)
_commit_refusal(
    "future generation",
    "COMMIT generation > slot generation: FUTURE_GENERATION",
    ErrorCode.FUTURE_GENERATION,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, generation=1),
)
_commit_refusal(
    "another session",
    "WRONG_SESSION",
    ErrorCode.WRONG_SESSION,
    lambda p, st, d: _commit(p, st, [d[0], 0], 1, session=p.session + 1),
)


@case(
    "7",
    "COMMIT and RESET",
    "retried COMMIT is acknowledged identically",
    "COMMIT identical to the last applied COMMIT: replay COMMITTED",
)
async def _commit_retry(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        drafts = await _drafts(peer, step)
        msg = _commit(peer, step, [drafts[0], 0], 1)
        peer.send_msg(msg)
        first = await peer.expect(MsgType.COMMITTED)
        peer.send_msg(msg)
        again = await peer.expect(MsgType.COMMITTED)
        if bytes(first.raw) != bytes(again.raw):
            raise CaseFailed("the retried COMMIT got a different acknowledgement")
    finally:
        peer.close()


@case(
    "7",
    "COMMIT and RESET",
    "COMMIT for an already committed round",
    "COMMIT round ≤ last committed round: ROUND_REUSED",
)
async def _commit_old(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        drafts = await _drafts(peer, step)
        peer.send_msg(_commit(peer, step, [drafts[0], 0], 1))
        await peer.expect(MsgType.COMMITTED)
        peer.send_msg(
            _commit(
                peer,
                step,
                [drafts[0], 0, 5],
                1,
                extra=5,
                position=6,
                digest=prefix_digest([1, 2, 3, drafts[0], 0, 5]),
            )
        )
        await peer.expect_error(ErrorCode.ROUND_REUSED, fatal=False, answers=MsgType.COMMIT)
    finally:
        peer.close()


@case(
    "7",
    "COMMIT and RESET",
    "a STEP for a committed round is refused",
    "STEP round ≤ last committed round: ROUND_REUSED",
)
async def _step_after_commit(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        drafts = await _drafts(peer, step)
        peer.send_msg(_commit(peer, step, [drafts[0], 0], 1))
        await peer.expect(MsgType.COMMITTED)
        peer.send_msg(_replace(step, position=5, digest=prefix_digest([1, 2, 3, drafts[0], 0])))
        await peer.expect_error(ErrorCode.ROUND_REUSED, fatal=False, answers=MsgType.STEP)
    finally:
        peer.close()


@case(
    "4.7",
    "COMMIT and RESET",
    "target-only commit under a fresh round",
    "a round with no usable proposal commits with accepted = 0 and extra = the target token",
)
async def _target_only_commit(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        msg = _commit(peer, _replace(step, round=9), [4], 0)
        peer.send_msg(msg)
        ack = await peer.expect(MsgType.COMMITTED)
        if ack.message.position != 4:  # type: ignore[union-attr]
            raise CaseFailed("COMMITTED reports a wrong position")
        nxt = _replace(step, round=10, position=4, digest=prefix_digest([1, 2, 3, 4]))
        await peer.reply(nxt)
    finally:
        peer.close()


@case(
    "4.8",
    "COMMIT and RESET",
    "RESET to an older generation",
    "RESET generation < slot generation: STALE_GENERATION",
)
async def _reset_old(s: Settings) -> None:
    peer, _step, _ = await ready(s)
    try:
        peer.send_msg(Reset(session=peer.session, slot=0, generation=2))
        await peer.expect(MsgType.RESET_DONE)
        peer.send_msg(Reset(session=peer.session, slot=0, generation=1))
        await peer.expect_error(ErrorCode.STALE_GENERATION, fatal=False, answers=MsgType.RESET)
    finally:
        peer.close()


@case(
    "4.8",
    "COMMIT and RESET",
    "RESET to the same generation is idempotent",
    "RESET generation = slot generation: replay RESET_DONE, change nothing",
)
async def _reset_same(s: Settings) -> None:
    peer, step, data = await ready(s)
    try:
        peer.send_msg(Reset(session=peer.session, slot=0, generation=0))
        done = await peer.expect(MsgType.RESET_DONE)
        if done.message.position != 3:  # type: ignore[union-attr]
            raise CaseFailed("RESET_DONE reports a wrong position")
        await unchanged(peer, step, data)
    finally:
        peer.close()


@case(
    "4.8",
    "COMMIT and RESET",
    "STEP of the old generation after RESET",
    "RESET invalidates the old generation: STEP generation < slot generation is STALE_GENERATION",
)
async def _stale_step(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        peer.send_msg(Reset(session=peer.session, slot=0, generation=1))
        await peer.expect(MsgType.RESET_DONE)
        peer.send_msg(_replace(step, round=1))
        await peer.expect_error(ErrorCode.STALE_GENERATION, fatal=False, answers=MsgType.STEP)
        await peer.reply(_replace(step, generation=1, round=0))  # rounds restart at 0
    finally:
        peer.close()


@case(
    "4.8",
    "COMMIT and RESET",
    "COMMIT of the old generation after RESET",
    "COMMIT generation < slot generation: STALE_GENERATION",
)
async def _stale_commit(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        drafts = await _drafts(peer, step)
        peer.send_msg(Reset(session=peer.session, slot=0, generation=1))
        await peer.expect(MsgType.RESET_DONE)
        peer.send_msg(_commit(peer, step, [drafts[0], 0], 1))
        await peer.expect_error(ErrorCode.STALE_GENERATION, fatal=False, answers=MsgType.COMMIT)
    finally:
        peer.close()


@case(
    "4.8",
    "COMMIT and RESET",
    "RESET mid-reply, then the old rows",
    "on RESET the Spark side discards the in-flight proposal; later frames of the old "
    "generation are dropped; the worker finishes the old reply before RESET_DONE",
)
async def _reset_mid_reply(s: Settings) -> None:
    peer = await fresh(s)
    try:
        await peer.open_slot()
        peer.send_msg(peer.step_msg(round=0))
        peer.send_msg(Reset(session=peer.session, slot=0, generation=1))
        kinds: list[MsgType] = []
        while True:
            f = await peer.next()
            if f is None:
                raise CaseFailed(f"no RESET_DONE after {kinds}")
            kinds.append(f.type)
            if f.type is MsgType.RESET_DONE:
                break
        if MsgType.COMPLETION not in kinds or kinds.index(MsgType.COMPLETION) > kinds.index(
            MsgType.RESET_DONE
        ):
            raise CaseFailed(f"expected the old reply then RESET_DONE, got {kinds}")
        await peer.reply(peer.step_msg(generation=1, round=0))
    finally:
        peer.close()


@case(
    "4.8",
    "COMMIT and RESET",
    "the retried STEP after RESET is refused, not redrawn",
    "a retry never redraws under a used key and consumes an earlier q",
)
async def _retry_after_reset(s: Settings) -> None:
    peer, step, _data = await ready(s)
    try:
        peer.send_msg(Reset(session=peer.session, slot=0, generation=1))
        await peer.expect(MsgType.RESET_DONE)
        peer.send_msg(step)
        await peer.expect_error(ErrorCode.STALE_GENERATION, fatal=False, answers=MsgType.STEP)
    finally:
        peer.close()


@case("4.3", "COMMIT and RESET", "CLOSE then STEP", "CLOSE drops the slot; then UNKNOWN_SLOT")
async def _close_step(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        peer.send_msg(Close(session=peer.session, slot=0))
        await peer.expect(MsgType.CLOSED)
        peer.send_msg(_replace(step, round=1))
        await peer.expect_error(ErrorCode.UNKNOWN_SLOT, fatal=False, answers=MsgType.STEP)
        await peer.open_slot(0, generation=1)  # free again, under a higher generation
    finally:
        peer.close()


@case(
    "4.3",
    "COMMIT and RESET",
    "reopening a closed slot without a higher generation",
    "a slot reopened in the same session must use a generation greater than any it had "
    "before (STALE_GENERATION), so frames of its earlier instance stay fenced off",
)
async def _reopen_same_generation(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        peer.send_msg(Close(session=peer.session, slot=0))
        await peer.expect(MsgType.CLOSED)
        peer.send_msg(_open(peer, slot=0, tokens=(1, 2, 3)), _tok((1, 2, 3)))
        await peer.expect_error(ErrorCode.STALE_GENERATION, fatal=False, answers=MsgType.OPEN)
        await peer.open_slot(0, generation=1)
        await peer.reply(_replace(step, generation=1))
    finally:
        peer.close()


@case(
    "4.3",
    "COMMIT and RESET",
    "CLOSE of a slot that is not open",
    "CLOSE ... (UNKNOWN_SLOT if not open)",
)
async def _close_unknown(s: Settings) -> None:
    peer = await fresh(s)
    try:
        peer.send_msg(Close(session=peer.session, slot=1))
        await peer.expect_error(ErrorCode.UNKNOWN_SLOT, fatal=False, answers=MsgType.CLOSE)
    finally:
        peer.close()


@case("4.8", "COMMIT and RESET", "RESET of a slot that is not open", "UNKNOWN_SLOT")
async def _reset_unknown(s: Settings) -> None:
    peer = await fresh(s)
    try:
        peer.send_msg(Reset(session=peer.session, slot=1, generation=1))
        await peer.expect_error(ErrorCode.UNKNOWN_SLOT, fatal=False, answers=MsgType.RESET)
    finally:
        peer.close()


# -- liveness and close --------------------------------------------------------------------


@case(
    "4.10",
    "liveness and close",
    "PING gets PONG with the same nonce",
    "the peer answers PONG with the same nonce",
)
async def _ping(s: Settings) -> None:
    peer = await fresh(s)
    try:
        for nonce in (0, 1, 2**64 - 1):
            peer.send_msg(Ping(nonce=nonce))
            frame = await peer.expect(MsgType.PONG)
            if frame.message.nonce != nonce:  # type: ignore[union-attr]
                raise CaseFailed("PONG nonce differs")
    finally:
        peer.close()


@case(
    "2",
    "liveness and close",
    "a new connection does not inherit slots",
    "a connection that ends ends its session: every slot ... is invalid",
)
async def _reconnect(s: Settings) -> None:
    peer, step, _ = await ready(s)
    peer.close()
    other = await fresh(s)
    try:
        other.send_msg(_replace(step, session=other.session, round=1))
        await other.expect_error(ErrorCode.UNKNOWN_SLOT, fatal=False, answers=MsgType.STEP)
    finally:
        other.close()


@case(
    "2",
    "liveness and close",
    "old session ID on a new connection",
    "session and slot first for every message: WRONG_SESSION",
)
async def _old_session(s: Settings) -> None:
    peer, step, _ = await ready(s)
    old = peer.session
    peer.close()
    other = await fresh(s)
    try:
        if other.session == old:
            raise CaseFailed("a new connection got the old session ID")
        other.send_msg(_replace(step, round=1))
        await other.expect_error(ErrorCode.WRONG_SESSION, fatal=False, answers=MsgType.STEP)
    finally:
        other.close()


@case(
    "4.9",
    "liveness and close",
    "ERROR with scope 2 from the peer ends the connection",
    "scope 2 = the connection is dead and the sender closes it",
)
async def _error_scope(s: Settings) -> None:
    peer = await fresh(s)
    try:
        peer.send_msg(Error(code=int(ErrorCode.INTERNAL), answers=0, scope=2))
        peer.close()
    finally:
        peer.close()
    await still_serves(s)


@case(
    "4.9",
    "liveness and close",
    "a refusal carries no free text",
    "no free text travels on the wire: ERROR has exactly code, answers, scope, slot, "
    "generation, round",
)
async def _error_shape(s: Settings) -> None:
    peer, step, _ = await ready(s)
    try:
        peer.send_msg(_replace(step, round=1, depth=0))
        frame = await peer.expect(MsgType.ERROR)
        header = bytes(frame.raw)[framing.PREAMBLE_SIZE :]
        items = msgspec.msgpack.decode(header)
        if not isinstance(items, list) or len(items) > 7:
            raise CaseFailed(f"ERROR header has {items!r}")
    finally:
        peer.close()


@case(
    "2",
    "liveness and close",
    "idle connections are eventually closed",
    "a worker drops a connection idle past its idle timeout (IDLE_TIMEOUT)",
    informational=True,
)
async def _idle(s: Settings) -> None:
    raise NonStrictSkip("idle timeouts are minutes long; checked by the test suite instead")


@case(
    "8",
    "liveness and close",
    "a slow reader does not make the worker buffer without bound",
    "every length is checked against its limit before any buffer of that size is allocated",
    informational=True,
)
async def _slow_reader(s: Settings) -> None:
    peer = await fresh(s)
    try:
        await peer.open_slot()
        for r in range(3):
            peer.send_msg(peer.step_msg(round=r))
        await asyncio.sleep(0.2)
        for _ in range(3):
            while (f := await peer.next()) is not None and f.type is not MsgType.COMPLETION:
                pass
    finally:
        peer.close()


# -- running ------------------------------------------------------------------------------


async def run_case(c: Case, s: Settings) -> Outcome:
    """Run one case with an overall time limit."""
    try:
        await asyncio.wait_for(c.fn(s), timeout=s.handshake_wait + 20)
    except NonStrictSkip as exc:
        return Outcome(Grade.INFO, f"skipped: {exc}")
    except NonStrict as exc:
        return Outcome(Grade.INFO if c.informational else Grade.NON_STRICT, str(exc))
    except CaseFailed as exc:
        return Outcome(Grade.INFO if c.informational else Grade.FAIL, str(exc))
    except TimeoutError:
        return Outcome(Grade.INFO if c.informational else Grade.FAIL, "case timed out")
    except (ConnectionError, OSError) as exc:
        return Outcome(Grade.INFO if c.informational else Grade.FAIL, f"connection: {exc!r}")
    except Exception as exc:  # a broken worker must not crash the suite
        return Outcome(Grade.INFO if c.informational else Grade.FAIL, f"unexpected: {exc!r}")
    return Outcome(Grade.INFO if c.informational else Grade.PASS)


def select(ids: Sequence[str] | None) -> list[Case]:
    """The cases to run (all, or those whose ID equals or starts a given one)."""
    if not ids:
        return list(CASES)
    return [c for c in CASES if any(c.id == i or c.id.startswith(i + ".") for i in ids)]


def junit(results: list[tuple[Case, Outcome, float]], path: str, strict: bool) -> None:
    """Write a JUnit XML report."""
    suite = ET.Element("testsuite", name="pp1-conformance", tests=str(len(results)))
    failures = 0
    for c, o, secs in results:
        tc = ET.SubElement(
            suite, "testcase", classname=c.category, name=f"{c.id} {c.title}", time=f"{secs:.3f}"
        )
        if o.grade is Grade.FAIL or (strict and o.grade is Grade.NON_STRICT):
            failures += 1
            ET.SubElement(tc, "failure", message=o.detail).text = c.rule
        elif o.grade is Grade.INFO:
            ET.SubElement(tc, "skipped", message=o.detail or "informational")
    suite.set("failures", str(failures))
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def build_parser() -> argparse.ArgumentParser:
    """The ``pp1-conformance`` argument parser."""
    p = argparse.ArgumentParser(
        prog="pp1-conformance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--worker", default="127.0.0.1:7070", help="worker HOST:PORT")
    p.add_argument("--psk-file", default=None, help="pre-shared key for the worker")
    p.add_argument("--strict", action="store_true", help="non-strict reactions fail")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--junit", default=None, metavar="FILE", help="write a JUnit XML report")
    p.add_argument("--case", nargs="*", default=None, metavar="ID", help="run only these cases")
    p.add_argument("--json", action="store_true", help="print one JSON object per case")
    p.add_argument("--vocab", type=int, default=129_280, help="the worker's vocabulary size")
    p.add_argument("--vocab-hash", type=int, default=0)
    p.add_argument("--target-identity", default="pp1-toy-target")
    p.add_argument("--tls-ca", default=None, help="connect with TLS, trusting this certificate")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for a reaction")
    p.add_argument(
        "--handshake-wait",
        type=float,
        default=12.0,
        help="how long the handshake-timeout case waits",
    )
    p.add_argument("--config", default=None)
    return p


async def run_all(cases: list[Case], s: Settings) -> list[tuple[Case, Outcome, float]]:
    """Run cases one after another."""
    out = []
    for c in cases:
        started = time.perf_counter()
        outcome = await run_case(c, s)
        out.append((c, outcome, time.perf_counter() - started))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``pp1-conformance`` entry point; exit 0 only if every non-informational case passes."""
    parser = build_parser()
    try:
        args = parse(parser, argv)
        cases = select(args.case)
        if args.list:
            for c in cases:
                tag = " (informational)" if c.informational else ""
                print(f"{c.id:8s} [{c.category}] {c.title}{tag}\n         rule: {c.rule}")
            print(f"{len(cases)} cases")
            return 0
        host, port = host_port(args.worker)
        from pp1wire.worker import read_psk  # noqa: PLC0415

        ctx = ssl_module.create_default_context(cafile=args.tls_ca) if args.tls_ca else None
        settings = Settings(
            host=host,
            port=port,
            vocab=args.vocab,
            vocab_hash=args.vocab_hash,
            target_identity=args.target_identity,
            psk=read_psk(args.psk_file),
            ssl=ctx,
            timeout=args.timeout,
            handshake_wait=args.handshake_wait,
        )
    except SettingsError as exc:
        print(f"pp1-conformance: {exc}", file=sys.stderr)
        return 2
    if not cases:
        print("pp1-conformance: no case matches", file=sys.stderr)
        return 2
    results = asyncio.run(run_all(cases, settings))
    counts: dict[str, int] = {g.value: 0 for g in Grade}
    for c, o, secs in results:
        counts[o.grade.value] += 1
        if args.json:
            print(
                json.dumps(
                    {
                        "id": c.id,
                        "category": c.category,
                        "title": c.title,
                        "grade": o.grade.value,
                        "detail": o.detail,
                        "seconds": secs,
                    }
                )
            )
        else:
            mark = {"pass": "PASS", "non-strict": "NSTR", "fail": "FAIL", "informational": "INFO"}[
                o.grade.value
            ]
            line = f"{mark}  {c.id:8s} {c.title}"
            print(line + (f"  -- {o.detail}" if o.detail else ""))
    if args.junit:
        junit(results, args.junit, args.strict)
    failed = counts["fail"] + (counts["non-strict"] if args.strict else 0)
    print(
        f"{len(results)} cases: {counts['pass']} passed, {counts['non-strict']} non-strict, "
        f"{counts['fail']} failed, {counts['informational']} informational"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
