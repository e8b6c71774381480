"""What the frame and reply vectors share: their constants, HELLO and JSON forms."""

from __future__ import annotations

from typing import Any

import msgspec

from pp1wire.q.rng import Role
from pp1wire.testing.builders import VOCAB
from pp1wire.wire import messages
from pp1wire.wire.handshake import build_hello
from pp1wire.wire.messages import Hello, Message
from pp1wire.wire.spark_core import SparkConfig

NONCE = bytes(range(16))
#: The group nonce of the vectors' sharded links (§6.7).
GROUP = bytes(range(0xA0, 0xB0))

Vector = dict[str, Any]


def spark_config(draft_identity: str = "") -> SparkConfig:
    """A Spark side with the limits of the vectors' HELLO, pinning ``draft_identity``
    ("" accepts any drafter)."""
    return SparkConfig(
        vocab_size=VOCAB,
        max_support=4,
        max_frame=1 << 20,
        max_prefix=1024,
        draft_identity=draft_identity,
    )


def hello(role: int, session: int = 0, **overrides: Any) -> Hello:
    """The vectors' HELLO from ``role`` (any field overridden)."""
    hello = build_hello(
        Role(role),
        spark_config(),
        draft_identity="pp1-toy-drafter",
        draft_native=True,
        limits=None,
        nonce=NONCE,
        session=session,
    )
    return msgspec.structs.replace(hello, **overrides)


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
