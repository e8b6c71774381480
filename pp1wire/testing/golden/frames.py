"""Frame vectors: every valid message type once, then one vector per framing error class."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from pp1wire.errors import ErrorCode
from pp1wire.errors import ErrorCode as E
from pp1wire.q import dyadic
from pp1wire.q.layout import ShardLayout
from pp1wire.testing.builders import (
    SESSION,
    completion_header,
    open_message,
    reply_header,
    reply_step,
)
from pp1wire.testing.golden.common import GROUP, NONCE, Vector, hello, message_json
from pp1wire.wire import framing, messages

raw_frame = framing.encode_raw_frame
SHARD_LAYOUT = ShardLayout((0, 4, 8))  # the shard vectors' split of the 8-token vocabulary


def valid_messages() -> list[tuple[str, messages.Message, bytes]]:
    """One valid message of every type (name, message, payload): the frame vectors' messages."""
    tokens = np.array([1, 2, 3], dtype="<i4")
    q = dyadic.counts_to_fp32(dyadic.counts_from_weights([1, 1, 2, 0, 0, 0, 0, 4]))
    sparse_ids = np.array([0, 2, 7], dtype="<i4").tobytes()
    sparse_q = dyadic.counts_to_fp32(np.array([dyadic.M // 4, dyadic.M // 4, dyadic.M // 2]))
    sparse = sparse_ids + sparse_q.tobytes()
    dense = q.tobytes()

    at = {"session": SESSION, "slot": 0, "generation": 0, "round": 0}

    def commit(*, accepted: int, extra: int | None, position: int) -> messages.Commit:
        """A COMMIT of round 0 on slot 0 (its digest a placeholder)."""
        return messages.Commit(**at, accepted=accepted, extra=extra, position=position, digest=9)

    return [
        ("hello_spark", hello(2), b""),
        ("hello_worker", hello(1, SESSION), b""),
        (
            "hello_spark_shard",
            hello(
                2,
                shards=2,
                shard=1,
                shard_start=4,
                shard_end=8,
                layout=SHARD_LAYOUT.digest,
                group=GROUP,
            ),
            b"",
        ),
        ("challenge", messages.Challenge(nonce=NONCE * 2, proof=bytes(32)), b""),
        ("auth", messages.Auth(proof=bytes(range(32))), b""),
        ("open", open_message(SESSION, 0, [1, 2, 3], seed=0x0123456789ABCDEF), tokens.tobytes()),
        (
            "opened",
            messages.Opened(session=SESSION, slot=0, generation=0, position=3, digest=1),
            b"",
        ),
        ("close", messages.Close(session=SESSION, slot=1), b""),
        ("closed", messages.Closed(session=SESSION, slot=1), b""),
        ("step", reply_step(0, depth=5), b""),
        ("reply_dense", reply_header(reply_step(0), 0, 7, dense), dense),
        (
            "reply_dense_shard",
            reply_header(reply_step(0), 0, 7, dense[16:], start=4, end=8),
            dense[16:],
        ),
        ("reply_sparse", reply_header(reply_step(3), 0, 2, sparse), sparse),
        (
            "completion",
            completion_header(reply_step(0), b"", 5, reply_bytes=1000, reply_checksum=2**64 - 1),
            b"",
        ),
        ("commit", commit(accepted=2, extra=5, position=6), b""),
        ("commit_eos", commit(accepted=1, extra=None, position=4), b""),
        ("committed", messages.Committed(**at, position=6, digest=9), b""),
        ("reset", messages.Reset(session=SESSION, slot=0, generation=1), b""),
        (
            "reset_done",
            messages.ResetDone(session=SESSION, slot=0, generation=1, position=6, digest=9),
            b"",
        ),
        (
            "error",
            messages.Error(
                code=int(ErrorCode.STALE_GENERATION), answers=8, scope=0, slot=0, generation=0
            ),
            b"",
        ),
        ("ping", messages.Ping(nonce=42), b""),
        ("pong", messages.Pong(nonce=42), b""),
    ]


def _vector(name: str, data: bytes, expect: dict[str, Any], max_payload: int) -> Vector:
    return {
        "name": name,
        "kind": "frame",
        "hex": data.hex(),
        "context": {"max_payload": max_payload},
        "expect": expect,
    }


def frame_vectors() -> list[Vector]:
    """Every valid message type once, then one vector per framing error class."""
    limit = 1 << 20
    out = [
        _vector(
            f"valid_{name}",
            framing.encode_frame(msg, payload),
            {"messages": [message_json(msg, payload)]},
            limit,
        )
        for name, msg, payload in valid_messages()
    ]
    ping = messages.encode(messages.Ping(nonce=1))
    pong_frame = framing.encode_frame(messages.Pong(nonce=1))
    two = framing.encode_frame(messages.Ping(nonce=1)) + pong_frame
    both = [message_json(messages.Ping(nonce=1)), message_json(messages.Pong(nonce=1))]
    out.append(_vector("valid_two_frames_in_one_read", two, {"messages": both}, limit))
    out.append(
        _vector(
            "incomplete_truncated_preamble",
            pong_frame[:10],
            {"messages": [], "incomplete": True},
            limit,
        )
    )
    step_header = messages.encode(valid_messages()[8][1])
    # Each error vector is read with max_payload = limit, but those named here.
    max_payload = {"payload_before_handshake": 0}
    errors: list[tuple[str, bytes, ErrorCode]] = [
        ("bad_magic", raw_frame(16, ping, magic=0x5858), E.BAD_MAGIC),
        (
            "unknown_version",
            raw_frame(16, ping, version=messages.WIRE_VERSION + 1),
            E.UNSUPPORTED_VERSION,
        ),
        ("version_one", raw_frame(16, ping, version=1), E.UNSUPPORTED_VERSION),
        ("unknown_type", raw_frame(99, ping), E.UNKNOWN_MESSAGE_TYPE),
        ("type_zero", raw_frame(0, ping), E.UNKNOWN_MESSAGE_TYPE),
        ("flags_set", raw_frame(16, ping, flags=2), E.BAD_FLAGS),
        ("reserved_set", raw_frame(16, ping, reserved=0x80), E.BAD_FLAGS),
        ("zero_header", raw_frame(16, b""), E.ZERO_LENGTH_HEADER),
        (
            "header_too_long",
            raw_frame(16, ping, header_len=framing.MAX_HEADER + 1),
            E.FRAME_TOO_LARGE,
        ),
        ("payload_over_limit", raw_frame(9, ping, payload_len=limit + 1), E.FRAME_TOO_LARGE),
        ("payload_4gib_declared", raw_frame(9, ping, payload_len=0xFFFFFFFF), E.FRAME_TOO_LARGE),
        ("payload_on_ping", raw_frame(16, ping, b"\x00\x00\x00\x00"), E.PAYLOAD_LENGTH),
        ("payload_before_handshake", raw_frame(4, ping, payload_len=4), E.FRAME_TOO_LARGE),
        ("checksum_mismatch", raw_frame(16, ping, checksum=0), E.PREAMBLE_CHECKSUM),
        ("header_not_msgpack", raw_frame(16, b"\xc1"), E.HEADER_INVALID),
        ("header_tag_differs", raw_frame(17, ping), E.HEADER_INVALID),
        ("header_trailing_bytes", raw_frame(16, ping + b"\x00"), E.HEADER_INVALID),
        ("header_extra_field", raw_frame(16, b"\x93\x10\x01\x02"), E.HEADER_INVALID),
        ("header_missing_field", raw_frame(16, b"\x91\x10"), E.HEADER_INVALID),
        ("header_negative_int", raw_frame(16, b"\x92\x10\xff"), E.HEADER_INVALID),
        (
            "header_slot_out_of_range",
            raw_frame(6, b"\x93\x06\x07\xce\x00\x01\x00\x00"),
            E.HEADER_INVALID,
        ),
        (
            "header_float_for_int",
            raw_frame(16, b"\x92\x10\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00"),
            E.HEADER_INVALID,
        ),
        ("header_map_not_array", raw_frame(16, b"\x81\xa5nonce\x01"), E.HEADER_INVALID),
        # §4.5, §4.6: exactly one of start and end, or start above end, is invalid
        # in REPLY and COMPLETION alike.
        ("reply_start_without_end", raw_frame(9, _ranged(9, 4, None)), E.HEADER_INVALID),
        ("reply_start_above_end", raw_frame(9, _ranged(9, 8, 4)), E.HEADER_INVALID),
        ("completion_start_without_end", raw_frame(10, _ranged(10, 4, None)), E.HEADER_INVALID),
        ("completion_end_without_start", raw_frame(10, _ranged(10, None, 8)), E.HEADER_INVALID),
        ("completion_start_above_end", raw_frame(10, _ranged(10, 8, 4)), E.HEADER_INVALID),
        ("step_header_in_reply_frame", raw_frame(9, step_header), E.HEADER_INVALID),
        # §4.5: a REPLY's token is a bin of exactly 4 bytes, at most 2**31 - 1; the
        # shortest-form uint of a peer before the fixed row format is invalid.
        ("reply_token_uint", raw_frame(9, _reply_with_token(7)), E.HEADER_INVALID),
        ("reply_token_bin_3", raw_frame(9, _reply_with_token(b"\x07\x00\x00")), E.HEADER_INVALID),
        (
            "reply_token_above_range",
            raw_frame(9, _reply_with_token((2**31).to_bytes(4, "little"))),
            E.HEADER_INVALID,
        ),
    ]
    for name, frame, code in errors:
        expect = {"error": code.name}
        out.append(_vector(f"error_{name}", frame, expect, max_payload.get(name, limit)))
    return out


def _ranged(kind: int, start: int | None, end: int | None) -> bytes:
    """A REPLY (9) or COMPLETION (10) header array with this ``start`` and ``end``
    (written by hand: the Structs refuse to build such a message)."""
    if kind == 9:  # session, slot, generation, round, index, position, token,
        # representation, entries, checksum
        fields: list[int | bytes | None] = [SESSION, 0, 0, 0, 0, 3, _TOKEN_7, 0, 0, 0]
    else:  # session, slot, generation, round, position, context, rows, bytes, checksum, status
        fields = [SESSION, 0, 0, 0, 3, 0, 0, 0, 0, 0]
    return msgspec.msgpack.encode([kind, *fields, start, end])


#: Token 7 as a REPLY carries it (§4.5): 4 bytes, little-endian.
_TOKEN_7 = (7).to_bytes(4, "little")


def _reply_with_token(token: int | bytes) -> bytes:
    """An unsharded REPLY header array whose element 7 (the token) is ``token`` as
    msgpack writes it (an int in its shortest form, bytes as a bin)."""
    return msgspec.msgpack.encode([9, SESSION, 0, 0, 0, 0, 3, token, 0, 0, 0])
