"""Every error code pp1wire can report, one :class:`ErrorCode` (its numbers are the wire's, never
reused: ``docs/protocol.md`` §9), and the exceptions that carry one in ``.code``."""

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
    STOP_RULES_MISMATCH = 39  # HELLO: the stop-rule sets differ (docs/adaptive.md)

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
    STOP_RULE_VIOLATED = 77  # a block stopped where its stop rule does not
    BAD_STOP_RULE = 78  # a STEP's rule unknown, out of range, or not negotiated

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
    GROUP_HEADER_INVALID = 104  # a TP attempt no rank 0 could have written (rank-local)
    GROUP_UNMATCHED = 105  # a sharded rank's STEP its group's other links did not send
    GROUP_IN_USE = 106  # a sharded link's group nonce is another live link's (fatal)
    # HELLO: a peer's REPLY rows not in this row format (§4.1); here, as 20..39 are taken.
    ROW_FORMAT_MISMATCH = 107

    # -- liveness and connection (110..127) ------------------------------------
    IDLE_TIMEOUT = 110
    REPLY_TIMEOUT = 111
    CONNECTION_LOST = 112
    SHUTTING_DOWN = 113
    CONNECTION_LIMIT = 114
    LATE_FRAME = 115
    DRAW_RATE_LIMITED = 116  # a fresh STEP beyond its draw budget (§4.4), nothing changed
    CANCELLED = 117  # local: this side closed or reset the slot itself
    ANSWER_TIMEOUT = 118  # an OPEN, CLOSE, COMMIT or RESET unanswered in time (§7, fatal)

    # -- local API state (120..126): never on the wire -------------------------
    NOT_READY = 120
    SLOT_BUSY = 121
    SLOT_DESYNCED = 122
    # Spark TP group (docs/tp.md): rank-local.
    GROUP_COPY_MISMATCH = 123
    GROUP_OUTCOME_MISMATCH = 124
    GROUP_FAILED = 125
    BAD_ARGUMENT = 126  # local misuse: nothing sent, nothing changed

    INTERNAL = 127


class Pp1Error(Exception):
    """Base class of every error pp1wire raises on purpose: ``code`` is its :class:`ErrorCode`,
    ``str(exc)`` an explanation for logs, never for the wire."""

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
    """The verifier refused a proposal (before any draw) or could not complete a round."""


class ProtocolError(Pp1Error):
    """A frame or message broke the wire protocol (``docs/protocol.md``)."""


class LocalStateError(Pp1Error):
    """A local call arrived in a state that cannot take it (``NOT_READY``, ``SLOT_BUSY``,
    ``SLOT_DESYNCED``: the slot must be reopened); nothing was sent."""


class UsageError(Pp1Error):
    """Local misuse: nothing was sent and nothing changed; ``code`` says what was wrong
    (``BAD_ARGUMENT`` unless a more specific code fits, such as ``SLOT_BUSY``)."""

    def __init__(self, code: ErrorCode = ErrorCode.BAD_ARGUMENT, detail: str = "") -> None:
        """A misuse with ``code`` and a human ``detail``."""
        super().__init__(code, detail)


class ProposalReleasedError(UsageError):
    """A released proposal's q was read: its rows viewed a buffer now recycled."""

    def __init__(self, detail: str = "") -> None:
        """The misuse, explained by ``detail``."""
        super().__init__(ErrorCode.BAD_ARGUMENT, detail)
