"""What both roles share in the handshake (``docs/protocol.md`` §4.1, §5): the common
configuration, the HELLO each side builds from it, the HELLO rules in check order, and the
HMAC proofs of the pre-shared key; each core adds only its own side's rules."""

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
from pp1wire.q.stoprules import STOP_RULES
from pp1wire.wire import framing, integrity
from pp1wire.wire.messages import (
    GROUP_NONCE_SIZE,
    LABEL_PREFIX,
    LINEAGE_SIZE,
    PRECISION,
    ROW_FORMAT,
    VERIFIER_ID,
    WIRE_VERSION,
    Hello,
)

#: The limits a worker's HELLO echoes from the Spark side's (§4.1): never a silent downgrade.
ECHOED_LIMITS: Final = (
    "max_slots",
    "max_depth",
    "max_support",
    "row_entries",
    "max_frame",
    "max_prefix",
)

AUTH_WORKER_LABEL: Final = f"{LABEL_PREFIX} worker proof".encode()
AUTH_SPARK_LABEL: Final = f"{LABEL_PREFIX} spark proof".encode()


@dataclass(frozen=True)
class PeerConfig:
    """Settings both roles declare in HELLO, and their shared limits.

    ``layout`` and ``shard`` make this end one link of a vocabulary-sharded group
    (§6.7), carrying only q over ``layout.range(shard)``. ``psk`` is this side's key
    under the ID ``key_id`` (§5); a worker also holds ``keys``, more ``(ID, key)`` pairs,
    and proves the one its peer names (:meth:`key`).
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
    stop_rules: str = ""  # asked for (Spark side) or implemented (worker); "": fixed only
    group: bytes = b""  # a sharded Spark link's group nonce (§6.7)
    key_id: str = ""
    keys: tuple[tuple[str, bytes], ...] = ()  # a worker's keys: each ID a principal (§2)
    lineage: bytes = b""  # a keyless Spark side's lineage token (§4.4), presented in HELLO

    def __post_init__(self) -> None:
        """Check the configuration.

        Raises:
            ValueError: for a layout of another vocabulary or without ``shard``, an unknown
                stop-rule set, a group nonce not of 16 bytes on a sharded link, a key ID
                too long, repeated or without ``psk``, an empty key, a lineage token too long.
        """
        ids = [i for i, _ in self.keys] + ([self.key_id] if self.psk is not None else [])
        if self.key_id and self.psk is None:
            raise ValueError("a key ID names a key: give psk with it")
        if len(set(ids)) != len(ids) or any(len(i) > 128 for i in ids):
            raise ValueError("key IDs must be distinct and at most 128 characters")
        if self.psk == b"" or any(not key for _, key in self.keys):
            raise ValueError("a pre-shared key must not be empty")
        if len(self.lineage) > LINEAGE_SIZE:
            raise ValueError(f"a lineage token is at most {LINEAGE_SIZE} bytes")
        self.shard_layout.range(self.shard)
        if self.shard_layout.vocab_size != self.vocab_size:
            raise ValueError("the shard layout does not split this vocabulary")
        if self.group and (len(self.group) != GROUP_NONCE_SIZE or not self.sharded):
            raise ValueError(f"a group nonce is {GROUP_NONCE_SIZE} bytes, on a sharded link only")
        if self.stop_rules not in ("", STOP_RULES):
            raise ValueError(f"unknown stop-rule set {self.stop_rules!r} (known: {STOP_RULES})")

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

    @cached_property
    def key_table(self) -> dict[str, bytes]:
        """Every key this side holds, by ID (``psk`` under ``key_id``, and ``keys``)."""
        table = dict(self.keys)
        if self.psk is not None:
            table[self.key_id] = self.psk
        return table

    @property
    def keyed(self) -> bool:
        """Whether this side holds a key: it authenticates every peer (§5)."""
        return bool(self.key_table)

    def key(self, key_id: str) -> bytes | None:
        """The key a peer that names ``key_id`` must prove (None: this side has none)."""
        return self.key_table.get(key_id)

    @property
    def integrity(self) -> str:
        """The frame-integrity scheme this side requires: §5.1's with a key, none without."""
        return integrity.SCHEME if self.keyed else ""


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
    lineage: bytes | None = None,
) -> Hello:
    """A HELLO for ``role``: its identities, the limits, group nonce and key ID (``limits``':
    the peer's, when echoing), and ``lineage`` (default: the configuration's)."""
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
        stop_rules=src.stop_rules if src else cfg.stop_rules,
        group=src.group if src else cfg.group,
        row_format=ROW_FORMAT,
        key_id=src.key_id if src else cfg.key_id,
        lineage=cfg.lineage if lineage is None else lineage,
    )


def _shard_fields(x: Hello | PeerConfig) -> tuple[int, int, int, int, int]:
    if isinstance(x, Hello):
        return (x.shards, x.shard, x.shard_start, x.shard_end, x.layout)
    layout = x.shard_layout
    return (layout.shards, x.shard, *x.shard_range, layout.digest)


SharedCheck = Callable[[Hello, PeerConfig, Role], bool]


def _group_nonce_ok(peer: Hello, cfg: PeerConfig, role: Role) -> bool:
    """§4.1's ``group`` row: empty unsharded; sharded, 16 bytes, or from a worker ours echoed."""
    if not cfg.sharded:
        return peer.group == b""
    if role is Role.WORKER:
        return peer.group == cfg.group
    return len(peer.group) == GROUP_NONCE_SIZE


@dataclass(frozen=True)
class HelloRule:
    """One row of §4.1's HELLO table: ``shared`` is the check both roles make alike; a row
    with a ``code`` but no ``shared`` is each role's own (:func:`first_failure`'s ``own``)."""

    fields: tuple[str, ...]
    meaning: str
    rule: str
    code: ErrorCode | None = None
    shared: SharedCheck | None = None

    @property
    def checked(self) -> bool:
        """Whether a HELLO can fail this row."""
        return self.code is not None


def _constant(name: str, meaning: str, value: object) -> HelloRule:
    """A row whose field must be this document's ``value``."""
    code = ErrorCode[f"{name.upper()}_MISMATCH"]
    return HelloRule((name,), meaning, "exact", code, lambda p, _c, _r: getattr(p, name) == value)


def _same(name: str, meaning: str, rule: str = "exact", code: ErrorCode | None = None) -> HelloRule:
    """A row whose field must equal this side's configuration's."""
    code = code or ErrorCode[f"{name.upper()}_MISMATCH"]
    return HelloRule(
        (name,), meaning, rule, code, lambda p, c, _r: getattr(p, name) == getattr(c, name)
    )


#: §4.1's HELLO rules in check order (the first failure wins): the document prints its
#: table from them (:func:`rules_markdown`), and both cores check in this order.
HELLO_RULES: Final[tuple[HelloRule, ...]] = (
    HelloRule(
        ("role",),
        "1: the worker's HELLO, 2: the Spark side's",
        "the peer's role (a worker takes 2, a Spark side 1)",
        ErrorCode.UNEXPECTED_MESSAGE,
        lambda peer, _cfg, role: peer.role == role,
    ),
    _constant("wire_version", f"this document: {WIRE_VERSION}", WIRE_VERSION),
    _constant("q_semantic", f"q semantics: `{dyadic.SEMANTIC_ID}` (§6.1)", dyadic.SEMANTIC_ID),
    _constant(
        "verifier", f"`{VERIFIER_ID}`: the standard tokenwise accept/resample test", VERIFIER_ID
    ),
    _constant("rng_abi", f"`{ABI_NAME}` (§6.3)", ABI_NAME),
    _constant("precision", f"`{PRECISION}`: q as FP32 multiples of 2⁻²⁴", PRECISION),
    _same("vocab_size", "global vocabulary size (129,280 for DeepSeek)"),
    _same("vocab_hash", "64-bit hash of the global token-ID map"),
    HelloRule(
        ("draft_identity",),
        'drafter checkpoint; the Spark side sends `""` to accept any, or pins one',
        "a pinned value (the Spark side's, when not `\"\"`) must equal the worker's",
        ErrorCode.IDENTITY_MISMATCH,
    ),
    HelloRule(
        ("draft_native",),
        "worker: true if the drafter is native to the target, false if adapted",
        "informational, not checked",
    ),
    _same("target_identity", "the target the drafter serves", code=ErrorCode.IDENTITY_MISMATCH),
    _same(
        "integrity",
        f"frame integrity after the handshake: `{integrity.SCHEME}` (§5.1) when the side is "
        'configured with a PSK, `""` without',
        "exact (each side compares the peer's value with its own)",
    ),
    HelloRule(
        ("max_slots", "max_depth", "max_support"),
        "most slots, largest depth (a STEP's maximum), sparse k the Spark side will use",
        "worker: each ≤ its own limit; Spark side: each equal to what it sent",
        ErrorCode.LIMIT_EXCEEDED,
    ),
    HelloRule(
        ("row_entries",),
        "dense row length in FP32 entries (vocabulary plus padding); a row is "
        "`4 × row_entries` bytes",  # noqa: RUF001 - the document's multiplication sign
        "worker: equal to its own; Spark side: equal to what it sent",
        ErrorCode.LIMIT_EXCEEDED,
    ),
    HelloRule(
        ("max_frame",),
        "largest payload either side will send",
        "worker: ≤ its own and ≥ `4 × row_entries`; Spark side: equal to what it sent",  # noqa: RUF001
        ErrorCode.LIMIT_EXCEEDED,
    ),
    HelloRule(
        ("max_prefix",),
        "longest OPEN prefix in tokens",
        "worker: ≤ its own; Spark side: equal to what it sent",
        ErrorCode.LIMIT_EXCEEDED,
    ),
    HelloRule(("nonce",), "fresh random bytes (authentication, §5)", "not checked"),
    HelloRule(
        ("shards", "shard", "shard_start", "shard_end", "layout"),
        "the link's place in a vocabulary split (§6.7): number of shards, this link's shard "
        "index, its global ID range `[shard_start, shard_end)`, and the layout digest; an "
        "unsharded link sends 1, 0, 0, `vocab_size` and the digest of the layout "
        "`(0, vocab_size)`",
        "all five exact (each side compares the peer's values with its own configuration)",
        ErrorCode.SHARD_LAYOUT_MISMATCH,
        lambda peer, cfg, _role: _shard_fields(peer) == _shard_fields(cfg),
    ),
    HelloRule(
        ("stop_rules",),
        f"the stop-rule set the Spark side's STEPs may name (§4.4): `{STOP_RULES}` "
        '(`docs/adaptive.md`), or `""` for fixed depth only; a sharded link (§6.7) '
        "negotiates them as an unsharded one does",
        'worker: `""` or the set it implements, by exact name; Spark side: equal to what it sent',
        ErrorCode.STOP_RULES_MISMATCH,
    ),
    HelloRule(
        ("group",),
        "a sharded link's group session (§6.7): 16 random bytes the Spark group draws once "
        "and sends on every one of its links; empty on an unsharded link; the worker echoes "
        "the Spark side's",
        "worker: 16 bytes on a sharded link, empty on an unsharded one; Spark side: equal to "
        "what it sent",
        ErrorCode.SHARD_LAYOUT_MISMATCH,
        _group_nonce_ok,
    ),
    _constant(
        "row_format",
        f"how REPLY rows are encoded (§4.5): `{ROW_FORMAT}`, a row's token as a 4-byte "
        'bin; `""` (omitted) from a peer before it',
        ROW_FORMAT,
    ),
    HelloRule(
        ("key_id",),
        "the pre-shared key the Spark side authenticates with (§5): its ID in the worker's "
        'key table, `""` for the default key; the worker echoes the Spark side\'s',
        "not checked here: a worker with keys proves and checks the key of that ID (§5), "
        "a worker without a key ignores it",
    ),
    HelloRule(
        ("lineage",),
        "a keyless Spark side's draw-budget lineage (§4.4): the token a worker issued it on "
        "an earlier connection, presented again (empty: none); the worker's HELLO carries the "
        "token of this connection's lineage (empty when it has keys)",
        "not checked: a token the worker does not know starts a new lineage (§4.4)",
    ),
    HelloRule(
        ("session",),
        "worker's HELLO only: the session ID of this connection",
        "not checked; the Spark side sends 0",
    ),
)

#: The codes of the rows each role checks with a rule of its own.
OWN_RULE_CODES: Final = frozenset(r.code for r in HELLO_RULES if r.checked and r.shared is None)


def first_failure(
    peer: Hello, expected_role: Role, cfg: PeerConfig, own: list[tuple[bool, ErrorCode]]
) -> ErrorCode | None:
    """The code of the first broken row of :data:`HELLO_RULES`: the shared rows checked
    here, and ``own``, this role's own results as ``(passed, code)``, each at the first
    row of its code that is a role's own (so a role cannot check them out of order).

    Raises:
        ValueError: if ``own`` names a code no row leaves to the roles.
    """
    failed: set[ErrorCode] = set()
    for passed, code in own:
        if code not in OWN_RULE_CODES:
            raise ValueError(f"{code.name} is not a code of a role's own HELLO rule")
        if not passed:
            failed.add(code)
    for rule in HELLO_RULES:
        if rule.code is None:
            continue
        if rule.shared is not None:
            if not rule.shared(peer, cfg, expected_role):
                return rule.code
        elif rule.code in failed:
            return rule.code
    return None


def rules_markdown() -> str:
    """§4.1's HELLO table, one row per rule in check order (the document prints this)."""
    lines = ["| # | field | meaning | rule |", "|---:|---|---|---|"]
    n = 0
    for rule in HELLO_RULES:
        fields = ", ".join(f"`{f}`" for f in rule.fields)
        if rule.code is None:
            lines.append(f"| — | {fields} | {rule.meaning} | {rule.rule} |")
            continue
        n += 1
        lines.append(f"| {n} | {fields} | {rule.meaning} | {rule.rule}, else `{rule.code.name}` |")
    return "\n".join(lines)
