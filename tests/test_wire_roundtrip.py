"""Messages and frames: round trips, arbitrary bytes, split streams, allocation bounds."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q import dyadic
from pp1wire.wire import framing, messages
from pp1wire.wire.messages import PAYLOAD_TYPES

from .strategies import any_message


@settings(max_examples=200, deadline=None)
@given(any_message, st.binary(max_size=64))
def test_every_message_round_trips(msg, payload):
    kind = messages.type_of(msg)
    payload = payload if kind in PAYLOAD_TYPES else b""
    frame = framing.encode_frame(msg, payload)
    decoder = framing.FrameDecoder(1 << 16)
    (got,) = decoder.feed(frame)
    assert got.type is kind
    assert got.message == msg
    assert bytes(got.payload) == payload
    assert bytes(got.raw) == frame


def _decode_all(data: bytes, limit: int = 1 << 16) -> list | ErrorCode:
    decoder = framing.FrameDecoder(limit)
    try:
        frames = decoder.feed(data)
        decoder.feed(b"")
    except ProtocolError as exc:
        return exc.code
    return [(f.type, f.message, bytes(f.payload)) for f in frames]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_arbitrary_bytes_give_frames_or_a_protocol_error(data):
    # Anything else (a msgspec error, IndexError, struct.error...) fails the test.
    _decode_all(data)


@settings(max_examples=300, deadline=None)
@given(any_message, st.data())
def test_mutated_frames_give_frames_or_a_protocol_error(msg, data):
    frame = bytearray(framing.encode_frame(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        frame = frame[: data.draw(st.integers(0, len(frame)))]
    _decode_all(bytes(frame))


@settings(max_examples=60, deadline=None)
@given(st.lists(any_message, min_size=1, max_size=4))
def test_split_at_every_byte_boundary(msgs):
    stream = b"".join(
        framing.encode_frame(
            m, b"\x01\x00\x00\x00" if messages.type_of(m) in PAYLOAD_TYPES else b""
        )
        for m in msgs
    )
    whole = _decode_all(stream)
    for cut in range(len(stream) + 1):
        decoder = framing.FrameDecoder(1 << 16)
        frames = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert [(f.type, f.message, bytes(f.payload)) for f in frames] == whole
    decoder = framing.FrameDecoder(1 << 16)
    one_by_one = [f for i in range(len(stream)) for f in decoder.feed(stream[i : i + 1])]
    assert [(f.type, f.message, bytes(f.payload)) for f in one_by_one] == whole


def test_large_frame_is_received_into_its_own_buffer():
    sizes = []

    def allocator(n: int) -> memoryview:
        sizes.append(n)
        return memoryview(bytearray(n))

    payload = bytes(range(256)) * 100
    msg = messages.Reply(
        session=1,
        slot=0,
        generation=0,
        round=0,
        index=0,
        position=0,
        token=1,
        representation=0,
        entries=6400,
        checksum=0,
    )
    frame = framing.encode_frame(msg, payload)
    decoder = framing.FrameDecoder(1 << 20, allocator=allocator)
    got = []
    view = memoryview(frame)
    while view:
        buf = decoder.get_buffer()
        n = min(len(buf), len(view), 1000)
        buf[:n] = view[:n]
        view = view[n:]
        got += decoder.buffer_updated(n)
    assert sizes == [len(frame)]
    assert bytes(got[0].payload) == payload
    assert got[0].payload.readonly


@pytest.mark.parametrize("declared", [(1 << 20) + 1, 1 << 30, 0xFFFFFFFF])
def test_length_above_limit_refused_without_allocating(declared):
    calls = []

    def allocator(n: int) -> memoryview:
        calls.append(n)
        return memoryview(bytearray(n))

    header = messages.encode(messages.Ping(nonce=1))
    import struct

    head = struct.pack("<2sBBBBHI", b"PW", messages.WIRE_VERSION, 9, 0, 0, len(header), declared)
    frame = head + struct.pack("<I", framing.header_checksum(head, header)) + header
    decoder = framing.FrameDecoder(1 << 20, allocator=allocator)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as info:
            decoder.feed(frame + b"\x00" * 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert calls == []
    assert peak < 256 << 10  # nothing near the declared size was allocated
    # The decoder stays failed: no resynchronization on a corrupt stream.
    with pytest.raises(ProtocolError):
        decoder.feed(framing.encode_frame(messages.Ping(nonce=2)))


def test_encode_refuses_payload_on_headers_only_types():
    with pytest.raises(ProtocolError) as info:
        framing.encode_frame(messages.Ping(nonce=1), b"x")
    assert info.value.code is ErrorCode.PAYLOAD_LENGTH


@pytest.mark.parametrize("support", [None, 32])
def test_row_payload_q_values_are_exactly_counts_over_two_to_the_24(support):
    # The FP32 product is computed without a float64 pass: still c / 2**24 exactly.
    from pp1wire.q.proposal import QRow
    from pp1wire.wire.replies import row_payload

    rng = np.random.default_rng(7)
    for counts in (
        dyadic.counts_from_logits(rng.standard_normal(129_280), 1.0),
        np.eye(1, 4096, 5, dtype=np.int64)[0] * dyadic.M,  # one count of 2**24
    ):
        if support is None:
            row = QRow(token=0, counts=counts.astype(np.int32))
            got = np.frombuffer(row_payload(row, counts.size + 3)[0], dtype="<f4")
            want = np.concatenate([counts / dyadic.M, np.zeros(3)])
        else:
            ids = np.flatnonzero(counts)[:support].astype(np.int32)
            row = QRow(token=0, counts=counts[ids].astype(np.int32), ids=ids)
            got = np.frombuffer(row_payload(row, counts.size)[0], dtype="<f4")[ids.size :]
            want = counts[ids] / dyadic.M
        assert np.array_equal(got.astype(np.float64), want)
