"""Reply vectors under the rules a STEP negotiates beyond the plain block: a stop
rule (§4.4, §4.6) and a vocabulary shard (§6.7)."""

from __future__ import annotations

from typing import Any

import msgspec

from pp1wire.errors import ErrorCode
from pp1wire.q import dyadic
from pp1wire.q.stoprules import STOP_RULES, StopKind, threshold_of
from pp1wire.testing.builders import dense_payload, fp32, fp32s, reply_row, reply_step, whole_reply
from pp1wire.wire.messages import Step

#: q over V = 8 with counts 2**23, 2**22, 2**22 at tokens 0, 2 and 7.
GOOD_DENSE = [dyadic.M // 2, 0, dyadic.M // 4, 0, 0, 0, 0, dyadic.M // 4]

Case = tuple[str, Step | None, bytes, dict[str, Any], dict[str, Any]]


SHARDED: dict[str, Any] = {"layout": [0, 4, 8], "shard": 1}  # the link carries IDs 4..7


def bad(name: str, step: Step, data: bytes, code: str, **extra: Any) -> Case:
    """A vector whose proposal is discarded with ``code``."""
    return (name, step, data, {"discarded": code}, extra)


def shard_cases(d: Step, s: Step) -> list[Case]:
    """Rows of shard 1 of the layout (0, 4, 8): q over IDs 4..7 only (§6.7)."""
    at = {"start": 4, "end": 8}

    # GOOD_DENSE's shard 1: q(7) = 1/4; token 0 lies in the other shard.
    d0 = reply_row(d, 0, 0, fp32([0, 0, 0, 0.25]), **at)
    d1 = reply_row(d, 1, 7, fp32([0, 0, 0, 0.25]), **at)
    s0 = reply_row(s, 0, 2, fp32s([7], [0.5]), **at)
    s1 = reply_row(s, 1, 7, fp32s([7], [1.0]), **at)
    late = {**SHARDED, "late": 0}
    return [
        ("shard_valid_dense", d, whole_reply(d, d0, d1, **at), {"proposal": [0, 7]}, SHARDED),
        ("shard_valid_sparse", s, whole_reply(s, s0, s1, **at), {"proposal": [2, 7]}, SHARDED),
        (
            "shard_valid_empty_sparse_row",
            s,
            whole_reply(s, reply_row(s, 0, 2, b"", **at), s1, **at),
            {"proposal": [2, 7]},
            SHARDED,
        ),
        bad(
            "shard_reply_range_mismatch",
            d,
            whole_reply(d, reply_row(d, 0, 0, fp32([0, 0, 0, 0.25]), start=0, end=4), d1, **at),
            "SHARD_RANGE_MISMATCH",
            **SHARDED,
        ),
        bad(
            "shard_completion_range_mismatch",
            d,
            whole_reply(d, d0, d1, start=0, end=8),
            "SHARD_RANGE_MISMATCH",
            **late,
        ),
        bad(
            "shard_completion_range_missing",
            d,
            whole_reply(d, d0, d1),
            "SHARD_RANGE_MISMATCH",
            **late,
        ),
        bad(
            "shard_dense_whole_row",
            d,
            whole_reply(d, reply_row(d, 0, 0, dense_payload(GOOD_DENSE), **at), d1, **at),
            "ROW_LENGTH",
            **SHARDED,
        ),
        bad(
            "shard_sparse_id_outside_range",
            s,
            whole_reply(s, reply_row(s, 0, 2, fp32s([2], [0.5]), **at), s1, **at),
            "SPARSE_ID_OUT_OF_RANGE",
            **SHARDED,
        ),
        bad(
            "shard_mass_above_whole",
            d,
            whole_reply(d, reply_row(d, 0, 7, fp32([0, 0.5, 0, 0.75]), **at), d1, **at),
            "MASS_MISMATCH",
            **SHARDED,
        ),
        bad(
            "shard_zero_q_at_owned_token",
            d,
            whole_reply(d, reply_row(d, 0, 5, fp32([0, 0, 0, 0.25]), **at), d1, **at),
            "ZERO_Q_AT_PROPOSED",
            **SHARDED,
        ),
        *shard_stop_cases(d, fp32([0, 0, 0, 0.25]), at),
    ]


def shard_stop_cases(d: Step, payload: bytes, at: dict[str, int]) -> list[Case]:
    """A sharded link under confidence:0.5, depth 3 (§6.7, ``docs/tp.md`` §11).

    A shard row holds the count at its token only on the link whose range has the
    token (here token 7 of 4..7; tokens 0 and 2 are the other shard's), so the
    link checks what needs no count — the rows announced, ``stopped`` against the
    block's length — and publishes the rows it got: whether they stop where the
    rule stops is audited by the Spark group from the counts its ranks gather (a
    block past the stop is cut there, one short of it refused).
    """
    conf = msgspec.structs.replace(
        d, depth=3, stop=int(StopKind.CONFIDENCE), threshold=threshold_of("0.5")
    )

    def rows(*tokens: int, **over: int) -> bytes:
        frames = [reply_row(conf, i, t, payload, **at) for i, t in enumerate(tokens)]
        return whole_reply(conf, *frames, **at, **over)

    ruled = {**SHARDED, **STOPPING}
    return [
        ("shard_stop_rule_ends_early", conf, rows(7, stopped=1), {"proposal": [7]}, ruled),
        ("shard_stop_runs_to_depth", conf, rows(0, 7, 2), {"proposal": [0, 7, 2]}, ruled),
        # Past the stop, or short of it: the link cannot tell; its group audits it.
        ("shard_stop_past_the_rule_is_the_groups", conf, rows(2, 0, stopped=1),
         {"proposal": [2, 0]}, ruled),
        ("shard_stop_short_of_the_rule_is_the_groups", conf, rows(0, stopped=1),
         {"proposal": [0]}, ruled),
        # The flags need no count: checked on the link as on an unsharded one.
        ("shard_stop_short_without_flag", conf, rows(2),
         {"discarded": "COMPLETION_EARLY"}, ruled),
        ("shard_stop_flag_at_depth", conf, rows(0, 0, 2, stopped=1),
         {"discarded": "STOP_RULE_VIOLATED"}, ruled),
        # An empty block is early whatever the counts (row 1 is always drawn).
        ("shard_stop_empty_block", conf, rows(stopped=1),
         {"discarded": "STOP_RULE_VIOLATED"}, ruled),
    ]  # fmt: skip


#: The Spark side negotiated the stop rules (§4.1) for these vectors.
STOPPING: dict[str, Any] = {"stop_rules": STOP_RULES, "late": 0}


def stop_cases() -> list[Case]:
    """Blocks under a stop rule (§4.4, §4.6, ``docs/adaptive.md`` §2), depth 3.

    GOOD_DENSE gives token 0 the count 2**23 (q = 1/2) and tokens 2 and 7 the
    count 2**22 (1/4): under confidence:0.5 a row with token 0 continues and
    one with token 2 stops; under joint:0.25, tokens 0 then 2 have the product
    1/8 and stop after the second row.
    """
    conf = msgspec.structs.replace(
        reply_step(0, depth=3), stop=int(StopKind.CONFIDENCE), threshold=threshold_of("0.5")
    )
    joint = msgspec.structs.replace(conf, stop=int(StopKind.JOINT), threshold=threshold_of("0.25"))
    fixed = reply_step(0, depth=3)

    def rows(st: Step, *tokens: int, **over: int) -> bytes:
        frames = [reply_row(st, i, t, dense_payload(GOOD_DENSE)) for i, t in enumerate(tokens)]
        return whole_reply(st, *frames, **over)

    violated = "STOP_RULE_VIOLATED"
    late = {"proposal": [2], "cut": violated, "dropped": ["LATE_FRAME"]}
    return [
        ("stop_confidence_ends_early", conf, rows(conf, 2, stopped=1), {"proposal": [2]}, STOPPING),
        (
            "stop_confidence_runs_to_depth",
            conf,
            rows(conf, 0, 0, 2),
            {"proposal": [0, 0, 2]},
            STOPPING,
        ),
        (
            "stop_joint_ends_early",
            joint,
            rows(joint, 0, 2, stopped=1),
            {"proposal": [0, 2]},
            STOPPING,
        ),
        (
            "stop_terminal_token_ends_block_unflagged",
            conf,
            rows(conf, 0),
            {"proposal": [0]},
            {**STOPPING, "eos": 0},
        ),
        bad("stop_short_without_flag", conf, rows(conf, 2), "COMPLETION_EARLY", **STOPPING),
        bad("stop_early_row_dropped", conf, rows(conf, 0, stopped=1), violated, **STOPPING),
        # A block of no rows is early whatever the rule: it decides after a drawn row.
        bad("stop_empty_block", conf, rows(conf, stopped=1), violated, **STOPPING),
        # A row after the rule stopped is refused on arrival: the block is the rows up
        # to the stop (docs/adaptive.md §2), later frames late.
        ("stop_late_row_after_stop", conf, rows(conf, 2, 0, stopped=1), late, STOPPING),
        (
            "stop_late_to_depth",
            conf,
            rows(conf, 2, 0, 0),
            {**late, "dropped": ["LATE_FRAME"] * 2},
            STOPPING,
        ),
        ("stop_joint_late", joint, rows(joint, 0, 2, 0), {**late, "proposal": [0, 2]}, STOPPING),
        (
            # A fault after a row where the rule continues: the block is cut there.
            "stop_fault_where_the_rule_continues",
            conf,
            rows(conf, 0, status=int(ErrorCode.INTERNAL)),
            {"proposal": [0], "cut": "INTERNAL"},
            STOPPING,
        ),
        bad(
            "stop_flag_with_a_failure_status",
            conf,
            rows(conf, 2, stopped=1, status=int(ErrorCode.INTERNAL)),
            violated,
            **STOPPING,
        ),
        bad("stop_flag_at_depth", conf, rows(conf, 0, 0, 2, stopped=1), violated, **STOPPING),
        bad(
            "stop_flag_after_terminal_token",
            conf,
            rows(conf, 0, stopped=1),
            violated,
            **STOPPING,
            eos=0,
        ),
        bad("stop_flag_under_fixed_rule", fixed, rows(fixed, 0, stopped=1), violated, **STOPPING),
    ]
