"""Frame encoding and incremental decoding (``docs/protocol.md`` §3): every length is checked
from the 16-byte preamble before a byte of header or payload is buffered, and payloads are
handed out as read-only views of the received bytes."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import xxhash

from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.wire import messages
from pp1wire.wire.messages import PAYLOAD_TYPES, Message, MsgType

MAGIC: Final = b"PW"
PREAMBLE: Final = struct.Struct("<2sBBBBHII")  # magic .. checksum
PREAMBLE_SIZE: Final = PREAMBLE.size
MAX_HEADER: Final = 4096
#: Absolute cap on a frame's payload, whatever was negotiated (64 MiB).
HARD_MAX_PAYLOAD: Final = 64 << 20
#: Payload limit before HELLO has negotiated one: enough for no message at all.
PRE_HANDSHAKE_MAX_PAYLOAD: Final = 0
#: Frames up to this size are assembled in the decoder's scratch buffer.
SMALL_FRAME: Final = 8192
SCRATCH_SIZE: Final = 64 << 10
#: Preamble flag: the frame is followed by an integrity tag (§5.1).
FLAG_TAGGED: Final = 0x01
TAG_SIZE: Final = 16

assert PREAMBLE_SIZE == 16


def header_checksum(preamble_head: bytes | memoryview, header: bytes | memoryview) -> int:
    """Low 32 bits of xxh3_64 over the first 12 preamble bytes and the header."""
    # Headers are small: one concatenation is cheaper than a streaming hasher.
    return int(xxhash.xxh3_64_intdigest(bytes(preamble_head) + bytes(header))) & 0xFFFFFFFF


def encode_frame(msg: Message, payload: bytes | memoryview = b"", *, tagged: bool = False) -> bytes:
    """One complete frame for ``msg`` with ``payload`` appended (``tagged``: the TAGGED flag
    set; the caller appends the tag, :class:`pp1wire.wire.integrity.Sealer`).

    Raises:
        ProtocolError: ``PAYLOAD_LENGTH`` if a payload is given for a type that
            carries none; ``FRAME_TOO_LARGE`` if the header or payload exceeds
            the absolute caps.
    """
    return encode_head(msg, memoryview(payload).nbytes, tagged=tagged) + bytes(payload)


def encode_head(msg: Message, payload_len: int, *, tagged: bool = False) -> bytes:
    """A frame's preamble and header for a payload of ``payload_len`` bytes sent after it
    (a large payload goes to the transport as it is, not joined to its header).

    Raises:
        ProtocolError: as :func:`encode_frame`.
    """
    kind = messages.type_of(msg)
    header = messages.encode(msg)
    if payload_len and kind not in PAYLOAD_TYPES:
        raise ProtocolError(ErrorCode.PAYLOAD_LENGTH, f"{kind.name} carries no payload")
    if len(header) > MAX_HEADER or payload_len > HARD_MAX_PAYLOAD:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, "header or payload above the caps")
    head = struct.pack(
        "<2sBBBBHI",
        MAGIC,
        messages.WIRE_VERSION,
        int(kind),
        FLAG_TAGGED if tagged else 0,
        0,
        len(header),
        payload_len,
    )
    checksum = header_checksum(head, header)
    return b"".join((head, struct.pack("<I", checksum), header))


def encode_raw_frame(kind: int, header: bytes, payload: bytes = b"", **preamble: int) -> bytes:
    """A frame whose preamble fields ``preamble`` may override (``magic`` as a 16-bit
    little-endian value, ``version``, ``flags``, ``reserved``, ``header_len``,
    ``payload_len``, ``checksum``): deliberately broken frames for tests."""
    head = struct.pack(
        "<HBBBBHI",
        preamble.get("magic", int.from_bytes(MAGIC, "little")),
        preamble.get("version", messages.WIRE_VERSION),
        kind,
        preamble.get("flags", 0),
        preamble.get("reserved", 0),
        preamble.get("header_len", len(header)),
        preamble.get("payload_len", len(payload)),
    )
    checksum = preamble.get("checksum", header_checksum(head, header))
    return head + struct.pack("<I", checksum) + header + payload


Allocator = Callable[[int], memoryview]
"""Returns a writable buffer of at least the requested size for one large frame."""


def _fresh(size: int) -> memoryview:
    return memoryview(bytearray(size))


@dataclass(frozen=True)
class Frame:
    """A decoded frame: its message, payload view, its bytes without the tag, and the tag."""

    type: MsgType
    message: Message
    payload: memoryview
    raw: memoryview
    tag: memoryview | None = None


def detached(frame: Frame) -> Frame:
    """``frame`` with its bytes copied out of the decoder's buffers (held across reads)."""
    raw = memoryview(bytes(frame.raw))
    start = frame.raw.nbytes - frame.payload.nbytes
    tag = None if frame.tag is None else memoryview(bytes(frame.tag))
    return Frame(frame.type, frame.message, raw[start:], raw, tag)


class FrameDecoder:
    """Incremental frame decoder: bytes in (:meth:`feed`, or :meth:`get_buffer` and
    :meth:`buffer_updated` for a buffered transport), frames out; no I/O.

    A frame above :data:`SMALL_FRAME` gets its own buffer from ``allocator`` once its
    preamble passed, which the socket fills directly. After the first framing error
    the decoder is dead and every later call raises that error.
    """

    def __init__(
        self, max_payload: int = PRE_HANDSHAKE_MAX_PAYLOAD, allocator: Allocator | None = None
    ) -> None:
        """Start with a payload limit (raise it after HELLO with :meth:`set_max_payload`)."""
        self._scratch = bytearray(SCRATCH_SIZE)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        self._big: memoryview | None = None
        self._big_filled = 0
        self._need: int | None = None
        self._max_payload = min(max_payload, HARD_MAX_PAYLOAD)
        self._allocator = allocator or _fresh
        self._failed: ProtocolError | None = None
        self.bytes_received = 0

    def set_max_payload(self, limit: int) -> None:
        """Change the payload limit (capped at :data:`HARD_MAX_PAYLOAD`)."""
        self._max_payload = min(limit, HARD_MAX_PAYLOAD)

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return self._end - self._start + self._big_filled

    @property
    def error(self) -> ProtocolError | None:
        """The framing error that killed this decoder (pending after valid frames), if any."""
        return self._failed

    def get_buffer(self) -> memoryview:
        """Where the next received bytes must be written (then call :meth:`buffer_updated`).

        Raises:
            ProtocolError: the decoder's earlier error, if it has failed.
        """
        if self._failed is not None:
            raise self._failed
        if self._big is not None:
            return self._big[self._big_filled : self._need]
        if self._start:
            # Small frames are short; compacting them is cheaper than a ring.
            live = self._end - self._start
            self._view[:live] = self._view[self._start : self._end]
            self._start, self._end = 0, live
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last :meth:`get_buffer`; return every
        frame they complete.

        Raises:
            ProtocolError: see :meth:`feed`.
        """
        self.account(nbytes)
        frames: list[Frame] = []
        try:
            while (frame := self.next_frame()) is not None:
                frames.append(frame)
        except ProtocolError:
            if frames:
                return frames  # deliver what was valid; the error comes next call
            raise
        return frames

    def account(self, nbytes: int) -> None:
        """Record ``nbytes`` written into the last :meth:`get_buffer` (parse nothing yet).

        Raises:
            ProtocolError: the decoder's earlier error, if it has failed.
        """
        if self._failed is not None:
            raise self._failed
        self.bytes_received += nbytes
        if self._big is not None:
            self._big_filled += nbytes
        else:
            self._end += nbytes

    def next_frame(self) -> Frame | None:
        """The next complete frame already received, or None if more bytes are needed
        (a receiver may stop between frames: a per-turn budget, a handshake).

        Raises:
            ProtocolError: see :meth:`feed`; the decoder then stays failed.
        """
        if self._failed is not None:
            raise self._failed
        try:
            return self._next()
        except ProtocolError as exc:
            self._failed = exc
            raise

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Add received bytes; return every frame they complete, in order.

        Raises:
            ProtocolError: ``BAD_MAGIC``, ``UNSUPPORTED_VERSION``,
                ``UNKNOWN_MESSAGE_TYPE``, ``BAD_FLAGS``, ``ZERO_LENGTH_HEADER``,
                ``FRAME_TOO_LARGE``, ``PAYLOAD_LENGTH``, ``PREAMBLE_CHECKSUM``
                or ``HEADER_INVALID``; the decoder then stays failed.
        """
        src = memoryview(data).cast("B")
        frames: list[Frame] = []
        while True:
            try:
                dst = self.get_buffer()
            except ProtocolError:
                if frames:
                    return frames
                raise
            n = min(len(dst), len(src))
            dst[:n] = src[:n]
            src = src[n:]
            frames.extend(self.buffer_updated(n))
            if not src or self._failed is not None:
                return frames

    def _check_preamble(self, view: memoryview) -> int:
        magic, version, kind, flags, reserved, hlen, plen, _ = PREAMBLE.unpack_from(view)
        if magic != MAGIC:
            raise ProtocolError(ErrorCode.BAD_MAGIC, f"magic {bytes(magic)!r}")
        if version != messages.WIRE_VERSION:
            raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"wire version {version}")
        mtype = messages.TYPE_BY_CODE[kind]
        if mtype is None:
            raise ProtocolError(ErrorCode.UNKNOWN_MESSAGE_TYPE, f"type {kind}")
        if flags & ~FLAG_TAGGED or reserved:
            raise ProtocolError(ErrorCode.BAD_FLAGS, f"flags {flags:#x}, reserved {reserved:#x}")
        if hlen == 0:
            raise ProtocolError(ErrorCode.ZERO_LENGTH_HEADER, "empty header")
        if hlen > MAX_HEADER:
            raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"header {hlen} > {MAX_HEADER}")
        if plen and mtype not in PAYLOAD_TYPES:
            raise ProtocolError(ErrorCode.PAYLOAD_LENGTH, f"{mtype.name} carries no payload")
        if plen > self._max_payload:
            raise ProtocolError(
                ErrorCode.FRAME_TOO_LARGE, f"payload {plen} > limit {self._max_payload}"
            )
        return int(PREAMBLE_SIZE + hlen + plen + (TAG_SIZE if flags else 0))

    def _next(self) -> Frame | None:
        if self._big is not None:
            if self._big_filled < (self._need or 0):
                return None
            return self._finish_big()
        start = self._start
        have = self._end - start
        if have < PREAMBLE_SIZE:
            if have == 0:
                self._start = self._end = 0
            return None
        if self._need is None:
            self._need = self._check_preamble(self._view[start : start + PREAMBLE_SIZE])
        need = self._need
        if need > SMALL_FRAME:
            big = self._allocator(need)
            if len(big) < need:
                raise ProtocolError(ErrorCode.INTERNAL, "allocator returned a short buffer")
            take = min(have, need)
            big[:take] = self._view[start : start + take]
            self._start += take
            self._big, self._big_filled = big, take
            return self._finish_big() if take == need else None
        if have < need:
            return None
        raw = bytes(self._view[start : start + need])
        self._start += need
        self._need = None
        return _parse(memoryview(raw))

    def _finish_big(self) -> Frame:
        big, need = self._big, self._need
        assert big is not None
        assert need is not None
        self._big, self._big_filled, self._need = None, 0, None
        return _parse(big[:need])


def _parse(frame: memoryview) -> Frame:
    """Check the header checksum and decode a complete frame (and split off its tag)."""
    tag = None
    view = frame
    if frame[4] & FLAG_TAGGED:
        view, tag = frame[:-TAG_SIZE], frame[-TAG_SIZE:].toreadonly()
    hlen, _plen, checksum = struct.unpack_from("<HII", view, 6)
    header = view[PREAMBLE_SIZE : PREAMBLE_SIZE + hlen]
    if header_checksum(view[:12], header) != checksum:
        raise ProtocolError(ErrorCode.PREAMBLE_CHECKSUM, "header checksum mismatch")
    mtype = messages.TYPE_BY_CODE[view[3]]
    assert mtype is not None  # checked with the preamble
    message = messages.decode(header, mtype)
    payload = view[PREAMBLE_SIZE + hlen :].toreadonly()
    return Frame(mtype, message, payload, view.toreadonly(), tag)
