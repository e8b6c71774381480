"""The worker's reply to a STEP as frames: REPLY rows, then COMPLETION (protocol §4.5, §4.6),
each row's payload written once and sent as a view, never joined to its header; on a sharded
link (§6.7) a row carries only the q of the link's range."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from pp1wire.q import dyadic
from pp1wire.q.proposal import QRow
from pp1wire.wire import framing
from pp1wire.wire.messages import Completion, FixedToken, Reply, Representation, Step

#: One frame as the pieces written to the transport, in order.
FrameParts = tuple[bytes | memoryview, ...]


def row_payload(
    row: QRow, row_entries: int, shard: tuple[int, int] | None = None
) -> tuple[memoryview, int]:
    """The q payload of one row and its entry count: dense FP32 (zero padded) or sparse
    int32 IDs then FP32, as a byte view. With ``shard = (start, end)``, only that range's
    q: dense values without padding, or the sparse entries whose IDs lie in it."""
    counts, ids = row.counts, row.ids
    if counts is None:
        return _fp32_payload(row, row_entries, shard)
    scale = np.float32(1.0 / dyadic.M)
    if ids is None:
        if shard is not None:
            # A sharded group's row already holds only its range.
            row_entries = shard[1] - shard[0]
            if counts.size != row_entries:
                counts = counts[shard[0] : shard[1]]
        q = np.empty(row_entries, dtype="<f4")
        used = counts.size
        # In FP32 directly: a count (at most 2**24) and 2**-24 are exact in FP32, so
        # the product is the same value without a float64 pass (2.5x faster).
        np.multiply(counts, scale, out=q[:used], dtype=np.float32, casting="unsafe")
        q[used:] = 0.0
        return q.data.cast("B"), row_entries
    return _sparse_payload(ids, counts, shard, scale)


def _sparse_payload(
    ids: npt.NDArray[np.int32],
    values: npt.NDArray[Any],
    shard: tuple[int, int] | None,
    scale: np.float32 | None,
) -> tuple[memoryview, int]:
    """A sparse payload: the IDs (those in ``shard``), then their values as FP32 (counts
    times ``scale``, or FP32 values as they are when ``scale`` is None)."""
    if shard is not None:
        lo, hi = np.searchsorted(ids, shard, side="left")
        ids, values = ids[lo:hi], values[lo:hi]
    k = ids.size
    both = np.empty(2 * k, dtype="<i4")
    both[:k] = ids
    if scale is None:
        both[k:].view("<f4")[:] = values
    else:
        np.multiply(values, scale, out=both[k:].view("<f4"), dtype=np.float32, casting="unsafe")
    return both.data.cast("B"), k


def _fp32_payload(
    row: QRow, row_entries: int, shard: tuple[int, int] | None
) -> tuple[memoryview, int]:
    """:func:`row_payload` of a row holding its FP32 values (``q32``): a dense row built to
    travel (its own array of ``row_entries`` values, lent to no one) is sent as it is."""
    q32, ids = row.q32, row.ids
    assert q32 is not None
    if ids is None:
        if shard is None:
            if (
                not row.borrowed
                and q32.shape == (row_entries,)
                and q32.dtype == np.dtype("<f4")
                and q32.flags.c_contiguous
            ):
                return q32.data.cast("B"), row_entries
        else:
            row_entries = shard[1] - shard[0]
            if q32.size != row_entries:
                q32 = q32[shard[0] : shard[1]]
        q = np.empty(row_entries, dtype="<f4")
        q[: q32.size] = q32
        q[q32.size :] = 0.0
        return q.data.cast("B"), row_entries
    return _sparse_payload(ids, q32, shard, None)


def reply_frames(
    session: int, step: Step, rows: tuple[QRow, ...], row_entries: int
) -> tuple[FrameParts, ...]:
    """The frames of an unsharded untagged reply of status 0 to a STEP: REPLY frames in
    position order, then COMPLETION, whose size and checksum cover the REPLY frames (§4.6)."""
    encoder = ReplyEncoder(session, step, row_entries)
    frames = tuple(encoder.row(index, row) for index, row in enumerate(rows))
    return (*frames, encoder.completion(frames))


class ReplyEncoder:
    """A STEP's reply framed a row at a time, as each row is drawn (``docs/adaptive.md`` §7),
    then the COMPLETION: the same bytes as :func:`reply_frames` (``shard``: a sharded link's
    global ID range, named by every frame)."""

    __slots__ = ("row_entries", "session", "shard", "step", "tagged")

    def __init__(
        self,
        session: int,
        step: Step,
        row_entries: int,
        *,
        shard: tuple[int, int] | None = None,
        tagged: bool = False,
    ) -> None:
        """Frame the reply to ``step``."""
        self.session = session
        self.step = step
        self.row_entries = row_entries
        self.shard = shard
        self.tagged = tagged

    def _head(self) -> dict[str, int]:
        """The fields every frame of the reply names: its session and round."""
        st = self.step
        head = {"session": self.session, "slot": st.slot, "generation": st.generation}
        return head | {"round": st.round}

    def row(self, index: int, row: QRow) -> FrameParts:
        """The REPLY frame of row ``index``, as (preamble and header, payload)."""
        payload, entries = row_payload(row, self.row_entries, self.shard)
        start, end = self.shard or (None, None)
        header = Reply(
            **self._head(),
            index=index,
            position=self.step.position + index,
            token=FixedToken(row.token),
            representation=int(Representation.DENSE if row.ids is None else Representation.SPARSE),
            entries=entries,
            checksum=xxhash.xxh3_64_intdigest(payload),
            start=start,
            end=end,
        )
        return framing.encode_head(header, payload.nbytes, tagged=self.tagged), payload

    def completion(
        self, frames: tuple[FrameParts, ...], status: int = 0, *, stopped: bool = False
    ) -> FrameParts:
        """The COMPLETION closing a reply whose REPLY frames are ``frames`` (``stopped``: by
        the STEP's stop rule)."""
        checksum = xxhash.xxh3_64()
        body = 0
        for parts in frames:
            for part in parts:
                checksum.update(part)
                body += memoryview(part).nbytes
        start, end = self.shard or (None, None)
        done = Completion(
            **self._head(),
            position=self.step.position,
            context=self.step.context,
            rows=len(frames),
            reply_bytes=body,
            reply_checksum=checksum.intdigest(),
            status=status,
            start=start,
            end=end,
            stopped=stopped,
        )
        return (framing.encode_frame(done, tagged=self.tagged),)


def build_reply(session: int, step: Step, rows: tuple[QRow, ...], row_entries: int) -> bytes:
    """:func:`reply_frames`, joined."""
    frames = reply_frames(session, step, rows, row_entries)
    return b"".join(part for parts in frames for part in parts)
