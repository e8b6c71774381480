"""The Spark-side cases (``pp1-conformance --spark``), stimuli written for a vocabulary of 8;
the S1 cases run every class of :mod:`pp1wire.testing.conformance.reply_classes`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from pp1wire.errors import ErrorCode
from pp1wire.testing.builders import (
    completion,
    dense_payload,
    older_hello_frame,
    reply_row,
    reply_step,
    split_frames,
    uint_token_frame,
    whole_reply,
)
from pp1wire.testing.conformance.reply_classes import (
    GOOD,
    PSK,
    REPLY_CLASSES,
    Drafts,
    first_bad,
    ok_row,
    ok_token,
)
from pp1wire.testing.conformance.spark_side import (
    VOCAB,
    Build,
    Conn,
    Expect,
    ReplyHook,
    SparkCase,
    Timing,
)
from pp1wire.wire import framing
from pp1wire.wire.messages import Challenge, Error, Hello, Message, MsgType, Scope, Step

# -- hooks ----------------------------------------------------------------------------------


def send(build: Build) -> ReplyHook:
    """Answer the STEP with ``build(step)`` instead of the honest reply."""
    return lambda conn, st, _honest: conn.write(build(st))


def before(build: Build) -> ReplyHook:
    """Send ``build(step)`` and then the honest reply."""
    return lambda conn, st, honest: conn.write(build(st) + honest)


def after(build: Callable[[Step, bytes], bytes]) -> ReplyHook:
    """Send the honest reply and then ``build(step, honest)``."""
    return lambda conn, st, honest: conn.write(honest + build(st, honest))


def paced(chunk: int, seconds: Callable[[float], float]) -> ReplyHook:
    """Send the honest reply ``chunk`` bytes at a time, its last byte ``seconds(T)``
    after the STEP arrived, T being the Spark side's reply timeout."""
    return lambda conn, _st, honest: conn.pace(honest, chunk, seconds(conn.worker.reply_timeout))


def cut(keep: Callable[[bytes], int]) -> ReplyHook:
    """Send the first ``keep(honest)`` bytes of the honest reply, then abort the connection."""

    def hook(conn: Conn, _st: Step, honest: bytes) -> None:
        conn.write(honest[: keep(honest)])
        conn.abort()

    return hook


def stalls_after(rows: int, seconds: Callable[[float], float]) -> ReplyHook:
    """Send the honest reply's first ``rows`` frames at once and the rest ``seconds(T)``
    after the STEP arrived, T being the Spark side's reply timeout."""

    def hook(conn: Conn, _st: Step, honest: bytes) -> Awaitable[None]:
        frames = split_frames(honest)
        conn.write_now(b"".join(frames[:rows]))
        rest = b"".join(frames[rows:])
        return conn.pace(rest, len(rest), seconds(conn.worker.reply_timeout))

    return hook


def silence(conn: Conn, _st: Step, _honest: bytes) -> None:
    """Never answer the STEP."""


def _ruled(tokens: Drafts, stopped: bool | None = None) -> Build:
    """Rows of GOOD drafting ``tokens(step)``, then a COMPLETION whose ``stopped`` is
    ``stopped``, or by default whether the block is shorter than the depth.

    GOOD's counts at its tokens: 0 → 2**23 (q = 1/2), 2 and 7 → 2**22 (1/4).
    """

    def build(st: Step) -> bytes:
        drafted = tokens(st)
        flag = len(drafted) < st.depth if stopped is None else stopped
        rows = [reply_row(st, i, t, dense_payload(GOOD)) for i, t in enumerate(drafted)]
        return whole_reply(st, *rows, stopped=int(flag))

    return build


def kept_rows(build: Build, tokens: Drafts) -> ReplyHook:
    """Answer with ``build(step)``, a reply a fault cuts after the rows drafting
    ``tokens(step)``, and hold the worker core to those drafts (the COMMIT of
    the cut block's accepted drafts is then accepted)."""

    def hook(conn: Conn, st: Step, _honest: bytes) -> None:
        conn.write(build(st))
        conn.core.slots[st.slot].drafts = tuple(tokens(st))

    return hook


def used(tokens: Drafts) -> ReplyHook:
    """Answer with a legal block of ``tokens(step)`` (not the honest one) and hold the
    worker core to it, so the COMMIT of the block's drafts is accepted."""
    return kept_rows(_ruled(tokens), tokens)


def _ok_tokens(rows: int) -> Drafts:
    """The drafts of ``rows`` :func:`ok_row` rows."""
    return lambda st: [ok_token(st)] * rows


def _hello(**over: Any) -> Callable[[Any], Message]:
    def edit(msg: Any) -> Message:
        assert isinstance(msg, Hello)
        return msgspec.structs.replace(msg, **over)

    return edit


def _bad_proof(msg: Any) -> Message:
    assert isinstance(msg, Challenge)
    return msgspec.structs.replace(msg, proof=bytes(b ^ 0xFF for b in msg.proof))


def _step_error(code: ErrorCode) -> Build:
    def build(st: Step) -> bytes:
        err = Error(
            code=int(code),
            answers=int(MsgType.STEP),
            scope=int(Scope.SLOT),
            slot=st.slot,
            generation=st.generation,
            round=st.round,
        )
        return framing.encode_frame(err)

    return build


# -- the cases ------------------------------------------------------------------------------


def _cases() -> list[SparkCase]:
    out: list[SparkCase] = []
    for n, (name, support, build, code, kept) in enumerate(REPLY_CLASSES, 1):
        if not kept:
            title = f"reply class {name} discards the proposal"
            rule = "§4.5, §4.6, §6.2: a row or reply that breaks the contract before any valid row "
            rule += "is discarded whole"
            hook, expect = send(build), Expect.DISCARD
        else:
            title = f"reply class {name} cuts the block to the {kept} valid row(s) before it"
            rule = "§4.5, §4.6, docs/adaptive.md §7: a fault ends the block before its row; the "
            rule += "rows before it are verified"
            hook, expect = kept_rows(build, _ok_tokens(kept)), Expect.CUT
        out.append(
            SparkCase(
                f"S1.{n}", title, rule, expect, code, support=support, reply=hook, kept=kept or None
            )
        )
    out += [
        SparkCase(
            "S2.1",
            "a row of an earlier round, before the honest reply, is dropped",
            "§7: round older than the in-flight round: drop (ROUND_REUSED)",
            Expect.DROP,
            ErrorCode.ROUND_REUSED,
            reply=before(lambda st: ok_row(msgspec.structs.replace(st, round=st.round - 1), 0)),
            on_reply=1,
        ),
        SparkCase(
            "S2.2",
            "a row of another session is rejected",
            "§7: session differs: reject (WRONG_SESSION)",
            Expect.REJECT,
            ErrorCode.WRONG_SESSION,
            reply=before(lambda st: ok_row(msgspec.structs.replace(st, session=st.session + 1), 0)),
        ),
        SparkCase(
            "S2.3",
            "a row for a slot that is not open is dropped",
            "§7: slot not open: drop (UNKNOWN_SLOT)",
            Expect.DROP,
            ErrorCode.UNKNOWN_SLOT,
            reply=before(lambda st: ok_row(msgspec.structs.replace(st, slot=st.slot + 5), 0)),
        ),
        SparkCase(
            "S2.4",
            "a second COMPLETION of a used reply is dropped",
            "§7: in-flight proposal already completed: drop (COMPLETION_DUPLICATE)",
            Expect.DROP,
            ErrorCode.COMPLETION_DUPLICATE,
            reply=after(lambda _st, honest: split_frames(honest)[-1]),
        ),
        SparkCase(
            "S2.5",
            "the previous round's whole reply, replayed after this round's, is dropped",
            "§7: round older than the in-flight round: drop (ROUND_REUSED)",
            Expect.DROP,
            ErrorCode.ROUND_REUSED,
            reply=lambda conn, _st, honest: conn.write(honest + conn.honest[-2]),
            on_reply=1,
        ),
        SparkCase(
            "S2.6",
            "frames after a discard are dropped as late, never consumed",
            "§7: in-flight proposal already discarded: drop (LATE_FRAME)",
            Expect.DISCARD,
            ErrorCode.ROW_CHECKSUM_MISMATCH,
            reply=send(
                lambda st: first_bad(st, reply_row(st, 0, 0, dense_payload(GOOD), checksum=5))
            ),
            also_dropped=ErrorCode.LATE_FRAME,
        ),
        SparkCase(
            "S3.1",
            "the worker refuses the STEP with an ERROR: the round falls back",
            "§4.9, §6.5: an ERROR answering the in-flight STEP discards it",
            Expect.DISCARD,
            ErrorCode.DEPTH_OUT_OF_RANGE,
            reply=send(_step_error(ErrorCode.DEPTH_OUT_OF_RANGE)),
        ),
        SparkCase(
            "S3.2",
            "a COMPLETION with a failure status discards the proposal",
            "§4.6: status != 0: the proposal is discarded under that code",
            Expect.DISCARD,
            ErrorCode.ZERO_MASS,
            reply=send(lambda st: completion(st, b"", 0, status=int(ErrorCode.ZERO_MASS))),
        ),
        SparkCase(
            "S3.3",
            "no reply at all: the proposal times out at the reply timeout",
            "§6.5: a timed-out proposal is discarded whole",
            Expect.DISCARD,
            ErrorCode.REPLY_TIMEOUT,
            reply=silence,
        ),
        SparkCase(
            "S3.4",
            "a reply paced over 1.5 reply timeouts: the rows in by the timeout are the block",
            "§6.5, docs/adaptive.md §7: rows missing at the reply timeout end the block; "
            "the rows that arrived are verified",
            Expect.CUT,
            ErrorCode.REPLY_TIMEOUT,
            reply=paced(16, lambda timeout: 1.5 * timeout),
            timing=Timing.PAST,
        ),
        SparkCase(
            "S3.5",
            "an honest reply in 1-byte writes is used",
            "§2: frames are a byte stream; any segmentation is valid",
            Expect.USE,
            None,
            reply=paced(1, lambda _timeout: 0.0),  # one write per byte, no pacing
        ),
        SparkCase(
            "S3.6",
            "an honest reply in 7-byte writes over a quarter of the reply timeout is used",
            "§2: any segmentation and pacing within the reply timeout is valid",
            Expect.USE,
            None,
            reply=paced(7, lambda timeout: timeout / 4),
            timing=Timing.WITHIN,
        ),
        SparkCase(
            "S3.7",
            "connection closed after half a reply: the rows before the cut are the block",
            "§6.5, docs/adaptive.md §7: a lost connection ends the block; the rows that "
            "arrived are verified and committed once the slot is reopened",
            Expect.CUT,
            ErrorCode.CONNECTION_LOST,
            reply=cut(lambda honest: len(honest) // 2),
        ),
        SparkCase(
            "S3.8",
            "connection closed just before the COMPLETION: every row is the block",
            "§6.5, docs/adaptive.md §7: a lost connection ends the block after its rows",
            Expect.CUT,
            ErrorCode.CONNECTION_LOST,
            reply=cut(lambda honest: len(honest) - len(split_frames(honest)[-1])),
        ),
        SparkCase(
            "S3.9",
            "garbage bytes in place of a reply: fatal BAD_MAGIC, nothing used",
            "§3.1: a bad magic is fatal; the in-flight proposal is discarded",
            Expect.DISCARD,
            ErrorCode.BAD_MAGIC,
            reply=send(lambda _st: b"\x00" * 64),
        ),
        SparkCase(
            "S3.10",
            "a frame declaring more than max_frame bytes: fatal before allocation",
            "§3.1, §8: FRAME_TOO_LARGE; the in-flight proposal is discarded",
            Expect.DISCARD,
            ErrorCode.FRAME_TOO_LARGE,
            reply=send(lambda st: _too_large(ok_row(st, 0))),
        ),
        SparkCase(
            "S3.11",
            "row 0 at once, the rest 1.5 reply timeouts later: row 0 is the block",
            "§6.5, docs/adaptive.md §7: a slow row ends the block before it at the reply "
            "timeout; the rows that arrived are verified, later frames dropped",
            Expect.CUT,
            ErrorCode.REPLY_TIMEOUT,
            reply=stalls_after(1, lambda timeout: 1.5 * timeout),
            timing=Timing.PAST,
            kept=1,
            also_dropped=ErrorCode.LATE_FRAME,
        ),
        SparkCase(
            "S3.12",
            "a row whose token is a shortest-form uint (the older encoding): fatal, nothing used",
            "§3.2, §4.5: REPLY's token is a bin of exactly 4 bytes; any other encoding is "
            "HEADER_INVALID, and the in-flight proposal is discarded",
            Expect.DISCARD,
            ErrorCode.HEADER_INVALID,
            reply=send(lambda st: uint_token_frame(ok_row(st, 0))),
        ),
    ]
    out += _stop_cases()
    hello_cases: list[tuple[str, dict[str, Any], ErrorCode]] = [
        ("wire_version", {"wire_version": 99}, ErrorCode.WIRE_VERSION_MISMATCH),
        ("q_semantic", {"q_semantic": "float32-v0"}, ErrorCode.Q_SEMANTIC_MISMATCH),
        ("verifier", {"verifier": "other-verifier"}, ErrorCode.VERIFIER_MISMATCH),
        ("rng_abi", {"rng_abi": "xorshift-v0"}, ErrorCode.RNG_ABI_MISMATCH),
        ("precision", {"precision": "bf16"}, ErrorCode.PRECISION_MISMATCH),
        ("vocab_size", {"vocab_size": VOCAB - 1}, ErrorCode.VOCAB_SIZE_MISMATCH),
        ("vocab_hash", {"vocab_hash": 12345}, ErrorCode.VOCAB_HASH_MISMATCH),
        ("target_identity", {"target_identity": "other-target"}, ErrorCode.IDENTITY_MISMATCH),
    ]
    for n, (name, over, code) in enumerate(hello_cases, 1):
        out.append(
            SparkCase(
                f"S4.{n}",
                f"worker HELLO with another {name} is refused",
                "§4.1: every identity field must match exactly; refuse before any OPEN",
                Expect.REFUSE,
                code,
                edits={MsgType.HELLO: _hello(**over)},
            )
        )
    out += [
        SparkCase(
            "S4.9",
            "a COMPLETION before the worker's HELLO is fatal",
            "§5: before HELLO only HELLO, CHALLENGE, ERROR, PING, PONG may arrive",
            Expect.REFUSE,
            ErrorCode.HANDSHAKE_REQUIRED,
            greeting=completion(reply_step(0, depth=1, session=1, position=0, digest=0), b"", 0),
        ),
        SparkCase(
            "S4.10",
            "the HELLO of a worker before row_format (ending at field 27) is refused",
            "§4.1, §11: a peer whose row_format is not pp1-fixed-rows-v1 (an older one omits "
            "it) is refused before any OPEN (ROW_FORMAT_MISMATCH)",
            Expect.REFUSE,
            ErrorCode.ROW_FORMAT_MISMATCH,
            edits={MsgType.HELLO: older_hello_frame},
        ),
        SparkCase(
            "S5.1",
            "the worker demands a key the Spark side does not have",
            "§5: CHALLENGE without a configured key: AUTH_REQUIRED, no OPEN",
            Expect.REFUSE,
            ErrorCode.AUTH_REQUIRED,
            worker_psk=PSK,
        ),
        SparkCase(
            "S5.2",
            "the worker's proof is made with another key",
            "§5: a CHALLENGE whose proof does not verify: AUTH_FAILED, no AUTH, no OPEN",
            Expect.REFUSE,
            ErrorCode.AUTH_FAILED,
            worker_psk=PSK,
            spark_psk=PSK[::-1],
        ),
        SparkCase(
            "S5.3",
            "a forged CHALLENGE proof (right key, flipped bytes)",
            "§5: the Spark side verifies the worker's proof before answering",
            Expect.REFUSE,
            ErrorCode.AUTH_FAILED,
            worker_psk=PSK,
            spark_psk=PSK,
            edits={MsgType.CHALLENGE: _bad_proof},
        ),
        SparkCase(
            "S5.4",
            "a worker that skips authentication when the Spark side requires it",
            "§5: a Spark side with a key never accepts an unauthenticated HELLO",
            Expect.REFUSE,
            ErrorCode.AUTH_REQUIRED,
            spark_psk=PSK,
        ),
    ]
    return out


def _stop_cases() -> list[SparkCase]:
    """S6: stop rules (``docs/adaptive.md`` §2, protocol §4.1, §4.6). Under
    ``confidence:0.5`` a draft of token 0 continues the block and one of token 2
    ends it; under ``joint:0.25`` token 2 first sits exactly on the boundary
    (q = 1/4: the rule continues), and 2 then 0 ends it (1/8)."""
    conf, joint = "confidence:0.5", "joint:0.25"
    violated = ErrorCode.STOP_RULE_VIOLATED
    rule = "docs/adaptive.md §2: the block must end where the rule, from the rows, ends it"

    def kept(case_id: str, title: str, why: str, drafts: Drafts, stop: str) -> SparkCase:
        """A block of ``drafts`` that ends where ``stop`` ends it: used as a proposal."""
        return SparkCase(case_id, title, why, Expect.USE, None, reply=used(drafts), stop=stop)

    def cut(case_id: str, title: str, why: str, block: Build, stop: str | None) -> SparkCase:
        """A ``block`` that breaks ``stop``: discarded with STOP_RULE_VIOLATED."""
        return SparkCase(
            case_id, title, why, Expect.DISCARD, violated, reply=send(block), stop=stop
        )

    def late(case_id: str, title: str, why: str, block: Build, stop: str) -> SparkCase:
        """A ``block`` that runs past where ``stop`` ended it after its first draft (2):
        the rows up to the stop are the block."""
        hook = kept_rows(block, lambda _st: [2])
        return SparkCase(case_id, title, why, Expect.CUT, violated, reply=hook, stop=stop, kept=1)

    return [
        kept(
            "S6.1",
            "a block the rule ended after its first draft is used",
            "§4.6: fewer rows than the depth, stopped, and the audit agrees: a proposal",
            lambda _st: [2],
            conf,
        ),
        cut(
            "S6.2",
            "a draft drawn and dropped where the rule continues (early stop)",
            rule + ": a block cut where the rule continues is STOP_RULE_VIOLATED",
            _ruled(lambda _st: [0]),
            conf,
        ),
        late(
            "S6.3",
            "a draft after the rule stopped (late): the block is the rows up to the stop",
            rule + ": a row after the stop is refused on arrival (STOP_RULE_VIOLATED), "
            "which ends the block before it",
            _ruled(lambda _st: [2, 0]),
            conf,
        ),
        late(
            "S6.4",
            "the rule ignored: drafted to the depth past its stop; the rows up to the stop stand",
            rule + ": a row after the stop is refused on arrival (STOP_RULE_VIOLATED), "
            "which ends the block before it",
            _ruled(lambda st: [2] + [0] * (st.depth - 1)),
            conf,
        ),
        cut(
            "S6.5",
            "stopped claimed for a block that reached its depth",
            "§4.6: stopped only with fewer rows than the depth: STOP_RULE_VIOLATED",
            _ruled(lambda st: [0] * st.depth, stopped=True),
            conf,
        ),
        SparkCase(
            "S6.6",
            "a block the rule ended, without stopped",
            "§4.6: rows = depth unless eos ends the block or stopped is true: COMPLETION_EARLY",
            Expect.DISCARD,
            ErrorCode.COMPLETION_EARLY,
            reply=send(_ruled(lambda _st: [2], stopped=False)),
            stop=conf,
        ),
        cut(
            "S6.7",
            "a stop under the fixed rule",
            "§4.6: stopped only under a rule other than fixed: STOP_RULE_VIOLATED",
            _ruled(lambda _st: [0]),
            None,
        ),
        kept(
            "S6.8",
            "joint: a block ended where the product falls below the threshold is used",
            "docs/adaptive.md §1: continue while the product of the drafts' q >= T / 2^24",
            lambda st: [2, 0][: st.depth],
            joint,
        ),
        cut(
            "S6.9",
            "joint: stopped on the boundary, where the rule continues (>=, not >)",
            rule + ": q = T / 2^24 exactly continues; a stop there is STOP_RULE_VIOLATED",
            _ruled(lambda _st: [2]),
            joint,
        ),
        SparkCase(
            "S6.10",
            "the worker's HELLO does not echo the stop-rule set asked for",
            "§4.1: stop_rules equal to what the Spark side sent, else STOP_RULES_MISMATCH",
            Expect.REFUSE,
            ErrorCode.STOP_RULES_MISMATCH,
            edits={MsgType.HELLO: _hello(stop_rules="")},
            stop=conf,
        ),
    ]


def _too_large(frame: bytes) -> bytes:
    # The preamble's length fields are rewritten to claim a 1 GiB payload (and its
    # checksum recomputed) so only the size bound, not the checksum, can refuse it.
    header_len = int.from_bytes(frame[6:8], "little")
    header = frame[framing.PREAMBLE_SIZE : framing.PREAMBLE_SIZE + header_len]
    payload = frame[framing.PREAMBLE_SIZE + header_len :]
    return framing.encode_raw_frame(frame[3], header, payload, payload_len=1 << 30)[
        : framing.PREAMBLE_SIZE + header_len
    ]


SPARK_CASES: list[SparkCase] = _cases()
