"""Builders of exact REPLY and COMPLETION bytes, valid or deliberately broken, for the golden
vectors, the hostile-worker tests and the conformance suites: a broken row differs from a valid
one only in the field a case names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash

from pp1wire.q import dyadic
from pp1wire.q.layout import ShardLayout
from pp1wire.q.proposal import prefix_digest
from pp1wire.wire import framing
from pp1wire.wire.messages import Completion, FixedToken, Hello, MsgType, Open, Reply, Step

SESSION = 7
VOCAB = 8


def reply_step(support: int, depth: int = 2, **over: Any) -> Step:
    """The STEP the reply vectors answer: slot 0 at prefix (1, 2, 3), round 0; support 0:
    dense (any other field overridden)."""
    fields: dict[str, Any] = {
        "session": SESSION,
        "slot": 0,
        "generation": 0,
        "round": 0,
        "position": 3,
        "digest": prefix_digest([1, 2, 3]),
        "depth": depth,
        "temperature": 1.0,
        "support": support,
        "context": 0,
    }
    return Step(**fields | over)


def dense_payload(counts: list[int], entries: int = VOCAB) -> bytes:
    """A dense row payload: counts / M as FP32, zero-padded to ``entries``."""
    q = np.zeros(entries, dtype="<f4")
    n = min(len(counts), entries)
    q[:n] = np.asarray(counts[:n], dtype=np.float64) / dyadic.M
    return q.tobytes()


def sparse_payload(ids: list[int], counts: list[int]) -> bytes:
    """A sparse row payload: int32 IDs, then counts / M as FP32."""
    return (
        np.asarray(ids, dtype="<i4").tobytes()
        + (np.asarray(counts, dtype=np.float64) / dyadic.M).astype("<f4").tobytes()
    )


def fp32(values: list[float]) -> bytes:
    """A dense row payload of exactly these FP32 values (NaN, -0.0 and the like included)."""
    return np.asarray(values, dtype="<f4").tobytes()


def fp32s(ids: list[int], values: list[float]) -> bytes:
    """A sparse row payload of exactly these int32 IDs and FP32 values."""
    return np.asarray(ids, dtype="<i4").tobytes() + fp32(values)


def open_message(session: int, slot: int, tokens: Sequence[int], **over: Any) -> Open:
    """A valid OPEN of ``slot`` at prefix ``tokens`` (any field overridden, for broken ones)."""
    fields: dict[str, Any] = {
        "session": session,
        "slot": slot,
        "generation": 0,
        "seed": 1,
        "context": 0,
        "eos": None,
        "prefix_len": len(tokens),
        # The digest of the payload bytes, so broken prefixes (negative IDs) get one too.
        "digest": xxhash.xxh3_64_intdigest(token_bytes(tokens)),
    }
    return Open(**fields | over)


def token_bytes(tokens: Sequence[int]) -> bytes:
    """The OPEN payload of a prefix: little-endian int32 token IDs."""
    return np.asarray(list(tokens), dtype="<i4").tobytes()


def reply_header(
    step: Step,
    index: int,
    token: int,
    payload: bytes,
    *,
    entries: int | None = None,
    representation: int | None = None,
    checksum: int | None = None,
    **over: int,
) -> Reply:
    """The REPLY header of row ``index`` answering ``step`` (any field overridable).

    ``start`` and ``end`` (a sharded link's range) are absent unless given.
    """
    dense = step.support == 0
    count = entries if entries is not None else len(payload) // (4 if dense else 8)
    return Reply(
        session=over.get("session", step.session),
        slot=over.get("slot", step.slot),
        generation=over.get("generation", step.generation),
        round=over.get("round", step.round),
        index=over.get("index", index),
        position=over.get("position", step.position + index),
        token=FixedToken(token),
        representation=representation if representation is not None else (0 if dense else 1),
        entries=count,
        checksum=checksum if checksum is not None else xxhash.xxh3_64_intdigest(payload),
        start=over.get("start"),
        end=over.get("end"),
    )


def reply_row(step: Step, index: int, token: int, payload: bytes, **over: Any) -> bytes:
    """One REPLY frame answering ``step``; ``over`` as for :func:`reply_header`."""
    return framing.encode_frame(reply_header(step, index, token, payload, **over), payload)


def uint_token_frame(frame: bytes) -> bytes:
    """An untagged REPLY frame as peers before the fixed row format wrote it
    (``docs/protocol.md`` §11): the same header with its token as a shortest-form
    msgpack uint, the frame checksum recomputed, the payload as it was.

    Raises:
        ValueError: for a frame that is not an untagged REPLY.
    """
    if frame[3] != MsgType.REPLY or frame[4] & framing.FLAG_TAGGED:
        raise ValueError("an untagged REPLY frame is needed")
    end = framing.PREAMBLE_SIZE + int.from_bytes(frame[6:8], "little")
    array = msgspec.msgpack.decode(frame[framing.PREAMBLE_SIZE : end])
    array[7] = int.from_bytes(array[7], "little")
    return framing.encode_raw_frame(int(MsgType.REPLY), msgspec.msgpack.encode(array), frame[end:])


def older_hello_frame(msg: Hello) -> bytes:
    """``msg`` as a peer before HELLO field 28 (``row_format``) frames it
    (``docs/protocol.md`` §11): the same array ending at field 27."""
    array = msgspec.msgpack.decode(framing.encode_frame(msg)[framing.PREAMBLE_SIZE :])
    end = 1 + Hello.__struct_fields__.index("row_format")  # element 0 is the type code
    return framing.encode_raw_frame(int(MsgType.HELLO), msgspec.msgpack.encode(array[:end]))


def completion_header(step: Step, body: bytes, nrows: int, **over: int) -> Completion:
    """The COMPLETION header of a reply whose REPLY frames are ``body`` (range as for
    :func:`reply_header`; ``stopped=1``: the flag of a block its stop rule ended)."""
    return Completion(
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
        start=over.get("start"),
        end=over.get("end"),
        stopped=bool(over.get("stopped", 0)),
    )


def completion(step: Step, body: bytes, nrows: int, **over: int) -> bytes:
    """The COMPLETION frame :func:`completion_header` describes."""
    return framing.encode_frame(completion_header(step, body, nrows, **over))


def whole_reply(step: Step, *frames: bytes, **over: int) -> bytes:
    """REPLY frames followed by their COMPLETION."""
    body = b"".join(frames)
    return body + completion(step, body, len(frames), **over)


def split_frames(data: bytes) -> list[bytes]:
    """The frames in ``data``, each as its own bytes."""
    decoder = framing.FrameDecoder(1 << 26)
    return [bytes(f.raw) for f in decoder.feed(data)]


def shard_fields(layout: ShardLayout, shard: int) -> dict[str, int]:
    """The HELLO fields that declare ``shard`` of ``layout`` (the group nonce apart, §6.7)."""
    start, end = layout.range(shard)
    return {
        "shards": layout.shards,
        "shard": shard,
        "shard_start": start,
        "shard_end": end,
        "layout": layout.digest,
    }
