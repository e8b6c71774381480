"""Error codes and exception types shared by every layer of pp1wire.

Every failure that pp1wire can report has exactly one code in :class:`ErrorCode`.
The wire protocol sends these numbers in ERROR messages (``docs/protocol.md``
section "Errors"), counters are labelled by their names, and each exception
carries its code in ``.code``. The numeric values are part of the protocol and
never change meaning; new codes get new numbers.

Internal exception text is for logs only; it never goes on the wire.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Every error class pp1wire distinguishes, grouped by layer."""

    # -- framing (1..19): the preamble and the msgspec header ------------------
    BAD_MAGIC = 1
    UNSUPPORTED_VERSION = 2
    UNKNOWN_MESSAGE_TYPE = 3
    FRAME_TOO_LARGE = 4
    BAD_FLAGS = 5
    HEADER_INVALID = 6
    PREAMBLE_CHECKSUM = 7
    PAYLOAD_LENGTH = 8
    TRUNCATED = 9
    ZERO_LENGTH_HEADER = 10

    # -- handshake (20..39) ----------------------------------------------------
    HANDSHAKE_REQUIRED = 20
    DUPLICATE_HELLO = 21
    WIRE_VERSION_MISMATCH = 22
    Q_SEMANTIC_MISMATCH = 23
    VERIFIER_MISMATCH = 24
    VOCAB_SIZE_MISMATCH = 25
    VOCAB_HASH_MISMATCH = 26
    RNG_ABI_MISMATCH = 27
    PRECISION_MISMATCH = 28
    IDENTITY_MISMATCH = 29
    LIMIT_EXCEEDED = 30
    AUTH_REQUIRED = 31
    AUTH_FAILED = 32
    HANDSHAKE_TIMEOUT = 33
    UNEXPECTED_MESSAGE = 34
    TLS_REQUIRED = 35
    INTEGRITY_MISMATCH = 36
    INTEGRITY_FAILED = 37
    SHARD_LAYOUT_MISMATCH = 38
    # HELLO: the stop-rule sets differ (docs/adaptive.md), never upgraded silently.
    STOP_RULES_MISMATCH = 39

    # -- sessions, fencing and replies (40..59) --------------------------------
    UNKNOWN_SLOT = 40
    SLOT_IN_USE = 41
    SLOT_LIMIT = 42
    STALE_GENERATION = 43
    FUTURE_GENERATION = 44
    ROUND_REUSED = 45
    WRONG_POSITION = 46
    PREFIX_DIGEST_MISMATCH = 47
    DEPTH_OUT_OF_RANGE = 48
    SUPPORT_OUT_OF_RANGE = 49
    BAD_TEMPERATURE = 50
    WRONG_SESSION = 51
    ROW_OUT_OF_ORDER = 52
    COMPLETION_EARLY = 53
    COMPLETION_DUPLICATE = 54
    STEP_UNCOMMITTED = 55
    REPLY_SIZE_MISMATCH = 56
    REPLY_CHECKSUM_MISMATCH = 57
    ROW_CHECKSUM_MISMATCH = 58
    COMMIT_INVALID = 59

    # -- q row validation (60..79) ---------------------------------------------
    ROW_LENGTH = 60
    NON_FINITE = 61
    NEGATIVE = 62
    NON_DYADIC = 63
    MASS_MISMATCH = 64
    ZERO_Q_AT_PROPOSED = 65
    PROPOSED_OUT_OF_RANGE = 66
    SPARSE_DUPLICATE_ID = 67
    SPARSE_UNSORTED = 68
    SPARSE_ID_OUT_OF_RANGE = 69
    SPARSE_ZERO_ENTRY = 70
    SUPPORT_TOO_LARGE = 71
    DENSE_PADDING_NONZERO = 72
    MISSING_Q = 73
    BAD_REPRESENTATION = 74
    TOKEN_OUT_OF_RANGE = 75
    SHARD_RANGE_MISMATCH = 76
    # A block that stopped where its stop rule does not (docs/adaptive.md).
    STOP_RULE_VIOLATED = 77
    # A STEP naming a stop rule the worker cannot apply: an unknown kind, a
    # threshold outside 0..2**24, or a rule the HELLO did not negotiate.
    BAD_STOP_RULE = 78

    # -- proposal construction and RNG on the sender (80..89) --------------------------
    WEIGHT_NON_FINITE = 80
    WEIGHT_NEGATIVE = 81
    ZERO_MASS = 82
    ALLOCATION_INCONSISTENT = 83
    BAD_SHAPE = 84
    BAD_DRAW = 85
    KEY_REUSED = 86
    RNG_FIELD_RANGE = 87

    # -- verification on the Spark side (90..109) ------------------------------
    TARGET_NON_FINITE = 90
    TARGET_NEGATIVE = 91
    TARGET_ZERO_MASS = 92
    EMPTY_RESIDUAL = 93
    STALE_PREFIX = 94
    WRONG_OWNER = 95
    SESSION_POISONED = 96
    MALFORMED_PROPOSAL = 97
    TARGET_FAILED = 98
    CONTEXT_MISMATCH = 99
    REQUEST_FINISHED = 100
    AUDIT_MISMATCH = 101
    # A vocabulary-sharded round across the links of a group (protocol §6.7).
    GROUP_SHARD_MISMATCH = 102
    GROUP_MASS_MISMATCH = 103
    # A Spark TP group's attempt header or row table that no rank 0 could have
    # written (docs/tp.md): rank-local, never on the wire.
    GROUP_HEADER_INVALID = 104
    # A sharded worker rank's STEP that the group's other links did not send within
    # the match timeout (protocol §6.7): a COMPLETION status.
    GROUP_UNMATCHED = 105
    # A sharded link whose group nonce another live link of the worker rank serves
    # (§6.7): fatal at the handshake.
    GROUP_IN_USE = 106
    # HELLO: the peer's REPLY rows are not in this side's row format (protocol §4.1,
    # §4.5): a peer before the fixed-width token. Numbered here because the
    # handshake codes (20..39) are all taken.
    ROW_FORMAT_MISMATCH = 107

    # -- liveness and connection (110..127) ------------------------------------
    IDLE_TIMEOUT = 110
    REPLY_TIMEOUT = 111
    CONNECTION_LOST = 112
    SHUTTING_DOWN = 113
    CONNECTION_LIMIT = 114
    LATE_FRAME = 115
    # A fresh STEP beyond the connection's draw budget (--max-draw-rate): refused,
    # nothing changed; a later round may ask again (protocol §4.4).
    DRAW_RATE_LIMITED = 116
    # Local, never on the wire: what was pending on a slot ended because this
    # side closed or reset the slot (or the client) itself.
    CANCELLED = 117
    # An OPEN, CLOSE, COMMIT or RESET the worker did not answer within the reply
    # timeout: the Spark side ends the connection (fatal; protocol §7).
    ANSWER_TIMEOUT = 118

    # -- local API state (120..126): never on the wire -------------------------
    NOT_READY = 120
    SLOT_BUSY = 121
    SLOT_DESYNCED = 122
    # Spark tensor-parallel group (docs/tp.md): rank-local, never on the wire.
    GROUP_COPY_MISMATCH = 123
    GROUP_OUTCOME_MISMATCH = 124
    GROUP_FAILED = 125
    # The caller passed what the API cannot take (a score count that does not
    # match the proposal, …): local misuse, nothing sent and nothing changed.
    BAD_ARGUMENT = 126

    INTERNAL = 127


class Pp1Error(Exception):
    """Base class of every error pp1wire raises on purpose.

    ``code`` is the :class:`ErrorCode`; ``str(exc)`` is a human explanation
    meant for logs, not for the wire.
    """

    code: ErrorCode

    def __init__(self, code: ErrorCode, detail: str = "") -> None:
        self.code = ErrorCode(code)
        self.detail = detail
        super().__init__(f"{self.code.name}: {detail}" if detail else self.code.name)


class ConstructionError(Pp1Error, ValueError):
    """A proposal distribution could not be built from the given weights or logits."""


class ValidationError(Pp1Error, ValueError):
    """A received q row (or draw input) broke the dyadic24 contract."""


class RngError(Pp1Error, ValueError):
    """An RNG key or counter field was outside its documented range."""


class VerifyError(Pp1Error):
    """The verifier refused a proposal or could not complete a round.

    Raised before any random draw is consumed when the proposal itself is at
    fault; see :mod:`pp1wire.q.verify` for which failures poison the session.
    """


class ProtocolError(Pp1Error):
    """A frame or message broke the wire protocol (``docs/protocol.md``)."""


class LocalStateError(Pp1Error):
    """A local call arrived in a state that cannot take it; nothing was sent.

    ``code`` is one of the local-only codes: ``NOT_READY`` (the connection has
    not finished its handshake, or is closed), ``SLOT_BUSY`` (a proposal is
    already in flight on the slot) or ``SLOT_DESYNCED`` (the worker refused a
    slot-level request; the slot must be closed and reopened).
    """


class UsageError(Pp1Error):
    """Local misuse: the call cannot be taken with these arguments in this state.

    Nothing was sent and nothing changed; the fix is in the calling code.
    ``code`` says what was wrong (``BAD_ARGUMENT`` unless a more specific code
    fits: ``UNKNOWN_SLOT``, ``SLOT_BUSY``, ``SLOT_IN_USE``, ``ROUND_REUSED``,
    ``COMMIT_INVALID``, ``DEPTH_OUT_OF_RANGE``, …).
    """

    def __init__(self, code: ErrorCode = ErrorCode.BAD_ARGUMENT, detail: str = "") -> None:
        """A misuse with ``code`` and a human ``detail``."""
        super().__init__(code, detail)


class ProposalReleasedError(UsageError):
    """A released proposal's q was read: its rows viewed a buffer now recycled."""

    def __init__(self, detail: str = "") -> None:
        """The misuse, explained by ``detail``."""
        super().__init__(ErrorCode.BAD_ARGUMENT, detail)
