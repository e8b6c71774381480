"""What both roles share in the handshake (``docs/protocol.md`` §4.1 and §5).

The common configuration fields, the HELLO each side builds from them, the
exact-match compatibility rules, and the HMAC proofs of the pre-shared key.
Each protocol core adds only its own side's rules (limits, identity pinning).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Final

from pp1wire.errors import ErrorCode
from pp1wire.q import dyadic
from pp1wire.q.layout import ShardLayout
from pp1wire.q.rng import ABI_NAME, Role
from pp1wire.wire import framing, integrity
from pp1wire.wire.messages import PRECISION, VERIFIER_ID, WIRE_VERSION, Hello

#: The limits a worker's HELLO echoes from the Spark side's (§4.1): never a silent downgrade.
ECHOED_LIMITS: Final = (
    "max_slots",
    "max_depth",
    "max_support",
    "row_entries",
    "max_frame",
    "max_prefix",
)

AUTH_WORKER_LABEL: Final = b"pp1w-v4 worker proof"
AUTH_SPARK_LABEL: Final = b"pp1w-v4 spark proof"


@dataclass(frozen=True)
class PeerConfig:
    """Settings both roles declare in HELLO, and their shared limits.

    ``layout`` and ``shard`` make this end one link of a vocabulary-sharded
    group (§6.7): it carries only q over ``layout.range(shard)``. Without a
    layout the link is unsharded (one shard: the whole vocabulary).
    """

    vocab_size: int
    vocab_hash: int = 0
    target_identity: str = "pp1-toy-target"
    max_slots: int = 4
    max_depth: int = 5
    max_support: int = 256
    row_entries: int | None = None
    max_frame: int = framing.HARD_MAX_PAYLOAD
    max_prefix: int = 1 << 20
    psk: bytes | None = None
    handshake_timeout: float = 5.0
    layout: ShardLayout | None = None
    shard: int = 0

    def __post_init__(self) -> None:
        """Refuse a shard that the layout does not have.

        Raises:
            ValueError: if the layout's vocabulary is not ``vocab_size``, or
                ``shard`` is not one of its ranks (or not 0 without a layout).
        """
        self.shard_layout.range(self.shard)
        if self.shard_layout.vocab_size != self.vocab_size:
            raise ValueError("the shard layout does not split this vocabulary")

    @cached_property
    def shard_layout(self) -> ShardLayout:
        """The link's layout: the configured one, or one shard of the whole vocabulary."""
        return self.layout if self.layout is not None else ShardLayout((0, self.vocab_size))

    @cached_property
    def sharded(self) -> bool:
        """Whether this link carries one shard of a split vocabulary (more than one shard)."""
        return self.shard_layout.shards > 1

    @cached_property
    def shard_range(self) -> tuple[int, int]:
        """``(start, end)``: the global IDs whose q this link carries."""
        return self.shard_layout.range(self.shard)

    @property
    def entries(self) -> int:
        """Dense row length in FP32 entries (vocabulary plus zero padding)."""
        return self.vocab_size if self.row_entries is None else self.row_entries

    @property
    def integrity(self) -> str:
        """The frame-integrity scheme this side requires: §5.1's with a key, none without."""
        return integrity.SCHEME if self.psk is not None else ""


def worker_proof(psk: bytes, spark_nonce: bytes, worker_nonce: bytes) -> bytes:
    """HMAC-SHA256 proof that the worker knows the pre-shared key (protocol §5)."""
    return hmac.new(psk, AUTH_WORKER_LABEL + spark_nonce + worker_nonce, hashlib.sha256).digest()


def spark_proof(psk: bytes, worker_nonce: bytes, spark_nonce: bytes, hello_header: bytes) -> bytes:
    """HMAC-SHA256 proof that the Spark side knows the key, bound to its HELLO header."""
    msg = AUTH_SPARK_LABEL + worker_nonce + spark_nonce + hashlib.sha256(hello_header).digest()
    return hmac.new(psk, msg, hashlib.sha256).digest()


def build_hello(
    role: Role,
    cfg: PeerConfig,
    *,
    draft_identity: str,
    draft_native: bool,
    limits: Hello | None,
    nonce: bytes,
    session: int = 0,
) -> Hello:
    """A HELLO for ``role``: its own identities, and the limits (the peer's, when echoing)."""
    src = limits
    return Hello(
        role=int(role),
        wire_version=WIRE_VERSION,
        q_semantic=dyadic.SEMANTIC_ID,
        verifier=VERIFIER_ID,
        rng_abi=ABI_NAME,
        precision=PRECISION,
        vocab_size=cfg.vocab_size,
        vocab_hash=cfg.vocab_hash,
        draft_identity=draft_identity,
        draft_native=draft_native,
        target_identity=cfg.target_identity,
        max_slots=src.max_slots if src else cfg.max_slots,
        max_depth=src.max_depth if src else cfg.max_depth,
        max_support=src.max_support if src else min(cfg.max_support, cfg.vocab_size),
        row_entries=src.row_entries if src else cfg.entries,
        max_frame=src.max_frame if src else cfg.max_frame,
        max_prefix=src.max_prefix if src else cfg.max_prefix,
        nonce=nonce,
        integrity=cfg.integrity,
        shards=cfg.shard_layout.shards,
        shard=cfg.shard,
        shard_start=cfg.shard_range[0],
        shard_end=cfg.shard_range[1],
        layout=cfg.shard_layout.digest,
        session=session,
    )


def _shard_fields(x: Hello | PeerConfig) -> tuple[int, int, int, int, int]:
    if isinstance(x, Hello):
        return (x.shards, x.shard, x.shard_start, x.shard_end, x.layout)
    layout = x.shard_layout
    return (layout.shards, x.shard, *x.shard_range, layout.digest)


def first_failure(
    peer: Hello, expected_role: Role, cfg: PeerConfig, extra: list[tuple[bool, ErrorCode]]
) -> ErrorCode | None:
    """The first broken rule of §4.1, in the table's order, then ``extra`` (a side's own)."""
    rules: list[tuple[Callable[[], bool], ErrorCode]] = [
        (lambda: peer.role == expected_role, ErrorCode.UNEXPECTED_MESSAGE),
        (lambda: peer.wire_version == WIRE_VERSION, ErrorCode.WIRE_VERSION_MISMATCH),
        (lambda: peer.q_semantic == dyadic.SEMANTIC_ID, ErrorCode.Q_SEMANTIC_MISMATCH),
        (lambda: peer.verifier == VERIFIER_ID, ErrorCode.VERIFIER_MISMATCH),
        (lambda: peer.rng_abi == ABI_NAME, ErrorCode.RNG_ABI_MISMATCH),
        (lambda: peer.precision == PRECISION, ErrorCode.PRECISION_MISMATCH),
        (lambda: peer.vocab_size == cfg.vocab_size, ErrorCode.VOCAB_SIZE_MISMATCH),
        (lambda: peer.vocab_hash == cfg.vocab_hash, ErrorCode.VOCAB_HASH_MISMATCH),
        (lambda: peer.target_identity == cfg.target_identity, ErrorCode.IDENTITY_MISMATCH),
        (lambda: peer.integrity == cfg.integrity, ErrorCode.INTEGRITY_MISMATCH),
        (lambda: _shard_fields(peer) == _shard_fields(cfg), ErrorCode.SHARD_LAYOUT_MISMATCH),
    ]
    for ok, code in rules:
        if not ok():
            return code
    for passed, code in extra:
        if not passed:
            return code
    return None
