"""§4.1 HELLO negotiation and §5 handshake and authentication."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import msgspec

from pp1wire.errors import ErrorCode
from pp1wire.q.rng import Role
from pp1wire.testing.builders import older_hello_frame, open_message
from pp1wire.testing.conformance import core
from pp1wire.wire import framing, messages
from pp1wire.wire.handshake import ECHOED_LIMITS, spark_proof
from pp1wire.wire.messages import (
    Auth,
    Close,
    Commit,
    Hello,
    Message,
    MsgType,
    Ping,
    Reset,
)

case = core.Section("handshake").case

# -- handshake ---------------------------------------------------------------------


def _before_hello(case_id: str, kind: str, build: Callable[[core.Peer], Message]) -> None:
    async def run(s: core.Settings) -> None:
        # Headers only: a payload before the handshake is itself a framing error.
        async with await core.Peer(s).connect() as peer:
            await peer.expect_fatal(build(peer), ErrorCode.HANDSHAKE_REQUIRED)
        await core.still_serves(s)

    case(
        case_id,
        f"{kind} before HELLO",
        "any message before the handshake completes (other than PING/PONG/ERROR) is fatal "
        "(HANDSHAKE_REQUIRED)",
    )(run)


_before_hello("5.1", "STEP", lambda p: p.step_msg())
_before_hello("5.2", "OPEN", lambda p: open_message(0, 0, []))
_before_hello(
    "5.3",
    "COMMIT",
    lambda p: Commit(
        session=0, slot=0, generation=0, round=0, accepted=0, extra=1, position=4, digest=0
    ),
)
_before_hello("5.4", "RESET", lambda p: Reset(session=0, slot=0, generation=1))
_before_hello("5.5", "CLOSE", lambda p: Close(session=0, slot=0))
_before_hello("5.6", "AUTH", lambda p: Auth(proof=bytes(32)))


@case("5.7")
async def _second_hello(s: core.Settings) -> None:
    """second HELLO

    a second HELLO is fatal (DUPLICATE_HELLO)
    """
    async with await core.fresh(s) as peer:
        await peer.expect_fatal(peer.hello(), ErrorCode.DUPLICATE_HELLO)


@case("4.10.1")
async def _ping_first(s: core.Settings) -> None:
    """PING before HELLO is answered

    either side MAY send PING at any time (also before the handshake)
    """
    async with await core.Peer(s).connect() as peer:
        frame = await peer.ask(Ping(nonce=77), MsgType.PONG)
        if frame.message.nonce != 77:  # type: ignore[union-attr]
            raise core.CaseFailed("PONG nonce differs")
        await peer.handshake()


def _mismatch(
    case_id: str, title: str, overrides: dict[str, Any], code: ErrorCode, rule: str
) -> None:
    async def run(s: core.Settings) -> None:
        await _mismatch_run(s, overrides, code)

    case(case_id, title, rule)(run)


async def _auth_reply(peer: core.Peer, hello: Hello, sent: bytes | None = None) -> None:
    """Answer the worker's CHALLENGE to ``hello`` (framed as ``sent``, when not as usual)."""
    frame = await peer.expect(MsgType.CHALLENGE)
    ch = frame.message
    assert isinstance(ch, messages.Challenge)
    if peer.s.psk is None:
        raise core.CaseFailed("the worker wants a key; run with --psk-file")
    header = (sent or framing.encode_frame(hello))[framing.PREAMBLE_SIZE :]
    peer.send_msg(Auth(proof=spark_proof(peer.s.psk, ch.nonce, hello.nonce, header)))


for case_id, (field_name, value, code) in zip(
    [f"4.1.{n}" for n in range(1, 12)],
    [
        ("wire_version", messages.WIRE_VERSION + 1, ErrorCode.WIRE_VERSION_MISMATCH),
        ("wire_version", messages.WIRE_VERSION - 1, ErrorCode.WIRE_VERSION_MISMATCH),
        ("q_semantic", "dyadic16-standard-v1", ErrorCode.Q_SEMANTIC_MISMATCH),
        ("q_semantic", "", ErrorCode.Q_SEMANTIC_MISMATCH),
        ("verifier", "pp1-standard-verifier-v0", ErrorCode.VERIFIER_MISMATCH),
        ("rng_abi", "pp1-philox4x32-10-v2", ErrorCode.RNG_ABI_MISMATCH),
        ("precision", "bf16", ErrorCode.PRECISION_MISMATCH),
        ("vocab_hash", 0xDEADBEEF, ErrorCode.VOCAB_HASH_MISMATCH),
        ("target_identity", "some-other-target", ErrorCode.IDENTITY_MISMATCH),
        ("draft_identity", "a-pinned-unknown-drafter", ErrorCode.IDENTITY_MISMATCH),
        ("role", int(Role.WORKER), ErrorCode.UNEXPECTED_MESSAGE),
    ],
    strict=True,
):
    _mismatch(
        case_id,
        f"HELLO with {field_name} = {value!r}",
        {field_name: value},
        code,
        f"{field_name}: exact, else {code.name}",
    )


def _vocab_mismatch(case_id: str, delta: int) -> None:
    async def run(s: core.Settings) -> None:
        v = s.vocab + delta
        fields = {"vocab_size": v, "row_entries": v, "max_support": min(s.support, v)}
        await _mismatch_run(s, fields, ErrorCode.VOCAB_SIZE_MISMATCH)

    case(
        case_id,
        f"HELLO with vocab_size {delta:+d}",
        "vocab_size: exact, else VOCAB_SIZE_MISMATCH",
    )(run)


async def _mismatch_run(
    s: core.Settings, overrides: dict[str, Any], code: ErrorCode, *, older: bool = False
) -> None:
    """Our HELLO with ``overrides`` (``older``: framed ending at field 27, as a peer before
    ``row_format`` frames it) must be refused with a fatal ERROR ``code``."""
    async with await core.Peer(s).connect() as peer:
        hello = peer.hello(**overrides)
        sent = older_hello_frame(hello) if older else framing.encode_frame(hello)
        peer.send(sent)
        reply = await peer.next()
        if reply is not None and reply.type is MsgType.CHALLENGE:
            peer.unread(reply)
            await _auth_reply(peer, hello, sent)
        elif reply is not None:
            peer.unread(reply)
        await peer.expect_error(code, fatal=True, answers=MsgType.HELLO)
    await core.still_serves(s)


_vocab_mismatch("4.1.12", +1)
_vocab_mismatch("4.1.13", -1)


@case("4.1.23")
async def _older_row_format(s: core.Settings) -> None:
    """HELLO of a peer before row_format (fields 1..27, no field 28)

    row_format: every peer of this document sends pp1-fixed-rows-v1 and refuses a peer that
    omits it ("") or sends anything else (ROW_FORMAT_MISMATCH)
    """
    await _mismatch_run(s, {}, ErrorCode.ROW_FORMAT_MISMATCH, older=True)


_mismatch(
    "4.1.24",
    "HELLO with row_format = 'pp1-fixed-rows-v0'",
    {"row_format": "pp1-fixed-rows-v0"},
    ErrorCode.ROW_FORMAT_MISMATCH,
    "row_format: exact, else ROW_FORMAT_MISMATCH",
)


def _limit(case_id: str, title: str, overrides: Callable[[core.Settings], dict[str, Any]]) -> None:
    async def run(s: core.Settings) -> None:
        await _mismatch_run(s, overrides(s), ErrorCode.LIMIT_EXCEEDED)

    case(
        case_id,
        title,
        "max_slots, max_depth, max_support: each ≤ the worker's limit; row_entries equal; "
        "max_frame, max_prefix ≤ the worker's; else LIMIT_EXCEEDED",
    )(run)


_limit("4.1.14", "max_slots 65535", lambda s: {"max_slots": 65535})
_limit("4.1.15", "row_entries not the worker's", lambda s: {"row_entries": s.vocab + 1})
_limit("4.1.16", "max_frame 4 GiB - 1", lambda s: {"max_frame": 0xFFFFFFFF})
_limit("4.1.17", "max_prefix 4 G tokens", lambda s: {"max_prefix": 0xFFFFFFFF})
_limit(
    "4.1.20",
    "max_frame below one dense row",
    lambda s: {"max_frame": 4 * (s.row_entries or s.vocab) - 1},
)


@case("4.1.18")
async def _cross_field(s: core.Settings) -> None:
    """HELLO with row_entries below vocab_size

    cross-field rules (HEADER_INVALID if broken): row_entries ≥ vocab_size
    """
    async with await core.Peer(s).connect() as peer:
        hello = peer.hello()
        body = msgspec.structs.asdict(hello)
        array = [int(MsgType.HELLO), *body.values()]
        array[list(body).index("row_entries") + 1] = s.vocab - 1
        peer.send(core.raw_frame(int(MsgType.HELLO), msgspec.msgpack.encode(array)))
        await peer.expect_error(ErrorCode.HEADER_INVALID, fatal=True)


@case("4.1.19")
async def _echo(s: core.Settings) -> None:
    """the worker's HELLO echoes our limits and assigns a session

    the worker answers ... with its own HELLO, which echoes the Spark side's limits unchanged
    """
    async with await core.Peer(s).connect() as peer:
        ours = peer.hello()
        theirs = await peer.handshake(ours)
        for name in (*ECHOED_LIMITS, "vocab_size", "vocab_hash"):
            if getattr(theirs, name) != getattr(ours, name):
                raise core.CaseFailed(
                    f"{name}: sent {getattr(ours, name)}, got {getattr(theirs, name)}"
                )
        if theirs.role != Role.WORKER:
            raise core.CaseFailed("worker HELLO role is not 1")


async def _challenged(s: core.Settings) -> tuple[core.Peer, Hello, framing.Frame]:
    """A connection whose HELLO the worker answered with CHALLENGE: (peer, our HELLO, CHALLENGE).

    Raises:
        core.NonStrictSkip: without ``--psk-file``; core.CaseFailed: if no CHALLENGE comes.
    """
    if s.psk is None:
        raise core.NonStrictSkip("needs --psk-file")
    peer = await core.Peer(s).connect()
    hello = peer.hello()
    peer.send_msg(hello)
    try:
        frame = await peer.expect(MsgType.CHALLENGE)
    except core.CaseFailed:
        peer.close()
        raise
    return peer, hello, frame


@case("5.8")
async def _bad_auth(s: core.Settings) -> None:
    """forged AUTH proof

    a wrong proof is fatal (AUTH_FAILED)
    """
    peer, _, _ = await _challenged(s)
    async with peer:
        await peer.expect_fatal(Auth(proof=bytes(32)), ErrorCode.AUTH_FAILED)


@case("5.9")
async def _step_not_auth(s: core.Settings) -> None:
    """STEP instead of AUTH

    any message other than AUTH while the worker waits for it is fatal (HANDSHAKE_REQUIRED)
    """
    peer, _, _ = await _challenged(s)
    async with peer:
        await peer.expect_fatal(peer.step_msg(), ErrorCode.HANDSHAKE_REQUIRED)


@case("5.10")
async def _auth_binding(s: core.Settings) -> None:
    """AUTH proof bound to the HELLO bytes

    proof = HMAC-SHA256(psk, label ‖ N_w ‖ N_s ‖ SHA256(H)), H = our HELLO header bytes
    """
    peer, hello, frame = await _challenged(s)
    async with peer:
        ch = frame.message
        assert isinstance(ch, messages.Challenge)
        assert s.psk is not None  # _challenged skips the case otherwise
        other = framing.encode_frame(peer.hello())[framing.PREAMBLE_SIZE :]  # another nonce
        proof = spark_proof(s.psk, ch.nonce, hello.nonce, other)
        await peer.expect_fatal(Auth(proof=proof), ErrorCode.AUTH_FAILED)


@case("5.11", informational=True)
async def _auth_info(s: core.Settings) -> None:
    """worker requires a key the suite was not given

    a worker with a PSK answers HELLO with CHALLENGE
    """
    async with await core.Peer(s).connect() as peer:
        peer.send_msg(peer.hello())
        frame = await peer.next()
        if frame is None:
            raise core.CaseFailed("no answer to HELLO")
        if frame.type is MsgType.CHALLENGE and s.psk is None:
            raise core.CaseFailed("the worker requires a key; pass --psk-file for the auth cases")


@case("5.12")
async def _handshake_timeout(s: core.Settings) -> None:
    """handshake timeout drops a silent peer

    a worker drops a connection whose handshake does not complete within its handshake timeout
    (HANDSHAKE_TIMEOUT)
    """
    async with await core.Peer(s).connect() as peer:
        peer.send(framing.encode_frame(Ping(nonce=1))[:5])  # a slow-loris start
        frame = await peer.next(s.handshake_wait)
        if frame is None:
            if peer.eof:
                raise core.NonStrict("closed without an ERROR frame")
            raise core.CaseFailed(f"still open after {s.handshake_wait:.0f} s")
        if frame.type is not MsgType.ERROR or frame.message.code != ErrorCode.HANDSHAKE_TIMEOUT:  # type: ignore[union-attr]
            raise core.CaseFailed(f"expected HANDSHAKE_TIMEOUT, got {core.describe(frame)}")
        if not await peer.closed():
            raise core.CaseFailed("not closed after HANDSHAKE_TIMEOUT")


@case("5.13")
async def _late_auth(s: core.Settings) -> None:
    """AUTH after the handshake

    AUTH is only a handshake message; after it, any AUTH is fatal (UNEXPECTED_MESSAGE)
    """
    async with await core.fresh(s) as peer:
        peer.send_msg(Auth(proof=bytes(32)))
        await peer.expect_error(ErrorCode.UNEXPECTED_MESSAGE, fatal=True, answers=MsgType.AUTH)
    await core.still_serves(s)


@case("5.14")
async def _unknown_key_id(s: core.Settings) -> None:
    """AUTH under a key ID the worker does not hold

    an unknown key ID is answered with a CHALLENGE like any other, and its AUTH is fatal
    (AUTH_FAILED), as a wrong proof is: the peer learns nothing of which IDs exist
    """
    if s.psk is None:
        raise core.NonStrictSkip("needs --psk-file")
    async with await core.Peer(s).connect() as peer:
        hello = peer.hello(key_id=f"unknown-{secrets.token_hex(8)}")
        frame = await peer.ask(hello, MsgType.CHALLENGE)
        ch = frame.message
        assert isinstance(ch, messages.Challenge)
        header = framing.encode_frame(hello)[framing.PREAMBLE_SIZE :]
        proof = spark_proof(s.psk, ch.nonce, hello.nonce, header)
        await peer.expect_fatal(Auth(proof=proof), ErrorCode.AUTH_FAILED)
    await core.still_serves(s)
