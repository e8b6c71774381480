"""§3 framing: preamble, header encoding, split and batched frames."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

import msgspec

from pp1wire.errors import ErrorCode
from pp1wire.errors import ErrorCode as E
from pp1wire.testing.conformance import core
from pp1wire.wire import framing, messages
from pp1wire.wire.messages import MsgType, Ping

case = core.Section("framing").case


def _fatal_framing_case(
    case_id: str,
    title: str,
    rule: str,
    data: Callable[[], bytes],
    code: ErrorCode,
    *,
    after_handshake: bool = True,
) -> None:
    async def run(s: core.Settings) -> None:
        async with await core.Peer(s).connect() as peer:
            if after_handshake:
                await peer.handshake()
            peer.send(data())
            await peer.expect_error(code, fatal=True)
        await core.still_serves(s)

    case(case_id, title, rule)(run)


R_MAGIC = "magic: bytes 0x50 0x57 ... a wrong magic is BAD_MAGIC; every framing error is fatal"
R_VERSION = f"version: {messages.WIRE_VERSION} ... else UNSUPPORTED_VERSION (fatal)"
R_TYPE = "type is a code of §4 (UNKNOWN_MESSAGE_TYPE)"
R_FLAGS = "flags: bit 0 is TAGGED (§5.1); every other bit is reserved (BAD_FLAGS)"
R_PAYLOAD = "payload_len = 0 unless the type is OPEN or REPLY"
PING = core.PING_HEADER
raw = core.raw_frame

# §3.1, one row per case: (ID, title, rule quoted, the bytes sent, the expected fatal code).
PREAMBLE_CASES: list[tuple[str, str, str, Callable[[], bytes], ErrorCode]] = [
    ("3.1.1", "bad magic 0x0000", R_MAGIC, partial(raw, 16, PING, magic=0x0000), E.BAD_MAGIC),
    ("3.1.2", "bad magic 0x5058", R_MAGIC, partial(raw, 16, PING, magic=0x5058), E.BAD_MAGIC),
    ("3.1.3", "bad magic 0xa8af", R_MAGIC, partial(raw, 16, PING, magic=0xA8AF), E.BAD_MAGIC),
    *(
        (
            cid,
            f"wire version {v}",
            R_VERSION,
            partial(raw, 16, PING, version=v),
            E.UNSUPPORTED_VERSION,
        )
        for cid, v in (
            ("3.1.4", 0),
            ("3.1.5", messages.WIRE_VERSION - 1),
            ("3.1.6", messages.WIRE_VERSION + 1),
            ("3.1.7", 255),
        )
    ),
    *(
        (cid, f"unknown message type {k}", R_TYPE, partial(raw, k, PING), E.UNKNOWN_MESSAGE_TYPE)
        for cid, k in (("3.1.8", 0), ("3.1.9", 18), ("3.1.10", 99), ("3.1.11", 255))
    ),
    (
        "3.1.12",
        "flags bit 0 (TAGGED) on a connection without a key",
        "a frame tagged when §5.1 requires no tag is INTEGRITY_FAILED (fatal)",
        lambda: raw(16, PING, flags=1) + bytes(16),
        E.INTEGRITY_FAILED,
    ),
    *(
        (
            f"3.1.{12 + b}",
            f"flags bit {b} set",
            R_FLAGS,
            partial(raw, 16, PING, flags=1 << b),
            E.BAD_FLAGS,
        )
        for b in range(1, 8)
    ),
    (
        "3.1.20",
        "reserved byte set",
        "reserved: 0 (BAD_FLAGS)",
        partial(raw, 16, PING, reserved=1),
        E.BAD_FLAGS,
    ),
    (
        "3.1.21",
        "zero-length header",
        "header_len ≠ 0 (ZERO_LENGTH_HEADER)",
        partial(raw, 16, b""),
        E.ZERO_LENGTH_HEADER,
    ),
    (
        "3.1.22",
        "header longer than 4096",
        "header_len ≤ 4096 (FRAME_TOO_LARGE), before buffering",
        partial(raw, 16, PING, header_len=4097),
        E.FRAME_TOO_LARGE,
    ),
    (
        "3.1.23",
        "payload declared 4 GiB",
        "payload_len ≤ the current payload limit (FRAME_TOO_LARGE)",
        partial(raw, 4, PING, payload_len=0xFFFFFFFF),
        E.FRAME_TOO_LARGE,
    ),
    (
        "3.1.24",
        "payload before the handshake",
        "payload before the handshake completes: 0 bytes (§8)",
        lambda: raw(4, PING, payload_len=4) + b"\0" * 4,
        E.FRAME_TOO_LARGE,
    ),
    *(
        (
            cid,
            f"payload on {k.name}",
            R_PAYLOAD,
            partial(raw, int(k), PING, b"\0" * 8),
            E.PAYLOAD_LENGTH,
        )
        for cid, k in (
            ("3.1.25", MsgType.PING),
            ("3.1.26", MsgType.STEP),
            ("3.1.27", MsgType.COMMIT),
        )
    ),
    (
        "3.1.28",
        "header checksum mismatch",
        "checksum: low 32 bits of xxh3_64(bytes[0:12] ‖ header) (PREAMBLE_CHECKSUM)",
        partial(raw, 16, PING, checksum=0x12345678),
        E.PREAMBLE_CHECKSUM,
    ),
]
# The one preamble case sent before the handshake (a payload is refused there).
BEFORE_HANDSHAKE = {"3.1.24"}
for row in PREAMBLE_CASES:
    _fatal_framing_case(*row, after_handshake=row[0] not in BEFORE_HANDSHAKE)


@case("3.1.29")
async def _trailing(s: core.Settings) -> None:
    """trailing garbage after a valid frame

    frames follow each other with no padding: the next bytes must be a preamble; the valid frame
    ahead of the error is still handled
    """
    async with await core.fresh(s) as peer:
        peer.send(peer.frame(Ping(nonce=3)) + b"\0" * 16)
        await peer.expect(MsgType.PONG)
        await peer.expect_error(ErrorCode.BAD_MAGIC, fatal=True)
    await core.still_serves(s)


for case_id, (name, header) in zip(
    ("3.2.1", "3.2.2", "3.2.3", "3.2.4", "3.2.5", "3.2.6", "3.2.7", "3.2.8", "3.2.9"),
    [
        ("not msgpack", b"\xc1"),
        ("trailing bytes after the array", core.PING_HEADER + b"\x00"),
        ("an extra element", b"\x93\x10\x01\x02"),
        ("a missing element", b"\x91\x10"),
        ("a negative integer", b"\x92\x10\xff"),
        ("a float for an integer", b"\x92\x10\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00"),
        ("a map instead of an array", b"\x81\xa5nonce\x01"),
        ("a tag different from the frame type", messages.encode(messages.Pong(nonce=1))),
        ("a string for an integer", b"\x92\x10\xa1x"),
    ],
    strict=True,
):
    _fatal_framing_case(
        case_id,
        f"header with {name}",
        "the header is one msgpack array ... anything else is HEADER_INVALID",
        partial(core.raw_frame, 16, header),
        ErrorCode.HEADER_INVALID,
    )


@case("3.2.10")
async def _slot_range(s: core.Settings) -> None:
    """slot above uint16

    an integer outside its stated range is HEADER_INVALID
    """
    async with await core.fresh(s) as peer:
        # CLOSE = [6, session, slot] with slot 65536.
        header = b"\x93\x06" + msgspec.msgpack.encode(peer.session) + b"\xce\x00\x01\x00\x00"
        peer.send(core.raw_frame(int(MsgType.CLOSE), header))
        await peer.expect_error(ErrorCode.HEADER_INVALID, fatal=True)


@case("3.1.30", informational=True)
async def _truncated(s: core.Settings) -> None:
    """truncated preamble, then silence

    a receiver buffers a partial frame and waits; it is not an error by itself
    """
    async with await core.fresh(s) as peer:
        peer.send(framing.encode_frame(Ping(nonce=9))[:10])
        if not await peer.quiet(0.5):
            raise core.CaseFailed("the worker reacted to half a preamble")


@case("3.1.31")
async def _split(s: core.Settings) -> None:
    """handshake split at every byte

    frames may arrive in any number of reads; bytes are a stream
    """
    async with await core.Peer(s).connect() as peer:
        frame = framing.encode_frame(peer.hello())
        assert peer.writer is not None
        for i in range(len(frame)):
            peer.send(frame[i : i + 1])
            await peer.writer.drain()
        reply = await peer.next()
        if reply is None or reply.type not in (MsgType.HELLO, MsgType.CHALLENGE):
            raise core.CaseFailed(f"expected HELLO, got {core.describe(reply)}")


@case("3.1.32")
async def _batched(s: core.Settings) -> None:
    """several frames in one read

    frames follow each other with no padding; each is handled in order
    """
    async with await core.fresh(s) as peer:
        peer.send(b"".join(peer.frame(Ping(nonce=n)) for n in (1, 2, 3)))
        got = []
        for _ in range(3):
            frame = await peer.expect(MsgType.PONG)
            got.append(frame.message.nonce)  # type: ignore[union-attr]
        if got != [1, 2, 3]:
            raise core.CaseFailed(f"PONGs out of order: {got}")


@case("3.1.33")
async def _split_step(s: core.Settings) -> None:
    """a STEP split across two reads inside its header

    frames may arrive in any number of reads
    """
    async with await core.fresh(s) as peer:
        await peer.open_slot()
        frame = peer.frame(peer.step_msg())
        assert peer.writer is not None
        peer.send(frame[:20])
        await peer.writer.drain()
        await asyncio.sleep(0.05)
        peer.send(frame[20:])
        while (f := await peer.next()) is not None and f.type is MsgType.REPLY:
            pass
        if f is None or f.type is not MsgType.COMPLETION:
            raise core.CaseFailed(f"expected a reply, got {core.describe(f)}")
