"""Every PP1 wire message as a strict msgspec Struct (``docs/protocol.md`` §4): a msgpack
array of its tag, then its fields in declared order (base fields first); a schema or
cross-field violation is ``HEADER_INVALID``."""

from __future__ import annotations

import operator
from enum import IntEnum
from typing import Annotated, Final, get_args

import msgspec
from msgspec import Meta

from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q.rng import Role

#: The protocol's version (§11): the preamble's byte, HELLO's and the §5 labels'.
WIRE_VERSION: Final = 2
#: The prefix of every HMAC label (§5, §5.1): ``pp1w-v2``.
LABEL_PREFIX: Final = f"pp1w-v{WIRE_VERSION}"
VERIFIER_ID: Final = "pp1-standard-verifier-v1"
PRECISION: Final = "fp32-dyadic24"
#: HELLO's ``row_format`` (§4.1, §4.5): a REPLY's token is a ``bin`` of TOKEN_WIDTH bytes.
ROW_FORMAT: Final = "pp1-fixed-rows-v1"
#: The width of a REPLY's ``token`` on the wire: a little-endian uint32.
TOKEN_WIDTH: Final = 4
#: The largest token ID any message carries (a global int32 token ID).
TOKEN_MAX: Final = 0x7FFFFFFF

U8 = Annotated[int, Meta(ge=0, le=0xFF)]
U16 = Annotated[int, Meta(ge=0, le=0xFFFF)]
U32 = Annotated[int, Meta(ge=0, le=0xFFFFFFFF)]
# msgpack integers cannot exceed 2**64 - 1, so the upper bound is implicit.
U64 = Annotated[int, Meta(ge=0, extra_json_schema={"maximum": 2**64 - 1})]
Token = Annotated[int, Meta(ge=0, le=TOKEN_MAX)]
Depth = Annotated[int, Meta(ge=0, le=0xFF)]
Name = Annotated[str, Meta(max_length=128)]
Nonce = Annotated[bytes, Meta(min_length=16, max_length=64)]
Proof = Annotated[bytes, Meta(min_length=32, max_length=32)]
#: The length of a sharded link's group nonce (HELLO ``group``, §4.1 and §6.7).
GROUP_NONCE_SIZE: Final = 16
GroupNonce = Annotated[bytes, Meta(max_length=GROUP_NONCE_SIZE)]
#: The length of the lineage token a worker issues (HELLO ``lineage``, §4.1 and §4.4).
LINEAGE_SIZE: Final = 16
Lineage = Annotated[bytes, Meta(max_length=LINEAGE_SIZE)]


def _invalid(detail: str) -> ProtocolError:
    return ProtocolError(ErrorCode.HEADER_INVALID, detail)


class FixedToken(int):
    """A REPLY's token: an ``int`` here, a little-endian uint32 ``bin`` on the wire (§4.5),
    so that a row's frame length never depends on its draw (``docs/adaptive.md`` §7)."""

    __slots__ = ()


def _reply_hook(obj: object) -> object:
    """REPLY's encoder: its token as 4 bytes (up to 2**32 - 1, so a test can send one
    the receiver must refuse)."""
    if type(obj) is FixedToken:
        try:
            return int(obj).to_bytes(TOKEN_WIDTH, "little")
        except OverflowError:
            raise _invalid(f"token {int(obj)} does not fit {TOKEN_WIDTH} bytes") from None
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _plain_hook(obj: object) -> object:
    """Every other message's encoder: a REPLY's token sent on is a shortest-form integer."""
    if type(obj) is FixedToken:
        return int(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: object) -> object:
    """A REPLY token from its wire form (a ``ValueError`` becomes ``HEADER_INVALID``)."""
    if kind is not FixedToken:
        raise NotImplementedError(f"cannot decode {kind.__name__}")
    if type(obj) is not bytes or len(obj) != TOKEN_WIDTH:
        raise ValueError(f"a REPLY token is a bin of exactly {TOKEN_WIDTH} bytes")
    value = int.from_bytes(obj, "little")
    if value > TOKEN_MAX:
        raise ValueError(f"token {value} above {TOKEN_MAX}")
    return FixedToken(value)


#: A REPLY's ``token``: in JSON Schema, a base64 string of 4 bytes.
WireToken = Annotated[
    FixedToken,
    Meta(
        extra_json_schema={
            "type": "string",
            "contentEncoding": "base64",
            "minLength": 8,
            "maxLength": 8,
            "description": f"{TOKEN_WIDTH} bytes: the token as a little-endian uint32, "
            f"at most {TOKEN_MAX}",
        }
    ),
]


class MsgType(IntEnum):
    """Frame type codes; each equals the tag of its Struct."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    OPEN = 4
    OPENED = 5
    CLOSE = 6
    CLOSED = 7
    STEP = 8
    REPLY = 9
    COMPLETION = 10
    COMMIT = 11
    COMMITTED = 12
    RESET = 13
    RESET_DONE = 14
    ERROR = 15
    PING = 16
    PONG = 17


class Representation(IntEnum):
    """How a REPLY row carries q."""

    DENSE = 0
    SPARSE = 1


class Scope(IntEnum):
    """What an ERROR leaves dead."""

    MESSAGE = 0
    SLOT = 1
    CONNECTION = 2


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Common base: frozen, strict, positional msgpack arrays."""


class _SlotMsg(_Msg, frozen=True):
    """The leading fields of every slot message: its session and slot."""

    session: U64
    slot: U16


class _GenMsg(_SlotMsg, frozen=True):
    """A slot message of one generation."""

    generation: U32


class _RoundMsg(_GenMsg, frozen=True):
    """A slot message of one round of a generation."""

    round: U32


def _check_range(start: int | None, end: int | None) -> None:
    """Raise ``HEADER_INVALID`` unless a shard range is absent, or present with start ≤ end."""
    if (start is None) != (end is None):
        raise _invalid("a shard range needs both start and end")
    if start is not None and end is not None and start > end:
        raise _invalid("shard range start above end")


class Hello(_Msg, frozen=True, tag=int(MsgType.HELLO)):
    """Capabilities and limits; sent by the Spark side first, answered by the worker.

    The worker's answer echoes the accepted limits and the ``group`` nonce, and
    assigns ``session``.
    """

    role: U8
    wire_version: U16
    q_semantic: Name
    verifier: Name
    rng_abi: Name
    precision: Name
    vocab_size: Annotated[int, Meta(ge=1, le=0x7FFFFFFF)]
    vocab_hash: U64
    draft_identity: Name
    draft_native: bool
    target_identity: Name
    max_slots: Annotated[int, Meta(ge=1, le=0xFFFF)]
    max_depth: Annotated[int, Meta(ge=1, le=5)]
    max_support: U32
    row_entries: U32
    max_frame: U32
    max_prefix: U32
    nonce: Nonce
    integrity: Name
    shards: Annotated[int, Meta(ge=1, le=0xFFFF)]
    shard: U16
    shard_start: Token
    shard_end: Token
    layout: U64
    session: U64 = 0
    stop_rules: Name = ""  # the STEPs' stop-rule set (docs/adaptive.md); "": fixed only
    group: GroupNonce = b""  # a sharded link's group nonce (§6.7)
    row_format: Name = ""  # ROW_FORMAT; "" from a peer before it, which is refused
    key_id: Name = ""  # the Spark side's key in the worker's table (§5); echoed
    lineage: Lineage = b""  # the draw-budget lineage token (§4.4), presented or issued

    def __post_init__(self) -> None:
        """Cross-field rules (protocol §4.1).

        Raises:
            ProtocolError: ``HEADER_INVALID`` if ``row_entries < vocab_size``,
                ``max_support > vocab_size``, the role is unknown, ``shard ≥
                shards`` or ``shard_start > shard_end``.
        """
        if self.role not in (Role.WORKER, Role.SPARK):
            raise _invalid("unknown role")
        if self.row_entries < self.vocab_size:
            raise _invalid("row_entries below vocab_size")
        if self.max_support > self.vocab_size:
            raise _invalid("max_support above vocab_size")
        if self.shard >= self.shards:
            raise _invalid("shard index not below shards")
        _check_range(self.shard_start, self.shard_end)


class Challenge(_Msg, frozen=True, tag=int(MsgType.CHALLENGE)):
    """Worker → Spark when a pre-shared key is configured (protocol §5)."""

    nonce: Nonce
    proof: Proof


class Auth(_Msg, frozen=True, tag=int(MsgType.AUTH)):
    """Spark → worker: proof of the pre-shared key (protocol §5)."""

    proof: Proof


class Open(_GenMsg, frozen=True, tag=int(MsgType.OPEN)):
    """Open a session slot with its committed prefix (int32 payload) and request seed."""

    seed: U64
    context: U64
    eos: Token | None
    prefix_len: U32
    digest: U64


class Opened(_GenMsg, frozen=True, tag=int(MsgType.OPENED)):
    """The worker's acknowledgement of OPEN."""

    position: U32
    digest: U64


class Close(_SlotMsg, frozen=True, tag=int(MsgType.CLOSE)):
    """Close a slot; all its state is dropped."""


class Closed(_SlotMsg, frozen=True, tag=int(MsgType.CLOSED)):
    """The worker's acknowledgement of CLOSE."""


class Step(_RoundMsg, frozen=True, tag=int(MsgType.STEP)):
    """Ask for one proposal block of at most ``depth`` rows (protocol §4.4).

    ``stop`` and ``threshold`` are the block's stop rule (``docs/adaptive.md``:
    0 fixed, 1 confidence, 2 joint; T in 0..2**24); a STEP that omits them asks
    for the fixed rule (0, 0). Their ranges are the worker's check
    (``BAD_STOP_RULE``), not the schema's.
    """

    position: U32
    digest: U64
    depth: Depth
    temperature: float
    support: U32
    context: U64
    stop: U8 = 0
    threshold: U32 = 0


class Reply(_RoundMsg, frozen=True, tag=int(MsgType.REPLY), omit_defaults=True):
    """One proposal position; q travels in the frame payload (protocol §4.5).

    ``token`` travels at a fixed width, a msgpack bin of 4 bytes holding it as a
    little-endian uint32 (§4.5), and reads as an int. ``start`` and ``end`` (the
    row's global ID range) are present only on a link of a vocabulary-sharded
    group (§6.7); an unsharded link omits them.
    """

    index: U8
    position: U32
    token: WireToken
    representation: U8
    entries: U32
    checksum: U64
    start: Token | None = None
    end: Token | None = None

    def __post_init__(self) -> None:
        """Cross-field rule (§4.5); a plain ``int`` token becomes a :class:`FixedToken`.

        Raises:
            ProtocolError: ``HEADER_INVALID`` for a bad shard range or a token above 2**32 - 1.
        """
        if type(self.token) is not FixedToken:
            token = operator.index(self.token)
            if not 0 <= token <= 0xFFFFFFFF:
                raise _invalid(f"token {token} does not fit {TOKEN_WIDTH} bytes")
            msgspec.structs.force_setattr(self, "token", FixedToken(token))
        _check_range(self.start, self.end)


class Completion(_RoundMsg, frozen=True, tag=int(MsgType.COMPLETION), omit_defaults=True):
    """Ends a reply: exact byte count and checksum of its REPLY frames, and a status."""

    position: U32
    context: U64
    rows: U8
    reply_bytes: U64
    reply_checksum: U64
    status: U16
    start: Token | None = None
    end: Token | None = None
    stopped: bool = False  # the stop rule ended the block before its depth

    def __post_init__(self) -> None:
        """Cross-field rule (protocol §4.6).

        Raises:
            ProtocolError: ``HEADER_INVALID`` as for :class:`Reply`.
        """
        _check_range(self.start, self.end)


class Commit(_RoundMsg, frozen=True, tag=int(MsgType.COMMIT)):
    """What the verifier committed for a round (protocol §4.7)."""

    accepted: U8
    extra: Token | None
    position: U32
    digest: U64


class Committed(_RoundMsg, frozen=True, tag=int(MsgType.COMMITTED)):
    """The worker's acknowledgement of COMMIT, with its new prefix state."""

    position: U32
    digest: U64


class Reset(_GenMsg, frozen=True, tag=int(MsgType.RESET)):
    """Invalidate a slot's generation and all its speculative state."""


class ResetDone(_GenMsg, frozen=True, tag=int(MsgType.RESET_DONE)):
    """The worker's acknowledgement of RESET."""

    position: U32
    digest: U64


class Error(_Msg, frozen=True, tag=int(MsgType.ERROR)):
    """A refusal: which code, which message it answers, and what is now dead."""

    code: U16
    answers: U8
    scope: U8
    slot: U16 | None = None
    generation: U32 | None = None
    round: U32 | None = None


class Ping(_Msg, frozen=True, tag=int(MsgType.PING)):
    """Liveness probe; answered by PONG with the same nonce."""

    nonce: U64


class Pong(_Msg, frozen=True, tag=int(MsgType.PONG)):
    """Answer to PING."""

    nonce: U64


Message = (
    Hello
    | Challenge
    | Auth
    | Open
    | Opened
    | Close
    | Closed
    | Step
    | Reply
    | Completion
    | Commit
    | Committed
    | Reset
    | ResetDone
    | Error
    | Ping
    | Pong
)

MESSAGE_TYPES: Final[dict[MsgType, type[_Msg]]] = {
    MsgType(cls.__struct_config__.tag): cls for cls in get_args(Message)
}

#: Message types that carry a payload; every other type must have payload length 0.
PAYLOAD_TYPES: Final = frozenset({MsgType.OPEN, MsgType.REPLY})

ENCODER: Final = msgspec.msgpack.Encoder(enc_hook=_plain_hook)
#: REPLY's own encoder: the only message whose token travels at a fixed width.
REPLY_ENCODER: Final = msgspec.msgpack.Encoder(enc_hook=_reply_hook)
DECODER: Final = msgspec.msgpack.Decoder(Message, dec_hook=_dec_hook)


_TYPE_OF: Final[dict[type, MsgType]] = {cls: kind for kind, cls in MESSAGE_TYPES.items()}
#: Frame type code (0..255) to MsgType, None for unknown codes; avoids Enum lookups per frame.
TYPE_BY_CODE: Final[tuple[MsgType | None, ...]] = tuple(
    MsgType(i) if i in MsgType._value2member_map_ else None for i in range(256)
)


def type_of(msg: Message) -> MsgType:
    """The frame type code of a message."""
    return _TYPE_OF[type(msg)]


def encode(msg: Message) -> bytes:
    """msgpack bytes of a message header."""
    return (REPLY_ENCODER if type(msg) is Reply else ENCODER).encode(msg)


def decode(data: bytes | memoryview, expected: MsgType) -> Message:
    """Decode a header and check its tag against the frame's type code.

    Raises:
        ProtocolError: ``HEADER_INVALID`` for malformed msgpack, a schema or
            cross-field violation, or a tag that differs from ``expected``.
    """
    try:
        msg = DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _invalid(str(exc)) from None
    if type_of(msg) != expected:
        raise _invalid("header tag differs from the frame type")
    return msg
