"""§3 framing: preamble, header encoding, split and batched frames."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

import msgspec

from pp1wire.errors import ErrorCode
from pp1wire.testing.conformance import core
from pp1wire.wire import framing, messages
from pp1wire.wire.messages import (
    MsgType,
    Ping,
)


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

    core.case(case_id, "framing", title, rule)(run)


R_MAGIC = "magic: bytes 0x50 0x57 ... a wrong magic is BAD_MAGIC; every framing error is fatal"
for case_id, magic in zip(
    ("3.1.1", "3.1.2", "3.1.3"), (0x0000, 0x5058, 0x5750 ^ 0xFFFF), strict=True
):
    _fatal_framing_case(
        case_id,
        f"bad magic {magic:#06x}",
        R_MAGIC,
        partial(core.raw_frame, 16, core.PING_HEADER, magic=magic),
        ErrorCode.BAD_MAGIC,
    )
for case_id, version in zip(("3.1.4", "3.1.5", "3.1.6", "3.1.7"), (0, 1, 3, 255), strict=True):
    _fatal_framing_case(
        case_id,
        f"wire version {version}",
        "version: 2 ... else UNSUPPORTED_VERSION (fatal)",
        partial(core.raw_frame, 16, core.PING_HEADER, version=version),
        ErrorCode.UNSUPPORTED_VERSION,
    )
for case_id, kind in zip(("3.1.8", "3.1.9", "3.1.10", "3.1.11"), (0, 18, 99, 255), strict=True):
    _fatal_framing_case(
        case_id,
        f"unknown message type {kind}",
        "type is a code of §4 (UNKNOWN_MESSAGE_TYPE)",
        partial(core.raw_frame, kind, core.PING_HEADER),
        ErrorCode.UNKNOWN_MESSAGE_TYPE,
    )
for case_id, bit in zip(
    ("3.1.12", "3.1.13", "3.1.14", "3.1.15", "3.1.16", "3.1.17", "3.1.18", "3.1.19"),
    range(8),
    strict=True,
):
    _fatal_framing_case(
        case_id,
        f"flags bit {bit} set",
        "flags: 0; every bit is reserved (BAD_FLAGS)",
        partial(core.raw_frame, 16, core.PING_HEADER, flags=1 << bit),
        ErrorCode.BAD_FLAGS,
    )
_fatal_framing_case(
    "3.1.20",
    "reserved byte set",
    "reserved: 0 (BAD_FLAGS)",
    lambda: core.raw_frame(16, core.PING_HEADER, reserved=1),
    ErrorCode.BAD_FLAGS,
)
_fatal_framing_case(
    "3.1.21",
    "zero-length header",
    "header_len ≠ 0 (ZERO_LENGTH_HEADER)",
    lambda: core.raw_frame(16, b""),
    ErrorCode.ZERO_LENGTH_HEADER,
)
_fatal_framing_case(
    "3.1.22",
    "header longer than 4096",
    "header_len ≤ 4096 (FRAME_TOO_LARGE), before buffering",
    lambda: core.raw_frame(16, core.PING_HEADER, header_len=4097),
    ErrorCode.FRAME_TOO_LARGE,
)
_fatal_framing_case(
    "3.1.23",
    "payload declared 4 GiB",
    "payload_len ≤ the current payload limit (FRAME_TOO_LARGE)",
    lambda: core.raw_frame(4, core.PING_HEADER, payload_len=0xFFFFFFFF),
    ErrorCode.FRAME_TOO_LARGE,
)
_fatal_framing_case(
    "3.1.24",
    "payload before the handshake",
    "payload before the handshake completes: 0 bytes (§8)",
    lambda: core.raw_frame(4, core.PING_HEADER, payload_len=4) + b"\0" * 4,
    ErrorCode.FRAME_TOO_LARGE,
    after_handshake=False,
)
for case_id, kind in zip(
    ("3.1.25", "3.1.26", "3.1.27"), (MsgType.PING, MsgType.STEP, MsgType.COMMIT), strict=True
):
    _fatal_framing_case(
        case_id,
        f"payload on {kind.name}",
        "payload_len = 0 unless the type is OPEN or REPLY",
        partial(core.raw_frame, int(kind), core.PING_HEADER, b"\0" * 8),
        ErrorCode.PAYLOAD_LENGTH,
    )
_fatal_framing_case(
    "3.1.28",
    "header checksum mismatch",
    "checksum: low 32 bits of xxh3_64(bytes[0:12] ‖ header) (PREAMBLE_CHECKSUM)",
    lambda: core.raw_frame(16, core.PING_HEADER, checksum=0x12345678),
    ErrorCode.PREAMBLE_CHECKSUM,
)


@core.case(
    "3.1.29",
    "framing",
    "trailing garbage after a valid frame",
    "frames follow each other with no padding: the next bytes must be a preamble; the "
    "valid frame ahead of the error is still handled",
)
async def _trailing(s: core.Settings) -> None:
    async with await core.fresh(s) as peer:
        peer.send(framing.encode_frame(Ping(nonce=3)) + b"\0" * 16)
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


@core.case(
    "3.2.10",
    "framing",
    "slot above uint16",
    "an integer outside its stated range is HEADER_INVALID",
)
async def _slot_range(s: core.Settings) -> None:
    async with await core.fresh(s) as peer:
        # CLOSE = [6, session, slot] with slot 65536.
        header = b"\x93\x06" + msgspec.msgpack.encode(peer.session) + b"\xce\x00\x01\x00\x00"
        peer.send(core.raw_frame(int(MsgType.CLOSE), header))
        await peer.expect_error(ErrorCode.HEADER_INVALID, fatal=True)


@core.case(
    "3.1.30",
    "framing",
    "truncated preamble, then silence",
    "a receiver buffers a partial frame and waits; it is not an error by itself",
    informational=True,
)
async def _truncated(s: core.Settings) -> None:
    async with await core.fresh(s) as peer:
        peer.send(framing.encode_frame(Ping(nonce=9))[:10])
        if not await peer.quiet(0.5):
            raise core.CaseFailed("the worker reacted to half a preamble")


@core.case(
    "3.1.31",
    "framing",
    "handshake split at every byte",
    "frames may arrive in any number of reads; bytes are a stream",
)
async def _split(s: core.Settings) -> None:
    async with await core.Peer(s).connect() as peer:
        frame = framing.encode_frame(peer.hello())
        assert peer.writer is not None
        for i in range(len(frame)):
            peer.send(frame[i : i + 1])
            await peer.writer.drain()
        reply = await peer.next()
        if reply is None or reply.type not in (MsgType.HELLO, MsgType.CHALLENGE):
            raise core.CaseFailed(f"expected HELLO, got {core.describe(reply)}")


@core.case(
    "3.1.32",
    "framing",
    "several frames in one read",
    "frames follow each other with no padding; each is handled in order",
)
async def _batched(s: core.Settings) -> None:
    async with await core.fresh(s) as peer:
        peer.send(b"".join(framing.encode_frame(Ping(nonce=n)) for n in (1, 2, 3)))
        got = []
        for _ in range(3):
            frame = await peer.expect(MsgType.PONG)
            got.append(frame.message.nonce)  # type: ignore[union-attr]
        if got != [1, 2, 3]:
            raise core.CaseFailed(f"PONGs out of order: {got}")


@core.case(
    "3.1.33",
    "framing",
    "a STEP split across two reads inside its header",
    "frames may arrive in any number of reads",
)
async def _split_step(s: core.Settings) -> None:
    async with await core.fresh(s) as peer:
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
            raise core.CaseFailed(f"expected a reply, got {core.describe(f)}")
