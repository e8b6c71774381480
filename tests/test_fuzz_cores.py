"""Fuzz both protocol cores: any input gives only protocol events and valid output frames."""

from __future__ import annotations

import typing

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.wire import framing
from pp1wire.wire.spark_events import SparkEvent

from .pairs import make_pair, step
from .strategies import chunk

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _output_is_valid(chunks: list[bytes]) -> None:
    decoder = framing.FrameDecoder(framing.HARD_MAX_PAYLOAD)
    for c in chunks:
        decoder.feed(c)  # raises ProtocolError if a core ever emits a bad frame
    assert decoder.buffered == 0


@FUZZ
@given(st.lists(chunk(), min_size=1, max_size=12), st.booleans())
def test_worker_core_survives_any_input(chunks, handshake):
    pair = make_pair(handshake=handshake)
    if handshake:
        pair.spark.open_slot(0, seed=1, prefix=[1, 2, 3])
        pair.pump()
    for c in chunks:
        pair.worker.receive_data(c, 0.0)  # must never raise
        _output_is_valid(pair.worker.data_to_send())
    pair.worker.handle_timer(1e9)
    _output_is_valid(pair.worker.data_to_send())
    assert pair.worker.closed


SPARK_EVENTS = typing.get_args(SparkEvent)


@FUZZ
@given(st.lists(chunk(), min_size=1, max_size=12))
def test_spark_core_survives_any_input(chunks):
    pair = make_pair()
    pair.spark.open_slot(0, seed=1, prefix=[1, 2, 3])
    pair.pump()
    step(pair.spark, 0, depth=2, temperature=1.0, support=0, now=0.0)
    pair.spark.data_to_send()
    for c in chunks:
        events = pair.spark.receive_data(c, 0.0)  # must never raise
        for e in events:
            assert isinstance(e, SPARK_EVENTS)
        _output_is_valid(pair.spark.data_to_send())
    pair.spark.handle_timer(1e9)
    assert pair.spark.slots == {} or all(s.flight is None for s in pair.spark.slots.values())
