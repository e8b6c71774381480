"""Hypothesis strategies for every wire message (shared by tests and the fuzz harness)."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st

from pp1wire.errors import ProtocolError
from pp1wire.wire.messages import MESSAGE_TYPES, TOKEN_MAX, FixedToken, MsgType


def _strategy(t: msgspec.inspect.Type) -> st.SearchStrategy:
    i = msgspec.inspect
    if isinstance(t, i.Metadata):
        return _strategy(t.type)
    if isinstance(t, i.IntType):
        lo = t.ge if t.ge is not None else -(2**63)
        hi = t.le if t.le is not None else 2**64 - 1
        return st.integers(lo, hi)
    if isinstance(t, i.FloatType):
        return st.floats(allow_nan=False)
    if isinstance(t, i.BoolType):
        return st.booleans()
    if isinstance(t, i.StrType):
        return st.text(max_size=t.max_length or 64)
    if isinstance(t, i.BytesType):
        return st.binary(min_size=t.min_length or 0, max_size=t.max_length or 64)
    if isinstance(t, i.NoneType):
        return st.none()
    if isinstance(t, i.UnionType):
        return st.one_of(*[_strategy(x) for x in t.types])
    if isinstance(t, i.CustomType) and t.cls is FixedToken:
        return st.integers(0, TOKEN_MAX)
    raise NotImplementedError(t)


def message_strategy(kind: MsgType) -> st.SearchStrategy:
    info = msgspec.inspect.type_info(MESSAGE_TYPES[kind])
    fields = {f.name: _strategy(f.type) for f in info.fields}
    cls = MESSAGE_TYPES[kind]

    def build(values: dict) -> object:
        try:
            return cls(**values)
        except ProtocolError:
            return None  # cross-field rule refused it; skip

    return st.fixed_dictionaries(fields).map(build).filter(lambda m: m is not None)


any_message = st.sampled_from(list(MsgType)).flatmap(message_strategy)


def frame_bytes(msg: object, payload: bytes = b"") -> bytes:
    """Encode a generated message as a frame (payload only where the type allows one)."""
    from pp1wire.wire import framing, messages

    kind = messages.type_of(msg)  # type: ignore[arg-type]
    return framing.encode_frame(msg, payload if kind in messages.PAYLOAD_TYPES else b"")  # type: ignore[arg-type]


@st.composite
def chunk(draw: st.DrawFn) -> bytes:
    """One chunk of input for a protocol core: a valid frame, a mutated one, or noise."""
    msg = draw(any_message)
    data = bytearray(frame_bytes(msg, draw(st.binary(max_size=48))))
    how = draw(st.sampled_from(["valid", "valid", "mutate", "truncate", "noise"]))
    if how == "mutate":
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    elif how == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif how == "noise":
        data = bytearray(draw(st.binary(max_size=64)))
    return bytes(data)
