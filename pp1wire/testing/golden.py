"""Golden byte vectors for pp1 wire v2 (``golden/vectors.json``).

Usage: ``python -m pp1wire.testing.golden [--check] [FILE]`` (default ``golden/vectors.json``).

Two kinds of vector, each ``{"name", "kind", "hex", "context", "expect"}``:

* ``frame``: ``hex`` is fed to a frame decoder whose payload limit is
  ``context.max_payload``. ``expect`` is ``{"messages": [{"type", "fields",
  "payload"}...]}`` (bytes as hex) or ``{"error": CODE_NAME}``; a vector that
  ends mid-frame expects ``{"messages": [], "incomplete": true}``.
* ``reply``: a Spark side in the state ``context`` describes (negotiated
  vocabulary and row length, one open slot, one STEP in flight) receives
  ``hex`` (REPLY and COMPLETION frames). ``expect`` is either
  ``{"proposal": [tokens]}`` or ``{"discarded": CODE_NAME}`` (the whole
  proposal is refused with that code), plus ``"dropped": [CODE_NAME...]`` for
  frames that must be ignored and counted.

Another implementation qualifies by reproducing every ``expect``; ours also
re-encodes each valid message and compares the bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import xxhash

from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q import dyadic
from pp1wire.q.proposal import prefix_digest
from pp1wire.q.rng import ABI_NAME
from pp1wire.wire import framing, messages
from pp1wire.wire.messages import (
    Auth,
    Challenge,
    Close,
    Closed,
    Commit,
    Committed,
    Completion,
    Error,
    Hello,
    Message,
    MsgType,
    Open,
    Opened,
    Ping,
    Pong,
    Reply,
    Representation,
    Reset,
    ResetDone,
    Step,
)

SESSION = 7
VOCAB = 8
NONCE = bytes(range(16))

Vector = dict[str, Any]


def _hello(role: int, session: int = 0, **overrides: Any) -> Hello:
    fields: dict[str, Any] = {
        "role": role,
        "wire_version": messages.WIRE_VERSION,
        "q_semantic": dyadic.SEMANTIC_ID,
        "verifier": messages.VERIFIER_ID,
        "rng_abi": ABI_NAME,
        "precision": messages.PRECISION,
        "vocab_size": VOCAB,
        "vocab_hash": 0,
        "draft_identity": "pp1-toy-drafter",
        "draft_native": True,
        "target_identity": "pp1-toy-target",
        "max_slots": 4,
        "max_depth": 5,
        "max_support": 4,
        "row_entries": VOCAB,
        "max_frame": 1 << 20,
        "max_prefix": 1024,
        "nonce": NONCE,
        "session": session,
    }
    fields.update(overrides)
    return Hello(**fields)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    return value


def message_json(msg: Message, payload: bytes | memoryview = b"") -> dict[str, Any]:
    """A message as ``{"type", "fields", "payload"}`` (bytes as hex)."""
    return {
        "type": messages.type_of(msg).name,
        "fields": {k: _jsonable(v) for k, v in msgspec.structs.asdict(msg).items()},
        "payload": bytes(payload).hex(),
    }


def message_from_json(obj: dict[str, Any]) -> tuple[Message, bytes]:
    """Rebuild a message (and payload) from :func:`message_json` output."""
    kind = MsgType[obj["type"]]
    struct_type = messages.MESSAGE_TYPES[kind]
    fields = dict(obj["fields"])
    for name, ftype in zip(
        struct_type.__struct_fields__, msgspec.structs.fields(struct_type), strict=True
    ):
        if ftype.type is bytes or "bytes" in str(ftype.type):
            fields[name] = bytes.fromhex(fields[name])
    return struct_type(**fields), bytes.fromhex(obj["payload"])  # type: ignore[return-value]


_raw_frame = framing.encode_raw_frame


# -- frame vectors ---------------------------------------------------------------


def _valid_messages() -> list[tuple[str, Message, bytes]]:
    tokens = np.array([1, 2, 3], dtype="<i4")
    q = dyadic.counts_to_fp32(dyadic.counts_from_weights([1, 1, 2, 0, 0, 0, 0, 4]))
    sparse_ids = np.array([0, 2, 7], dtype="<i4").tobytes()
    sparse_q = dyadic.counts_to_fp32(np.array([dyadic.M // 4, dyadic.M // 4, dyadic.M // 2]))
    sparse = sparse_ids + sparse_q.tobytes()
    dense = q.tobytes()
    return [
        ("hello_spark", _hello(2), b""),
        ("hello_worker", _hello(1, SESSION), b""),
        ("challenge", Challenge(nonce=NONCE * 2, proof=bytes(32)), b""),
        ("auth", Auth(proof=bytes(range(32))), b""),
        (
            "open",
            Open(
                session=SESSION,
                slot=0,
                generation=0,
                seed=0x0123456789ABCDEF,
                context=0,
                eos=None,
                prefix_len=3,
                digest=prefix_digest([1, 2, 3]),
            ),
            tokens.tobytes(),
        ),
        ("opened", Opened(session=SESSION, slot=0, generation=0, position=3, digest=1), b""),
        ("close", Close(session=SESSION, slot=1), b""),
        ("closed", Closed(session=SESSION, slot=1), b""),
        (
            "step",
            Step(
                session=SESSION,
                slot=0,
                generation=0,
                round=0,
                position=3,
                digest=prefix_digest([1, 2, 3]),
                depth=5,
                temperature=1.0,
                support=0,
                context=0,
            ),
            b"",
        ),
        (
            "reply_dense",
            Reply(
                session=SESSION,
                slot=0,
                generation=0,
                round=0,
                index=0,
                position=3,
                token=7,
                representation=int(Representation.DENSE),
                entries=VOCAB,
                checksum=xxhash.xxh3_64_intdigest(dense),
            ),
            dense,
        ),
        (
            "reply_sparse",
            Reply(
                session=SESSION,
                slot=0,
                generation=0,
                round=0,
                index=0,
                position=3,
                token=2,
                representation=int(Representation.SPARSE),
                entries=3,
                checksum=xxhash.xxh3_64_intdigest(sparse),
            ),
            sparse,
        ),
        (
            "completion",
            Completion(
                session=SESSION,
                slot=0,
                generation=0,
                round=0,
                position=3,
                context=0,
                rows=5,
                reply_bytes=1000,
                reply_checksum=2**64 - 1,
                status=0,
            ),
            b"",
        ),
        (
            "commit",
            Commit(
                session=SESSION,
                slot=0,
                generation=0,
                round=0,
                accepted=2,
                extra=5,
                position=6,
                digest=9,
            ),
            b"",
        ),
        (
            "commit_eos",
            Commit(
                session=SESSION,
                slot=0,
                generation=0,
                round=0,
                accepted=1,
                extra=None,
                position=4,
                digest=9,
            ),
            b"",
        ),
        (
            "committed",
            Committed(session=SESSION, slot=0, generation=0, round=0, position=6, digest=9),
            b"",
        ),
        ("reset", Reset(session=SESSION, slot=0, generation=1), b""),
        (
            "reset_done",
            ResetDone(session=SESSION, slot=0, generation=1, position=6, digest=9),
            b"",
        ),
        (
            "error",
            Error(code=int(ErrorCode.STALE_GENERATION), answers=8, scope=0, slot=0, generation=0),
            b"",
        ),
        ("ping", Ping(nonce=42), b""),
        ("pong", Pong(nonce=42), b""),
    ]


def frame_vectors() -> list[Vector]:
    """Every valid message type once, then one vector per framing error class."""
    out: list[Vector] = []
    limit = 1 << 20
    for name, msg, payload in _valid_messages():
        frame = framing.encode_frame(msg, payload)
        out.append(
            {
                "name": f"valid_{name}",
                "kind": "frame",
                "hex": frame.hex(),
                "context": {"max_payload": limit},
                "expect": {"messages": [message_json(msg, payload)]},
            }
        )
    ping = messages.encode(Ping(nonce=1))
    pong_frame = framing.encode_frame(Pong(nonce=1))
    two = framing.encode_frame(Ping(nonce=1)) + pong_frame
    out.append(
        {
            "name": "valid_two_frames_in_one_read",
            "kind": "frame",
            "hex": two.hex(),
            "context": {"max_payload": limit},
            "expect": {"messages": [message_json(Ping(nonce=1)), message_json(Pong(nonce=1))]},
        }
    )
    out.append(
        {
            "name": "incomplete_truncated_preamble",
            "kind": "frame",
            "hex": pong_frame[:10].hex(),
            "context": {"max_payload": limit},
            "expect": {"messages": [], "incomplete": True},
        }
    )
    step_header = messages.encode(_valid_messages()[8][1])
    errors: list[tuple[str, bytes, ErrorCode, int]] = [
        ("bad_magic", _raw_frame(16, ping, magic=0x5858), ErrorCode.BAD_MAGIC, limit),
        ("unknown_version", _raw_frame(16, ping, version=3), ErrorCode.UNSUPPORTED_VERSION, limit),
        ("version_one", _raw_frame(16, ping, version=1), ErrorCode.UNSUPPORTED_VERSION, limit),
        ("unknown_type", _raw_frame(99, ping), ErrorCode.UNKNOWN_MESSAGE_TYPE, limit),
        ("type_zero", _raw_frame(0, ping), ErrorCode.UNKNOWN_MESSAGE_TYPE, limit),
        ("flags_set", _raw_frame(16, ping, flags=1), ErrorCode.BAD_FLAGS, limit),
        ("reserved_set", _raw_frame(16, ping, reserved=0x80), ErrorCode.BAD_FLAGS, limit),
        ("zero_header", _raw_frame(16, b""), ErrorCode.ZERO_LENGTH_HEADER, limit),
        (
            "header_too_long",
            _raw_frame(16, ping, header_len=framing.MAX_HEADER + 1),
            ErrorCode.FRAME_TOO_LARGE,
            limit,
        ),
        (
            "payload_over_limit",
            _raw_frame(9, ping, payload_len=limit + 1),
            ErrorCode.FRAME_TOO_LARGE,
            limit,
        ),
        (
            "payload_4gib_declared",
            _raw_frame(9, ping, payload_len=0xFFFFFFFF),
            ErrorCode.FRAME_TOO_LARGE,
            limit,
        ),
        (
            "payload_on_ping",
            _raw_frame(16, ping, b"\x00\x00\x00\x00"),
            ErrorCode.PAYLOAD_LENGTH,
            limit,
        ),
        (
            "payload_before_handshake",
            _raw_frame(4, ping, payload_len=4),
            ErrorCode.FRAME_TOO_LARGE,
            0,
        ),
        ("checksum_mismatch", _raw_frame(16, ping, checksum=0), ErrorCode.PREAMBLE_CHECKSUM, limit),
        ("header_not_msgpack", _raw_frame(16, b"\xc1"), ErrorCode.HEADER_INVALID, limit),
        ("header_tag_differs", _raw_frame(17, ping), ErrorCode.HEADER_INVALID, limit),
        ("header_trailing_bytes", _raw_frame(16, ping + b"\x00"), ErrorCode.HEADER_INVALID, limit),
        (
            "header_extra_field",
            _raw_frame(16, b"\x93\x10\x01\x02"),
            ErrorCode.HEADER_INVALID,
            limit,
        ),
        ("header_missing_field", _raw_frame(16, b"\x91\x10"), ErrorCode.HEADER_INVALID, limit),
        (
            "header_negative_int",
            _raw_frame(16, b"\x92\x10\xff"),
            ErrorCode.HEADER_INVALID,
            limit,
        ),
        (
            "header_slot_out_of_range",
            _raw_frame(6, b"\x93\x06\x07\xce\x00\x01\x00\x00"),
            ErrorCode.HEADER_INVALID,
            limit,
        ),
        (
            "header_float_for_int",
            _raw_frame(16, b"\x92\x10\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00"),
            ErrorCode.HEADER_INVALID,
            limit,
        ),
        (
            "header_map_not_array",
            _raw_frame(16, b"\x81\xa5nonce\x01"),
            ErrorCode.HEADER_INVALID,
            limit,
        ),
        (
            "step_header_in_reply_frame",
            _raw_frame(9, step_header),
            ErrorCode.HEADER_INVALID,
            limit,
        ),
    ]
    for name, frame, code, max_payload in errors:
        out.append(
            {
                "name": f"error_{name}",
                "kind": "frame",
                "hex": frame.hex(),
                "context": {"max_payload": max_payload},
                "expect": {"error": code.name},
            }
        )
    return out


def decode_frame_vector(vector: Vector) -> dict[str, Any]:
    """Run a frame vector through :class:`~pp1wire.wire.framing.FrameDecoder`."""
    decoder = framing.FrameDecoder(vector["context"]["max_payload"])
    try:
        frames = decoder.feed(bytes.fromhex(vector["hex"]))
        decoder.feed(b"")  # surfaces an error that followed valid frames
    except ProtocolError as exc:
        return {"error": exc.code.name}
    out: dict[str, Any] = {"messages": [message_json(f.message, f.payload) for f in frames]}
    if decoder.buffered:
        out["incomplete"] = True
    return out


# -- reply vectors -----------------------------------------------------------------


def _step(support: int, depth: int = 2) -> Step:
    return Step(
        session=SESSION,
        slot=0,
        generation=0,
        round=0,
        position=3,
        digest=prefix_digest([1, 2, 3]),
        depth=depth,
        temperature=1.0,
        support=support,
        context=0,
    )


def _dense_payload(counts: list[int], entries: int = VOCAB) -> bytes:
    q = np.zeros(entries, dtype="<f4")
    n = min(len(counts), entries)
    q[:n] = np.asarray(counts[:n], dtype=np.float64) / dyadic.M
    return q.tobytes()


def _sparse_payload(ids: list[int], counts: list[int]) -> bytes:
    return (
        np.asarray(ids, dtype="<i4").tobytes()
        + (np.asarray(counts, dtype=np.float64) / dyadic.M).astype("<f4").tobytes()
    )


def _row(
    step: Step,
    index: int,
    token: int,
    payload: bytes,
    *,
    entries: int | None = None,
    representation: int | None = None,
    checksum: int | None = None,
    **over: int,
) -> bytes:
    dense = step.support == 0
    count = entries if entries is not None else len(payload) // (4 if dense else 8)
    header = Reply(
        session=over.get("session", step.session),
        slot=step.slot,
        generation=over.get("generation", step.generation),
        round=over.get("round", step.round),
        index=over.get("index", index),
        position=over.get("position", step.position + index),
        token=token,
        representation=representation if representation is not None else (0 if dense else 1),
        entries=count,
        checksum=checksum if checksum is not None else xxhash.xxh3_64_intdigest(payload),
    )
    return framing.encode_frame(header, payload)


def _done(step: Step, body: bytes, nrows: int, **over: int) -> bytes:
    return framing.encode_frame(
        Completion(
            session=step.session,
            slot=step.slot,
            generation=over.get("generation", step.generation),
            round=over.get("round", step.round),
            position=over.get("position", step.position),
            context=step.context,
            rows=over.get("rows", nrows),
            reply_bytes=over.get("reply_bytes", len(body)),
            reply_checksum=over.get("reply_checksum", xxhash.xxh3_64_intdigest(body)),
            status=over.get("status", 0),
        )
    )


def _whole(step: Step, *frames: bytes, **over: int) -> bytes:
    body = b"".join(frames)
    return body + _done(step, body, len(frames), **over)


GOOD_DENSE = [dyadic.M // 2, 0, dyadic.M // 4, 0, 0, 0, 0, dyadic.M // 4]


def reply_vectors() -> list[Vector]:
    """One valid dense and sparse reply, then one vector per rejection class."""
    d = _step(0)
    s = _step(3)
    good0 = _row(d, 0, 0, _dense_payload(GOOD_DENSE))
    good1 = _row(d, 1, 2, _dense_payload(GOOD_DENSE))
    sp0 = _row(s, 0, 2, _sparse_payload([0, 2, 7], [dyadic.M // 4] * 2 + [dyadic.M // 2]))
    sp1 = _row(s, 1, 7, _sparse_payload([7], [dyadic.M]))

    def dense_bad(values: list[float]) -> bytes:
        payload = np.asarray(values, dtype="<f4").tobytes()
        return _whole(d, _row(d, 0, 0, payload), good1)

    def sparse_bad(ids: list[int], values: list[float], token: int = 0) -> bytes:
        payload = np.asarray(ids, dtype="<i4").tobytes() + np.asarray(values, dtype="<f4").tobytes()
        return _whole(s, _row(s, 0, token, payload), sp1)

    half, quarter = 0.5, 0.25
    base = [half, 0.0, quarter, 0.0, 0.0, 0.0, 0.0, quarter]
    cases: list[tuple[str, Step, bytes, dict[str, Any], dict[str, Any]]] = [
        ("valid_dense", d, _whole(d, good0, good1), {"proposal": [0, 2]}, {}),
        ("valid_sparse", s, _whole(s, sp0, sp1), {"proposal": [2, 7]}, {}),
        (
            "valid_terminal_shortens_block",
            d,
            _whole(d, _row(d, 0, 7, _dense_payload(GOOD_DENSE))),
            {"proposal": [7]},
            {"eos": 7},
        ),
        (
            "dense_nan",
            d,
            dense_bad([*base[:3], float("nan"), *base[4:]]),
            {"discarded": "NON_FINITE"},
            {},
        ),
        (
            "dense_inf",
            d,
            dense_bad([*base[:3], float("inf"), *base[4:]]),
            {"discarded": "NON_FINITE"},
            {},
        ),
        (
            "dense_negative_zero",
            d,
            dense_bad([*base[:3], -0.0, *base[4:]]),
            {"discarded": "NEGATIVE"},
            {},
        ),
        (
            "dense_negative",
            d,
            dense_bad([half + quarter, 0.0, quarter, -quarter, 0, 0, 0, quarter]),
            {"discarded": "NEGATIVE"},
            {},
        ),
        (
            "dense_non_dyadic",
            d,
            dense_bad([half, 0.0, quarter, 2.0**-26, 0, 0, 0, quarter]),
            {"discarded": "NON_DYADIC"},
            {},
        ),
        (
            "dense_above_one",
            d,
            dense_bad([2.0, 0, 0, 0, 0, 0, 0, 0]),
            {"discarded": "NON_DYADIC"},
            {},
        ),
        (
            "dense_mass_low",
            d,
            dense_bad([half, 0.0, quarter, 0, 0, 0, 0, 0]),
            {"discarded": "MASS_MISMATCH"},
            {},
        ),
        (
            "dense_mass_high_by_one_count",
            d,
            dense_bad([half, 2.0**-24, quarter, 0, 0, 0, 0, quarter]),
            {"discarded": "MASS_MISMATCH"},
            {},
        ),
        (
            "dense_zero_q_at_token",
            d,
            _whole(d, _row(d, 0, 1, _dense_payload(GOOD_DENSE)), good1),
            {"discarded": "ZERO_Q_AT_PROPOSED"},
            {},
        ),
        (
            "dense_token_out_of_range",
            d,
            _whole(d, _row(d, 0, VOCAB, _dense_payload(GOOD_DENSE)), good1),
            {"discarded": "PROPOSED_OUT_OF_RANGE"},
            {},
        ),
        (
            "dense_wrong_entries",
            d,
            _whole(d, _row(d, 0, 0, _dense_payload(GOOD_DENSE, VOCAB - 1)), good1),
            {"discarded": "ROW_LENGTH"},
            {},
        ),
        (
            "dense_payload_shorter_than_entries",
            d,
            _whole(d, _row(d, 0, 0, _dense_payload(GOOD_DENSE)[:-4], entries=VOCAB), good1),
            {"discarded": "ROW_LENGTH"},
            {},
        ),
        (
            "dense_padding_nonzero",
            d,
            _whole(
                d,
                _row(d, 0, 0, _dense_payload(GOOD_DENSE, VOCAB + 2)[:-4] + b"\x00\x00\x00\x80"),
                _row(d, 1, 2, _dense_payload(GOOD_DENSE, VOCAB + 2)),
            ),
            {"discarded": "DENSE_PADDING_NONZERO"},
            {"row_entries": VOCAB + 2},
        ),
        (
            "missing_q",
            d,
            _whole(d, _row(d, 0, 0, b"", entries=0), good1),
            {"discarded": "MISSING_Q"},
            {},
        ),
        (
            "dense_row_for_sparse_step",
            s,
            _whole(s, _row(s, 0, 0, _dense_payload(GOOD_DENSE), representation=0, entries=VOCAB)),
            {"discarded": "BAD_REPRESENTATION"},
            {"late": 1},
        ),
        (
            "sparse_duplicate_ids",
            s,
            sparse_bad([0, 0, 7], [quarter, quarter, half]),
            {"discarded": "SPARSE_DUPLICATE_ID"},
            {},
        ),
        (
            "sparse_duplicate_zeros",
            s,
            sparse_bad([0, 5, 5], [1.0, 0.0, 0.0]),
            {"discarded": "SPARSE_DUPLICATE_ID"},
            {},
        ),
        (
            "sparse_unsorted",
            s,
            sparse_bad([7, 0], [half, half]),
            {"discarded": "SPARSE_UNSORTED"},
            {},
        ),
        (
            "sparse_id_out_of_range",
            s,
            sparse_bad([0, VOCAB], [half, half]),
            {"discarded": "SPARSE_ID_OUT_OF_RANGE"},
            {},
        ),
        (
            "sparse_padded_id",
            s,
            sparse_bad([0, -1], [half, half]),
            {"discarded": "SPARSE_ID_OUT_OF_RANGE"},
            {},
        ),
        (
            "sparse_zero_entry",
            s,
            sparse_bad([0, 7], [1.0, 0.0]),
            {"discarded": "SPARSE_ZERO_ENTRY"},
            {},
        ),
        (
            "sparse_support_too_large",
            s,
            sparse_bad([0, 1, 2, 3], [quarter, quarter, quarter, quarter]),
            {"discarded": "SUPPORT_TOO_LARGE"},
            {},
        ),
        (
            "sparse_frame_over_negotiated_limit",
            s,
            sparse_bad([0, 1, 2, 3, 4], [quarter, quarter, quarter, 0.125, 0.125]),
            {"discarded": "FRAME_TOO_LARGE", "connection_failed": "FRAME_TOO_LARGE"},
            {"late": 0},
        ),
        ("sparse_mass", s, sparse_bad([0, 7], [half, quarter]), {"discarded": "MASS_MISMATCH"}, {}),
        (
            "sparse_zero_q_at_token",
            s,
            sparse_bad([0, 7], [half, half], token=3),
            {"discarded": "ZERO_Q_AT_PROPOSED"},
            {},
        ),
        (
            "sparse_non_finite",
            s,
            sparse_bad([0, 7], [half, float("nan")]),
            {"discarded": "NON_FINITE"},
            {},
        ),
        (
            "row_checksum_mismatch",
            d,
            _whole(d, _row(d, 0, 0, _dense_payload(GOOD_DENSE), checksum=1), good1),
            {"discarded": "ROW_CHECKSUM_MISMATCH"},
            {},
        ),
        ("rows_out_of_order", d, _whole(d, good1, good0), {"discarded": "ROW_OUT_OF_ORDER"}, {}),
        (
            "row_beyond_depth",
            d,
            _whole(d, good0, good1, _row(d, 2, 0, _dense_payload(GOOD_DENSE))),
            {"discarded": "ROW_OUT_OF_ORDER"},
            {"late": 1},
        ),
        (
            "row_wrong_position",
            d,
            _whole(d, _row(d, 0, 0, _dense_payload(GOOD_DENSE), position=9), good1),
            {"discarded": "WRONG_POSITION"},
            {},
        ),
        (
            "completion_early",
            d,
            good0 + _done(d, good0, 1),
            {"discarded": "COMPLETION_EARLY"},
            {"late": 0},
        ),
        (
            "completion_claims_more_rows",
            d,
            _whole(d, good0, good1, rows=3),
            {"discarded": "COMPLETION_EARLY"},
            {"late": 0},
        ),
        (
            "completion_wrong_size",
            d,
            _whole(d, good0, good1, reply_bytes=1),
            {"discarded": "REPLY_SIZE_MISMATCH"},
            {"late": 0},
        ),
        (
            "completion_wrong_checksum",
            d,
            _whole(d, good0, good1, reply_checksum=1),
            {"discarded": "REPLY_CHECKSUM_MISMATCH"},
            {"late": 0},
        ),
        (
            "completion_status_failure",
            d,
            _whole(d, status=int(ErrorCode.INTERNAL)),
            {"discarded": "INTERNAL"},
            {"late": 0},
        ),
        (
            "completion_twice",
            d,
            _whole(d, good0, good1) + _done(d, good0 + good1, 2),
            {"proposal": [0, 2], "dropped": ["COMPLETION_DUPLICATE"]},
            {},
        ),
        (
            "stale_generation_dropped",
            d,
            _row(d, 0, 0, _dense_payload(GOOD_DENSE), generation=0)
            + _whole(
                _gen(d, 1),
                _row(_gen(d, 1), 0, 0, _dense_payload(GOOD_DENSE)),
                _row(_gen(d, 1), 1, 2, _dense_payload(GOOD_DENSE)),
            ),
            {"proposal": [0, 2], "dropped": ["STALE_GENERATION"]},
            {"generation": 1},
        ),
        (
            "stale_round_dropped",
            _round(d, 1),
            _row(d, 0, 0, _dense_payload(GOOD_DENSE))
            + _whole(
                _round(d, 1),
                _row(_round(d, 1), 0, 0, _dense_payload(GOOD_DENSE)),
                _row(_round(d, 1), 1, 2, _dense_payload(GOOD_DENSE)),
            ),
            {"proposal": [0, 2], "dropped": ["ROUND_REUSED"]},
            {"round": 1},
        ),
        (
            "future_generation",
            d,
            _whole(d, _row(d, 0, 0, _dense_payload(GOOD_DENSE), generation=1), good1),
            {"discarded": "FUTURE_GENERATION"},
            {},
        ),
        (
            "future_round",
            d,
            _whole(d, _row(d, 0, 0, _dense_payload(GOOD_DENSE), round=1), good1),
            {"discarded": "ROW_OUT_OF_ORDER"},
            {},
        ),
        (
            "wrong_session",
            d,
            _row(d, 0, 0, _dense_payload(GOOD_DENSE), session=8) + _whole(d, good0, good1),
            {"proposal": [0, 2], "dropped": ["WRONG_SESSION"]},
            {},
        ),
    ]
    out = []
    for name, step, data, want, extra in cases:
        context = {
            "vocab_size": VOCAB,
            "row_entries": extra.get("row_entries", VOCAB),
            "max_support": 4,
            "session": SESSION,
            "prefix": [1, 2, 3],
            "eos": extra.get("eos"),
            "generation": extra.get("generation", 0),
            "round": extra.get("round", 0),
            "step": message_json(step),
        }
        expect = dict(want)
        # Every frame after the one that discarded the proposal is dropped as late.
        late = extra.get("late", 2) if "discarded" in expect else 0
        expect.setdefault("dropped", ["LATE_FRAME"] * late)
        out.append(
            {"name": name, "kind": "reply", "hex": data.hex(), "context": context, "expect": expect}
        )
    return out


def _gen(step: Step, generation: int) -> Step:
    return msgspec.structs.replace(step, generation=generation)


def _round(step: Step, round_id: int) -> Step:
    return msgspec.structs.replace(step, round=round_id)


def run_reply_vector(vector: Vector) -> dict[str, Any]:
    """Drive a Spark core into the vector's context, feed its bytes, summarize the outcome."""
    from pp1wire.wire import spark_core  # noqa: PLC0415 - spark_core imports this module's peers

    ctx = vector["context"]
    step = message_from_json(ctx["step"])[0]
    assert isinstance(step, Step)
    cfg = spark_core.SparkConfig(
        vocab_size=ctx["vocab_size"],
        row_entries=ctx["row_entries"],
        max_support=ctx["max_support"],
        max_frame=1 << 20,
        max_prefix=1024,
        draft_identity="",
    )
    spark = spark_core.SparkProtocol(cfg, now=0.0)
    spark.start(0.0)
    ours = spark._hello
    assert ours is not None
    worker_hello = msgspec.structs.replace(
        ours, role=1, session=ctx["session"], draft_identity="pp1-toy-drafter"
    )
    spark.receive_data(framing.encode_frame(worker_hello), 0.0)
    spark.open_slot(step.slot, seed=1, prefix=ctx["prefix"], eos=ctx["eos"])
    spark.receive_data(
        framing.encode_frame(
            Opened(
                session=ctx["session"],
                slot=step.slot,
                generation=0,
                position=len(ctx["prefix"]),
                digest=prefix_digest(ctx["prefix"]),
            )
        ),
        0.0,
    )
    for _ in range(ctx["generation"]):
        spark.reset(step.slot)
    for _ in range(ctx["round"]):
        spark.allocate_round(step.slot)
    got_round = spark.step(
        step.slot, depth=step.depth, temperature=step.temperature, support=step.support, now=0.0
    )
    assert got_round == step.round
    spark.data_to_send()
    events = spark.receive_data(bytes.fromhex(vector["hex"]), 0.0)
    result: dict[str, Any] = {"dropped": []}
    for event in events:
        if isinstance(event, spark_core.ProposalReady):
            result["proposal"] = list(event.proposal.tokens)
        elif isinstance(event, spark_core.ProposalFailed):
            result["discarded"] = event.code.name
        elif isinstance(event, spark_core.FrameDropped) or (
            isinstance(event, spark_core.FrameRejected) and event.code is ErrorCode.WRONG_SESSION
        ):
            result["dropped"].append(event.code.name)
        elif isinstance(event, spark_core.ConnectionFailed):
            result["connection_failed"] = event.code.name
    return result


def all_vectors() -> list[Vector]:
    """Every golden vector, in file order."""
    return frame_vectors() + reply_vectors()


def render() -> str:
    """The vectors file's exact text."""
    doc = {
        "description": "pp1 wire v2 golden vectors; see docs/protocol.md §10",
        "wire_version": messages.WIRE_VERSION,
        "vectors": all_vectors(),
    }
    return json.dumps(doc, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the vectors file, or with ``--check`` exit 1 if it differs."""
    parser = argparse.ArgumentParser(prog="python -m pp1wire.testing.golden", description=__doc__)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("file", nargs="?", default="golden/vectors.json")
    args = parser.parse_args(argv)
    path = Path(args.file)
    text = render()
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"out of date: {path}", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
