"""Reply vectors: a Spark side with one STEP in flight (or none) receives these bytes."""

from __future__ import annotations

from typing import Any

import msgspec

from pp1wire.errors import ErrorCode
from pp1wire.q import dyadic
from pp1wire.testing.builders import (
    SESSION,
    VOCAB,
    completion,
    dense_payload,
    fp32,
    fp32s,
    reply_row,
    reply_step,
    sparse_payload,
    whole_reply,
)
from pp1wire.testing.golden.common import Vector, message_json
from pp1wire.testing.golden.reply_rules import GOOD_DENSE, Case, bad, shard_cases, stop_cases
from pp1wire.wire.messages import Step

H, Q = 0.5, 0.25  # half and a quarter of the mass, as FP32 q values


def reply_vectors() -> list[Vector]:
    """One valid dense and sparse reply, then one vector per rejection class."""
    d = reply_step(0)
    s = reply_step(3)

    def good(st: Step) -> bytes:
        """The valid dense reply to ``st``: tokens 0 and 2."""
        return whole_reply(
            st, *(reply_row(st, i, t, dense_payload(GOOD_DENSE)) for i, t in ((0, 0), (1, 2)))
        )

    def row(i: int, token: int, **over: Any) -> bytes:
        """Row ``i`` of ``d``'s reply drafting ``token`` under GOOD_DENSE (fields overridden)."""
        return reply_row(d, i, token, dense_payload(GOOD_DENSE), **over)

    good0, good1 = row(0, 0), row(1, 2)
    later = msgspec.structs.replace(d, round=1)
    sp0 = reply_row(s, 0, 2, sparse_payload([0, 2, 7], [dyadic.M // 4] * 2 + [dyadic.M // 2]))
    sp1 = reply_row(s, 1, 7, sparse_payload([7], [dyadic.M]))

    def first(row0: bytes) -> bytes:
        """``d``'s reply with ``row0`` for row 0 and a valid row 1."""
        return whole_reply(d, row0, good1)

    def dense_bad(values: list[float]) -> bytes:
        return first(reply_row(d, 0, 0, fp32(values)))

    def sparse_bad(ids: list[int], values: list[float], token: int = 0) -> bytes:
        return whole_reply(s, reply_row(s, 0, token, fp32s(ids, values)), sp1)

    def whole(**over: int) -> bytes:
        """``d``'s valid rows, then a COMPLETION with ``over``."""
        return whole_reply(d, good0, good1, **over)

    base = [H, 0.0, Q, 0.0, 0.0, 0.0, 0.0, Q]
    cases: list[Case] = [
        ("valid_dense", d, good(d), {"proposal": [0, 2]}, {}),
        ("valid_sparse", s, whole_reply(s, sp0, sp1), {"proposal": [2, 7]}, {}),
        (
            "valid_terminal_shortens_block",
            d,
            whole_reply(d, row(0, 7)),
            {"proposal": [7]},
            {"eos": 7},
        ),
        bad("dense_nan", d, dense_bad([*base[:3], float("nan"), *base[4:]]), "NON_FINITE"),
        bad("dense_inf", d, dense_bad([*base[:3], float("inf"), *base[4:]]), "NON_FINITE"),
        bad("dense_negative_zero", d, dense_bad([*base[:3], -0.0, *base[4:]]), "NEGATIVE"),
        bad("dense_negative", d, dense_bad([H + Q, 0.0, Q, -Q, 0, 0, 0, Q]), "NEGATIVE"),
        bad("dense_non_dyadic", d, dense_bad([H, 0.0, Q, 2.0**-26, 0, 0, 0, Q]), "NON_DYADIC"),
        bad("dense_above_one", d, dense_bad([2.0, 0, 0, 0, 0, 0, 0, 0]), "NON_DYADIC"),
        bad("dense_mass_low", d, dense_bad([H, 0.0, Q, 0, 0, 0, 0, 0]), "MASS_MISMATCH"),
        bad(
            "dense_mass_high_by_one_count",
            d,
            dense_bad([H, 2.0**-24, Q, 0, 0, 0, 0, Q]),
            "MASS_MISMATCH",
        ),
        bad("dense_zero_q_at_token", d, first(row(0, 1)), "ZERO_Q_AT_PROPOSED"),
        bad("dense_token_out_of_range", d, first(row(0, VOCAB)), "PROPOSED_OUT_OF_RANGE"),
        bad(
            "dense_wrong_entries",
            d,
            first(reply_row(d, 0, 0, dense_payload(GOOD_DENSE, VOCAB - 1))),
            "ROW_LENGTH",
        ),
        bad(
            "dense_payload_shorter_than_entries",
            d,
            first(reply_row(d, 0, 0, dense_payload(GOOD_DENSE)[:-4], entries=VOCAB)),
            "ROW_LENGTH",
        ),
        bad(
            "dense_padding_nonzero",
            d,
            whole_reply(
                d,
                reply_row(d, 0, 0, dense_payload(GOOD_DENSE, VOCAB + 2)[:-4] + b"\x00\x00\x00\x80"),
                reply_row(d, 1, 2, dense_payload(GOOD_DENSE, VOCAB + 2)),
            ),
            "DENSE_PADDING_NONZERO",
            row_entries=VOCAB + 2,
        ),
        bad("missing_q", d, first(reply_row(d, 0, 0, b"", entries=0)), "MISSING_Q"),
        bad(
            "dense_row_for_sparse_step",
            s,
            whole_reply(
                s, reply_row(s, 0, 0, dense_payload(GOOD_DENSE), representation=0, entries=VOCAB)
            ),
            "BAD_REPRESENTATION",
            late=1,
        ),
        bad("sparse_duplicate_ids", s, sparse_bad([0, 0, 7], [Q, Q, H]), "SPARSE_DUPLICATE_ID"),
        bad(
            "sparse_duplicate_zeros",
            s,
            sparse_bad([0, 5, 5], [1.0, 0.0, 0.0]),
            "SPARSE_DUPLICATE_ID",
        ),
        bad("sparse_unsorted", s, sparse_bad([7, 0], [H, H]), "SPARSE_UNSORTED"),
        bad("sparse_id_out_of_range", s, sparse_bad([0, VOCAB], [H, H]), "SPARSE_ID_OUT_OF_RANGE"),
        bad("sparse_padded_id", s, sparse_bad([0, -1], [H, H]), "SPARSE_ID_OUT_OF_RANGE"),
        bad("sparse_zero_entry", s, sparse_bad([0, 7], [1.0, 0.0]), "SPARSE_ZERO_ENTRY"),
        bad(
            "sparse_support_too_large",
            s,
            sparse_bad([0, 1, 2, 3], [Q, Q, Q, Q]),
            "SUPPORT_TOO_LARGE",
        ),
        (
            "sparse_frame_over_negotiated_limit",
            s,
            sparse_bad([0, 1, 2, 3, 4], [Q, Q, Q, 0.125, 0.125]),
            {"discarded": "FRAME_TOO_LARGE", "connection_failed": "FRAME_TOO_LARGE"},
            {"late": 0},
        ),
        bad("sparse_mass", s, sparse_bad([0, 7], [H, Q]), "MASS_MISMATCH"),
        bad("sparse_zero_q_at_token", s, sparse_bad([0, 7], [H, H], token=3), "ZERO_Q_AT_PROPOSED"),
        bad("sparse_non_finite", s, sparse_bad([0, 7], [H, float("nan")]), "NON_FINITE"),
        bad("row_checksum_mismatch", d, first(row(0, 0, checksum=1)), "ROW_CHECKSUM_MISMATCH"),
        bad("rows_out_of_order", d, whole_reply(d, good1, good0), "ROW_OUT_OF_ORDER"),
        (
            # §4.5: a refused row ends the block before it; the rows before it stand.
            "row_beyond_depth",
            d,
            whole_reply(d, good0, good1, row(2, 0)),
            {"proposal": [0, 2], "cut": "ROW_OUT_OF_ORDER", "dropped": ["LATE_FRAME"]},
            {},
        ),
        (
            # §4.5, docs/adaptive.md §7: a corrupt row 1 cuts the block to row 0.
            "row_checksum_mismatch_mid_block",
            d,
            whole_reply(d, good0, row(1, 2, checksum=1)),
            {"proposal": [0], "cut": "ROW_CHECKSUM_MISMATCH", "dropped": ["LATE_FRAME"]},
            {},
        ),
        (
            # §4.6: the worker failed drafting row 1 and shipped row 0 with the status.
            "completion_status_after_rows",
            d,
            whole_reply(d, good0, status=int(ErrorCode.INTERNAL)),
            {"proposal": [0], "cut": "INTERNAL"},
            {},
        ),
        bad(
            "completion_status_after_rows_count_differs",
            d,
            whole_reply(d, good0, status=int(ErrorCode.INTERNAL), rows=2),
            "COMPLETION_EARLY",
            late=0,
        ),
        bad(
            "completion_status_after_rows_wrong_checksum",
            d,
            whole_reply(d, good0, status=int(ErrorCode.INTERNAL), reply_checksum=1),
            "REPLY_CHECKSUM_MISMATCH",
            late=0,
        ),
        (
            # §6.5: the rows that arrived by the reply deadline are the block.
            "reply_timeout_after_rows",
            d,
            good0,
            {"proposal": [0], "cut": "REPLY_TIMEOUT"},
            {"deadline": True},
        ),
        bad("reply_timeout_before_any_row", d, b"", "REPLY_TIMEOUT", deadline=True, late=0),
        bad("row_wrong_position", d, first(row(0, 0, position=9)), "WRONG_POSITION"),
        bad("completion_early", d, good0 + completion(d, good0, 1), "COMPLETION_EARLY", late=0),
        bad("completion_claims_more_rows", d, whole(rows=3), "COMPLETION_EARLY", late=0),
        bad("completion_wrong_size", d, whole(reply_bytes=1), "REPLY_SIZE_MISMATCH", late=0),
        bad(
            "completion_wrong_checksum",
            d,
            whole(reply_checksum=1),
            "REPLY_CHECKSUM_MISMATCH",
            late=0,
        ),
        bad(
            "completion_status_failure",
            d,
            whole_reply(d, status=int(ErrorCode.INTERNAL)),
            "INTERNAL",
            late=0,
        ),
        (
            "completion_twice",
            d,
            good(d) + completion(d, good0 + good1, 2),
            {"proposal": [0, 2], "dropped": ["COMPLETION_DUPLICATE"]},
            {},
        ),
        (
            "stale_generation_dropped",
            d,
            good0 + good(msgspec.structs.replace(d, generation=1)),
            {"proposal": [0, 2], "dropped": ["STALE_GENERATION"]},
            {"generation": 1},
        ),
        (
            "stale_round_dropped",
            later,
            good0 + good(later),
            {"proposal": [0, 2], "dropped": ["ROUND_REUSED"]},
            {"round": 1},
        ),
        bad("future_generation", d, first(row(0, 0, generation=1)), "FUTURE_GENERATION"),
        bad("future_round", d, first(row(0, 0, round=1)), "ROW_OUT_OF_ORDER"),
        bad("range_on_unsharded_link", d, first(row(0, 0, start=0, end=8)), "SHARD_RANGE_MISMATCH"),
        bad(
            # §4.6: COMPLETION's start and end follow REPLY's rule: absent on an unsharded link.
            "completion_range_on_unsharded_link",
            d,
            whole(start=0, end=8),
            "SHARD_RANGE_MISMATCH",
            late=0,
        ),
        (
            # §7: a COMMIT does not end the last STEP; its COMPLETION is still a duplicate.
            "completion_duplicate_after_commit",
            d,
            good(d) + completion(d, good0 + good1, 2),
            {"proposal": [0, 2], "dropped": ["COMPLETION_DUPLICATE"]},
            {"commit": {"after": 3, "accepted": 2, "extra": 5}},
        ),
        (
            # §7: the first newer-generation frame discards the pending proposal; the
            # second finds nothing pending and is rejected.
            "future_generation_twice",
            d,
            row(0, 0, generation=1) + row(1, 2, generation=1) + good(d),
            {"discarded": "FUTURE_GENERATION", "rejected": ["FUTURE_GENERATION"]},
            {"late": 3},
        ),
        (
            "future_generation_nothing_pending",
            None,
            row(0, 0, generation=1),
            {"rejected": ["FUTURE_GENERATION"]},
            {"round": 1},
        ),
        (
            # §7: the slot is checked before the generation.
            "future_generation_slot_not_open",
            d,
            row(0, 0, slot=1, generation=5) + good(d),
            {"proposal": [0, 2], "dropped": ["UNKNOWN_SLOT"]},
            {},
        ),
        (
            "wrong_session",
            d,
            row(0, 0, session=8) + good(d),
            {"proposal": [0, 2], "rejected": ["WRONG_SESSION"]},
            {},
        ),
    ]
    cases += shard_cases(d, s)
    cases += stop_cases()
    out = []
    for name, step, data, want, extra in cases:
        generation = extra.get("generation", 0)
        # The STEP in flight: the slot's generation, whatever the frames carry.
        sent = None if step is None else msgspec.structs.replace(step, generation=generation)
        context = {
            "vocab_size": VOCAB,
            "row_entries": extra.get("row_entries", VOCAB),
            "max_support": 4,
            "max_frame": 1 << 20,
            "session": SESSION,
            "prefix": [1, 2, 3],
            "eos": extra.get("eos"),
            "generation": generation,
            "round": extra.get("round", 0),
            "step": None if sent is None else message_json(sent),
        }
        if "commit" in extra:
            context["commit"] = extra["commit"]
        if extra.get("deadline"):  # the reply deadline passes after the bytes (§6.5)
            context["deadline"] = True
        if "stop_rules" in extra:  # the HELLO negotiated these stop rules (§4.1)
            context["stop_rules"] = extra["stop_rules"]
        if "layout" in extra:  # a link of a vocabulary-sharded group (§6.7)
            context["layout"] = extra["layout"]
            context["shard"] = extra["shard"]
        expect = dict(want)
        # Every frame after the one that discarded the proposal is dropped as late.
        late = extra.get("late", 2) if "discarded" in expect else 0
        expect.setdefault("dropped", ["LATE_FRAME"] * late)
        expect.setdefault("rejected", [])
        out.append(
            {"name": name, "kind": "reply", "hex": data.hex(), "context": context, "expect": expect}
        )
    return out
