"""The conformance suite's raw peer, case registry and shared steps."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import secrets
import ssl as ssl_module
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgspec

from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q.layout import ShardLayout
from pp1wire.q.rng import Role
from pp1wire.testing.builders import open_message, reply_step, token_bytes
from pp1wire.wire import framing, integrity, messages
from pp1wire.wire.handshake import PeerConfig, build_hello, spark_proof, worker_proof
from pp1wire.wire.messages import Auth, Error, Hello, Message, MsgType, Open, Ping, Step


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
    row_entries: int | None = None  # the worker's dense row length; None: vocab
    vocab_hash: int = 0
    target_identity: str = "pp1-toy-target"
    psk: bytes | None = None
    key_id: str = ""  # the ID of ``psk`` in the worker's key table (§5)
    ssl: ssl_module.SSLContext | None = None
    timeout: float = 3.0
    slots: int = 2
    support: int = 8
    handshake_wait: float = 12.0
    match_wait: float = 8.0  # longer than a sharded worker's match timeout (§6.7)
    idle_wait: float | None = None  # longer than the worker's idle timeout; None: skip 2.3
    shards: int = 1  # a sharded worker group's size: link r at port + r (§6.7)
    shard: int = 0  # the shard this connection's HELLO declares
    # The suite's group session on a sharded group: the same nonce on every link (§6.7).
    group: bytes = field(default_factory=lambda: secrets.token_bytes(messages.GROUP_NONCE_SIZE))


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
        self.session = 0
        self.hello_msg: Hello = self.hello()
        self.eof = False
        # Frame integrity (§5.1) once a keyed handshake has sent AUTH.
        self.sealer: integrity.Sealer | None = None
        self.receive_rule = integrity.ReceiveRule(integrity.SPARK_UNTAGGED_BEFORE_HELLO)
        self._checked_ahead = 0  # frames at the front of pending already tag-checked

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

    def frame(self, msg: Message, payload: bytes = b"") -> bytes:
        """One frame for ``msg``, tagged (and its tag appended) once §5.1 requires it."""
        if self.sealer is None:
            return framing.encode_frame(msg, payload)
        return self.sealer.seal(framing.encode_frame(msg, payload, tagged=True))

    def raw(self, kind: int, header: bytes, payload: bytes = b"") -> bytes:
        """A frame with a hand-made header, tagged (and its tag appended) once §5.1 requires it."""
        if self.sealer is None:
            return raw_frame(kind, header, payload)
        return self.sealer.seal(raw_frame(kind, header, payload, flags=framing.FLAG_TAGGED))

    def send_msg(self, msg: Message, payload: bytes = b"") -> None:
        """Write one framed message (tagged when §5.1 requires it)."""
        self.send(self.frame(msg, payload))

    def _check_tag(self, frame: framing.Frame) -> None:
        if not self.receive_rule.accepts(frame):
            raise CaseFailed(f"worker's frame breaks the tag rules of §5.1: {describe(frame)}")

    @property
    def tags_seen(self) -> bool:
        """Whether the worker has sent a tagged frame (its HELLO, on a keyed connection)."""
        return self.receive_rule.tags_seen

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
            data = b""
        if not data:
            self.eof = True
            return False
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
        frame = self.pending.pop(0)
        if self._checked_ahead:
            self._checked_ahead -= 1
        else:
            self._check_tag(frame)
        return frame

    def unread(self, frame: framing.Frame) -> None:
        """Put a frame taken with :meth:`next` back at the front."""
        self.pending.insert(0, frame)
        self._checked_ahead += 1

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

    async def ask(self, msg: Message, kind: MsgType) -> framing.Frame:
        """Send ``msg``; the answer, which must be of ``kind``.

        Raises:
            CaseFailed: as :meth:`expect`.
        """
        self.send_msg(msg)
        return await self.expect(kind)

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
        if answers is not None and err.answers != int(answers):
            raise CaseFailed(f"ERROR answers type {err.answers}, expected {int(answers)}")
        if fatal:
            if err.scope != 2:
                raise CaseFailed(f"{code.name} must be fatal (scope 2), got scope {err.scope}")
            if not await self.closed():
                raise CaseFailed("connection still open after a fatal ERROR")
        elif err.scope != 0:
            raise CaseFailed(f"{code.name} must refuse only the message, got scope {err.scope}")

    async def expect_refusal(self, msg: Message, code: ErrorCode, payload: bytes = b"") -> None:
        """Send ``msg``: the worker must refuse that message alone, with ``code``.

        Raises:
            CaseFailed: another reaction (as :meth:`expect_error`, answering ``msg``'s type).
        """
        self.send_msg(msg, payload)
        await self.expect_error(code, fatal=False, answers=messages.type_of(msg))

    async def expect_fatal(self, msg: Message, code: ErrorCode, payload: bytes = b"") -> None:
        """Send ``msg``: the worker must answer with the fatal ERROR ``code`` and close.

        Raises:
            CaseFailed, NonStrict: as :meth:`expect_error`.
        """
        self.send_msg(msg, payload)
        await self.expect_error(code, fatal=True)

    async def closed(self, timeout: float | None = None) -> bool:
        """True if the worker closes the connection (frames in between are ignored)."""
        deadline = time.monotonic() + (self.s.timeout if timeout is None else timeout)
        while not self.eof:
            for frame in self.pending[self._checked_ahead :]:
                self._check_tag(frame)
            self.pending.clear()
            self._checked_ahead = 0
            if not await self._read_more(deadline) and not self.eof:
                return False
        return True

    async def quiet(self, timeout: float = 0.3) -> bool:
        """True if nothing arrives for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.pending:
            if not await self._read_more(deadline):
                return True
        return False

    def close(self) -> None:
        """Close our side."""
        if self.writer is not None:
            self.writer.close()

    async def __aenter__(self) -> Peer:
        """The peer itself; the connection is closed when the block ends, however it ends."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close our side."""
        self.close()

    # -- protocol helpers --------------------------------------------------

    def hello(self, **overrides: Any) -> Hello:
        """The suite's HELLO (with any field overridden)."""
        s = self.s
        ours = PeerConfig(
            vocab_size=s.vocab,
            vocab_hash=s.vocab_hash,
            target_identity=s.target_identity,
            max_slots=s.slots,
            max_depth=5,
            max_support=min(s.support, s.vocab),
            row_entries=s.row_entries,
            max_frame=4 * (s.row_entries or s.vocab) + 8192,
            max_prefix=4096,
            psk=s.psk,
            key_id=s.key_id if s.psk is not None else "",
            layout=ShardLayout.even(s.vocab, s.shards) if s.shards > 1 else None,
            shard=s.shard,
            group=s.group if s.shards > 1 else b"",
        )
        hello = build_hello(
            Role.SPARK,
            ours,
            draft_identity="",
            draft_native=True,
            limits=None,
            nonce=secrets.token_bytes(32),
        )
        return msgspec.structs.replace(hello, **overrides)

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
            if not hmac.compare_digest(worker_proof(self.s.psk, ours.nonce, ch.nonce), ch.proof):
                raise CaseFailed("the worker's CHALLENGE proof is wrong")
            header = frame[framing.PREAMBLE_SIZE :]
            self.send_msg(Auth(proof=spark_proof(self.s.psk, ch.nonce, ours.nonce, header)))
            challenge = bytes(reply.raw[framing.PREAMBLE_SIZE :])
            k_sw, k_ws = integrity.frame_keys(self.s.psk, header, challenge)
            self.sealer = integrity.Sealer(k_sw)
            self.receive_rule.start(k_ws)
            reply = await self.next()
            if reply is not None and reply.type is MsgType.HELLO and reply.tag is None:
                raise CaseFailed("the worker's HELLO after AUTH is not tagged (§5.1)")
        if reply is None or reply.type is not MsgType.HELLO:
            if reply is not None:
                self.unread(reply)  # left for a caller that explains it
            raise CaseFailed(f"handshake: expected HELLO, got {describe(reply)}")
        worker = reply.message
        assert isinstance(worker, Hello)
        self.hello_msg = worker
        self.session = worker.session
        return worker

    async def open_slot(
        self, slot: int = 0, prefix: Sequence[int] = (1, 2, 3), seed: int = 7, generation: int = 0
    ) -> None:
        """OPEN and wait for OPENED.

        Raises:
            CaseFailed: if OPENED does not come.
        """
        msg = open_message(self.session, slot, prefix, generation=generation, seed=seed)
        self.send_msg(msg, token_bytes(prefix))
        await self.expect(MsgType.OPENED)

    def step_msg(self, slot: int = 0, **over: Any) -> Step:
        """A valid sparse STEP for a slot opened at the default prefix (fields overridden)."""
        over = {"support": min(self.s.support, self.s.vocab), **over}
        return reply_step(over.pop("support"), session=self.session, slot=slot, **over)

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


@dataclass(frozen=True)
class Section:
    """The cases of one section of the suite: ``case = Section(name).case`` registers
    them under that category."""

    name: str

    def case(
        self,
        case_id: str,
        title: str | None = None,
        rule: str | None = None,
        *,
        informational: bool = False,
    ) -> Callable[[CaseFn], CaseFn]:
        """Register a case under its fixed ID (the protocol section, then a number within
        it; never reused, so a report stays comparable across versions). Without ``title``
        and ``rule``, the case's docstring gives them: its first paragraph, then its second.

        Raises:
            ValueError: if the ID is already taken, or the docstring lacks either.
        """

        def register(fn: CaseFn) -> CaseFn:
            if title is not None and rule is not None:
                told = [title, rule]
            else:
                told = [
                    " ".join(p.split()) for p in inspect.cleandoc(fn.__doc__ or "").split("\n\n")
                ]
                if len(told) != 2:
                    raise ValueError(f"case {case_id}: the docstring is not title, then rule")
            if any(c.id == case_id for c in CASES):
                raise ValueError(f"conformance case {case_id} defined twice")
            CASES.append(Case(case_id, self.name, told[0], told[1], fn, informational))
            return fn

        return register


async def fresh(s: Settings) -> Peer:
    """A connected, handshaken peer."""
    peer = await Peer(s).connect()
    await peer.handshake()
    return peer


async def still_serves(s: Settings) -> None:
    """A new connection still completes a handshake and a STEP (an OPEN on one link
    of a sharded group, whose ranks draw a STEP only when every link sends it).

    Raises:
        CaseFailed: if not.
    """
    async with await fresh(s) as peer:
        await peer.open_slot()
        if s.shards == 1:
            await peer.reply(peer.step_msg())


@contextlib.asynccontextmanager
async def ready(s: Settings) -> AsyncIterator[tuple[Peer, Step, bytes]]:
    """For the block, a peer with slot 0 open and one STEP answered: (peer, that STEP,
    its reply bytes); the connection is closed when the block ends.

    Raises:
        CaseFailed: if the handshake, the OPEN or the STEP does not succeed.
    """
    async with await fresh(s) as peer:
        await peer.open_slot()
        step = peer.step_msg()
        data, _ = await peer.reply(step)
        yield peer, step, data


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


def with_fields(step: Step, **kw: Any) -> Step:
    """``step`` with some fields replaced (messages are frozen)."""
    return msgspec.structs.replace(step, **kw)


def open_msg(peer: Peer, slot: int = 1, tokens: Sequence[int] = (1, 2), **kw: Any) -> Open:
    """A valid OPEN of ``slot`` at prefix ``tokens`` on ``peer``'s session (fields overridable)."""
    return open_message(kw.pop("session", peer.session), slot, tokens, **kw)
