"""The worker's reply to a STEP, as bytes: REPLY frames, then COMPLETION (protocol §4.5, §4.6).

Each row's payload is written once from its counts (dense FP32 with zero
padding, or sparse int32 IDs then FP32); the frames are kept separately so a
keyed connection can tag each one (§5.1) and a replay can re-tag them.
"""

from __future__ import annotations

import numpy as np
import xxhash

from pp1wire.q import dyadic
from pp1wire.q.proposal import QRow
from pp1wire.wire import framing
from pp1wire.wire.messages import Completion, Reply, Representation, Step


def row_payload(row: QRow, row_entries: int) -> bytes:
    """The q payload of one row: dense FP32 (zero padded) or sparse int32 IDs then FP32."""
    if row.ids is None:
        assert row.counts is not None
        q = np.zeros(row_entries, dtype="<f4")
        np.multiply(
            row.counts, np.float32(1.0 / dyadic.M), out=q[: row.counts.size], casting="unsafe"
        )
        return q.tobytes()
    assert row.counts is not None
    return row.ids.astype("<i4").tobytes() + dyadic.counts_to_fp32(row.counts).tobytes()


def reply_frame(
    session: int,
    step: Step,
    index: int,
    token: int,
    dense: bool,
    entries: int,
    payload: bytes,
    *,
    tagged: bool = False,
) -> bytes:
    """One REPLY frame with its row checksum over ``payload``."""
    header = Reply(
        session=session,
        slot=step.slot,
        generation=step.generation,
        round=step.round,
        index=index,
        position=step.position + index,
        token=token,
        representation=int(Representation.DENSE if dense else Representation.SPARSE),
        entries=entries,
        checksum=xxhash.xxh3_64_intdigest(payload),
    )
    return framing.encode_frame(header, payload, tagged=tagged)


def completion_frame(
    session: int,
    step: Step,
    rows: int,
    reply_bytes: int,
    reply_checksum: int,
    status: int,
    *,
    tagged: bool = False,
) -> bytes:
    """The COMPLETION frame that closes a reply."""
    return framing.encode_frame(
        Completion(
            session=session,
            slot=step.slot,
            generation=step.generation,
            round=step.round,
            position=step.position,
            context=step.context,
            rows=rows,
            reply_bytes=reply_bytes,
            reply_checksum=reply_checksum,
            status=status,
        ),
        tagged=tagged,
    )


def reply_frames(
    session: int,
    step: Step,
    rows: tuple[QRow, ...],
    row_entries: int,
    status: int = 0,
    *,
    tagged: bool = False,
) -> tuple[bytes, ...]:
    """The frames of a reply to a STEP: REPLY frames in position order, then COMPLETION.

    COMPLETION's ``reply_bytes`` and ``reply_checksum`` cover the REPLY frames
    without their tags (§4.6), so a replay re-tags the same frames.
    """
    frames = []
    for index, row in enumerate(rows):
        payload = row_payload(row, row_entries)
        dense = row.ids is None
        entries = row_entries if dense else int(row.ids.size)  # type: ignore[union-attr]
        frames.append(
            reply_frame(session, step, index, row.token, dense, entries, payload, tagged=tagged)
        )
    checksum = xxhash.xxh3_64()
    for f in frames:
        checksum.update(f)
    body = sum(len(f) for f in frames)
    done = completion_frame(
        session, step, len(rows), body, checksum.intdigest(), status, tagged=tagged
    )
    return (*frames, done)


def build_reply(
    session: int, step: Step, rows: tuple[QRow, ...], row_entries: int, status: int = 0
) -> bytes:
    """The whole untagged reply to a STEP as one byte string (see :func:`reply_frames`)."""
    return b"".join(reply_frames(session, step, rows, row_entries, status))


__all__ = ["build_reply", "completion_frame", "reply_frame", "reply_frames", "row_payload"]
