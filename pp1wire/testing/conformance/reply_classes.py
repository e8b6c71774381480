"""Every reply-side rejection class, once (``REPLY_CLASSES``, for a vocabulary of 8): the S1 cases
and the hostile-worker tests both run it. A class whose bad row follows valid ones cuts the block
to them (``docs/adaptive.md`` §7) instead of discarding it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pp1wire.errors import ErrorCode
from pp1wire.errors import ErrorCode as E
from pp1wire.q.dyadic import M
from pp1wire.testing.builders import completion, dense_payload, fp32, fp32s, reply_row, whole_reply
from pp1wire.testing.conformance.spark_side import VOCAB, Build
from pp1wire.wire.messages import Step

H, Q = 0.5, 0.25
GOOD = [M // 2, 0, M // 4, 0, 0, 0, 0, M // 4]
PSK = b"pp1-conformance-spark-side-key-0"
#: The tokens a hostile block drafts for a STEP.
Drafts = Callable[[Step], list[int]]


def ok_row(st: Step, i: int) -> bytes:
    """A valid row ``i`` answering ``st`` (dense: GOOD with token 0; sparse: a point mass on 7)."""
    if st.support:
        return reply_row(st, i, 7, fp32s([7], [1.0]))
    return reply_row(st, i, 0, dense_payload(GOOD))


def first_bad(st: Step, row: bytes, index: int = 0) -> bytes:
    """A reply whose row ``index`` is ``row`` and whose other rows are valid."""
    return whole_reply(st, *(row if i == index else ok_row(st, i) for i in range(st.depth)))


def _rows(st: Step, *indices: int, **over: int) -> bytes:
    """Valid rows in the order of ``indices``, then a COMPLETION (``over`` as for it)."""
    return whole_reply(st, *(ok_row(st, i) for i in indices), **over)


def _all_rows(st: Step, **over: int) -> bytes:
    """Every row the STEP's depth asks for, valid, then a COMPLETION (``over`` as for it)."""
    return _rows(st, *range(st.depth), **over)


def ok_token(st: Step) -> int:
    """The token of :func:`ok_row` for ``st``."""
    return 7 if st.support else 0


def _row0(token: int, payload: bytes, **over: int) -> Build:
    """A reply whose row 0 drafts ``token`` with ``payload`` (fields overridden), the rest valid."""
    return lambda st: first_bad(st, reply_row(st, 0, token, payload, **over))


# Every reply-side rejection class: name, sparse support (0 = dense), builder, code, and
# the valid rows before the refused one (0: the proposal is discarded; more: the block
# is cut to them, docs/adaptive.md section 7).
ReplyClass = tuple[str, int, Build, ErrorCode, int]

REPLY_CLASSES: list[ReplyClass] = [
    ("non_finite", 0, _row0(0, fp32([H, 0, Q, np.nan, 0, 0, 0, Q])), E.NON_FINITE, 0),
    ("negative", 0, _row0(0, fp32([H, 0, Q, -0.0, 0, 0, 0, Q])), E.NEGATIVE, 0),
    ("non_dyadic", 0, _row0(0, fp32([H, 0, Q, 2.0**-30, 0, 0, 0, Q])), E.NON_DYADIC, 0),
    ("wrong_total_mass", 0, _row0(0, fp32([H, 0, Q, 0, 0, 0, 0, 0])), E.MASS_MISMATCH, 0),
    ("zero_q_at_proposed", 0, _row0(1, dense_payload(GOOD)), E.ZERO_Q_AT_PROPOSED, 0),
    ("proposed_out_of_range", 0, _row0(VOCAB, dense_payload(GOOD)), E.PROPOSED_OUT_OF_RANGE, 0),
    ("unexpected_size", 0, _row0(0, dense_payload(GOOD, VOCAB - 1)), E.ROW_LENGTH, 0),
    ("missing_q", 0, _row0(0, b"", entries=0), E.MISSING_Q, 0),
    ("row_checksum", 0, _row0(0, dense_payload(GOOD), checksum=5), E.ROW_CHECKSUM_MISMATCH, 0),
    (
        "rows_out_of_order",
        0,
        lambda st: _rows(st, 1, 0, *range(2, st.depth)),
        E.ROW_OUT_OF_ORDER,
        0,
    ),
    ("row_repeated", 0, lambda st: _rows(st, 0, *range(st.depth)), E.ROW_OUT_OF_ORDER, 1),
    (
        "completion_early",
        0,
        lambda st: ok_row(st, 0) + completion(st, ok_row(st, 0), 1),
        E.COMPLETION_EARLY,
        0,
    ),
    ("reply_checksum", 0, lambda st: _all_rows(st, reply_checksum=1), E.REPLY_CHECKSUM_MISMATCH, 0),
    ("reply_size", 0, lambda st: _all_rows(st, reply_bytes=7), E.REPLY_SIZE_MISMATCH, 0),
    ("wrong_position", 0, _row0(0, dense_payload(GOOD), position=99), E.WRONG_POSITION, 0),
    (
        "future_generation",
        0,
        lambda st: first_bad(
            st, reply_row(st, 0, 0, dense_payload(GOOD), generation=st.generation + 1)
        ),
        E.FUTURE_GENERATION,
        0,
    ),
    (
        "newer_round",
        0,
        lambda st: first_bad(st, reply_row(st, 0, 0, dense_payload(GOOD), round=st.round + 1)),
        E.ROW_OUT_OF_ORDER,
        0,
    ),
    ("sparse_duplicate_ids", 3, _row0(0, fp32s([0, 0, 7], [Q, Q, H])), E.SPARSE_DUPLICATE_ID, 0),
    (
        "sparse_duplicate_zeros",
        3,
        _row0(0, fp32s([0, 5, 5], [1.0, 0.0, 0.0])),
        E.SPARSE_DUPLICATE_ID,
        0,
    ),
    ("sparse_unsorted", 3, _row0(0, fp32s([7, 0], [H, H])), E.SPARSE_UNSORTED, 0),
    ("sparse_padded_support", 3, _row0(0, fp32s([0, -1], [H, H])), E.SPARSE_ID_OUT_OF_RANGE, 0),
    ("sparse_out_of_range", 3, _row0(0, fp32s([0, VOCAB], [H, H])), E.SPARSE_ID_OUT_OF_RANGE, 0),
    ("sparse_zero_entry", 3, _row0(0, fp32s([0, 7], [1.0, 0.0])), E.SPARSE_ZERO_ENTRY, 0),
    (
        "sparse_support_too_large",
        3,
        _row0(0, fp32s([0, 2, 5, 7], [Q, Q, Q, Q])),
        E.SUPPORT_TOO_LARGE,
        0,
    ),
    (
        "dense_row_for_sparse_step",
        3,
        _row0(0, dense_payload(GOOD), representation=0, entries=VOCAB),
        E.BAD_REPRESENTATION,
        0,
    ),
    # Later classes (their case IDs follow the earlier ones').
    (
        "row_checksum_after_a_valid_row",
        0,
        lambda st: first_bad(st, reply_row(st, 1, 0, dense_payload(GOOD), checksum=5), 1),
        E.ROW_CHECKSUM_MISMATCH,
        1,
    ),
    (
        "non_dyadic_after_a_valid_row",
        0,
        lambda st: first_bad(st, reply_row(st, 1, 0, fp32([H, 0, Q, 2.0**-30, 0, 0, 0, Q])), 1),
        E.NON_DYADIC,
        1,
    ),
    (
        "failure_status_after_a_valid_row",
        0,
        lambda st: whole_reply(st, ok_row(st, 0), status=int(E.INTERNAL)),
        E.INTERNAL,
        1,
    ),
]
