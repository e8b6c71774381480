"""What rank 0 publishes to a Spark TP group each attempt, as fixed-size words and bytes.

Pure numpy: headers and outcomes are ``int64[16]`` vectors, the rows one byte payload;
``docs/tp.md`` §2 is the normative description of every word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from pp1wire.errors import ErrorCode, ValidationError
from pp1wire.q import dyadic
from pp1wire.q.layout import as_int64, as_uint64
from pp1wire.q.proposal import MAX_DEPTH, Proposal, QRow
from pp1wire.q.stoprules import FIXED, StopKind, StopRule
from pp1wire.q.verify import Outcome, RequestVerifier, RoundResult

WORDS = 16
"""Length of the header, outcome and vote vectors (int64)."""
VOTE_WORDS = 3
INLINE = 16_384
"""Rows up to this many bytes travel inside the attempt header (one collective, not two)."""
_OUTCOMES = list(Outcome)
Words = npt.NDArray[np.int64]


class Kind(IntEnum):
    """What an entry of an attempt is."""

    PROPOSAL = 1
    TARGET_ONLY = 2


@dataclass
class Item:
    """One round rank 0 asks the group to decide: a validated proposal, or target-only."""

    request: int
    verifier: RequestVerifier
    proposal: Proposal | None
    round_id: int = 0  # target-only rounds (a proposal carries its own)


def digest(data: bytes | npt.NDArray[np.generic]) -> int:
    """xxh3-64 of the bytes, as a signed word."""
    raw = data if isinstance(data, bytes) else np.ascontiguousarray(data).data
    return as_int64(int(xxhash.xxh3_64_intdigest(raw)))


def owner_of(request: int, world: int) -> int:
    """The rank that evaluates ``request`` (round-robin by index): the one place the
    choice is made."""
    return request % world


@dataclass(frozen=True)
class Header:
    """One attempt's key: which request, which round, what rows follow."""

    kind: Kind
    request: int = 0
    session: int = 0
    generation: int = 0
    round_id: int = 0
    position: int = 0
    prefix_digest: int = 0
    depth: int = 0
    rows: int = 0
    sparse: bool = False
    nbytes: int = 0
    payload_digest: int = 0
    context: int = 0
    stop: StopRule = FIXED  # the proposal's stop rule: word 1, kind * 2**32 + threshold
    cut: ErrorCode | None = None  # the fault that cut the block (word 14; 0: none)

    def words(self) -> Words:
        """The header as ``int64[WORDS]``."""
        out = np.zeros(WORDS, dtype=np.int64)
        out[0], out[1] = int(self.kind), (int(self.stop.kind) << 32) | self.stop.threshold
        for i, name in enumerate(_MIDDLE, start=2):
            value = int(getattr(self, name))
            out[i] = as_int64(value) if name in _UNSIGNED else value
        out[14] = int(self.cut or 0)
        return out

    @classmethod
    def from_words(cls, words: Words, max_payload: int) -> Header:
        """Read a header, refusing one no rank 0 of this protocol could have sent.

        Raises:
            ValidationError: ``GROUP_HEADER_INVALID`` for an unknown kind, a row count
                outside ``0..MAX_DEPTH``, a payload over ``max_payload`` bytes (checked
                before any payload buffer is allocated), a sparse flag other than 0 or 1,
                or a stop-rule or cut word that names none.
        """
        w = [int(v) for v in words.tolist()]
        if w[0] not in (k.value for k in Kind):
            raise ValidationError(ErrorCode.GROUP_HEADER_INVALID, f"unknown attempt kind {w[0]}")
        if not 0 <= w[9] <= MAX_DEPTH or not 0 <= w[11] <= max_payload or w[10] not in (0, 1):
            raise ValidationError(ErrorCode.GROUP_HEADER_INVALID, "attempt header out of bounds")
        try:
            stop = StopRule(StopKind(w[1] >> 32), w[1] & 0xFFFFFFFF)
            cut = ErrorCode(w[14]) if w[14] else None
        except ValueError:
            why = f"the stop-rule word {w[1]} or the cut word {w[14]} names none"
            raise ValidationError(ErrorCode.GROUP_HEADER_INVALID, why) from None
        middle: dict[str, Any] = {
            name: as_uint64(v) if name in _UNSIGNED else v
            for name, v in zip(_MIDDLE, w[2:14], strict=True)
        }
        middle["sparse"] = bool(middle["sparse"])
        return cls(kind=Kind(w[0]), stop=stop, cut=cut, **middle)


# Words 2..13 are these fields in order; the uint64 ones travel as int64 of the same bits.
_MIDDLE = [f.name for f in fields(Header)][1:13]
_UNSIGNED = frozenset({"session", "prefix_digest", "context"})


def batch_words(attempt: int, entries: Sequence[Header], max_batch: int) -> Words:
    """One attempt's header, ``int64[(1 + max_batch) * WORDS]``: ``[1, attempt, count,
    total bytes, 0…]`` then one row per entry (no entries: all 0, the group stops).

    Raises:
        ValueError: for more than ``max_batch`` entries.
    """
    if len(entries) > max_batch:
        raise ValueError(f"{len(entries)} entries, at most {max_batch} per attempt")
    out = np.zeros((1 + max_batch) * WORDS, dtype=np.int64)
    if entries:
        out[:4] = [1, attempt, len(entries), sum(h.nbytes for h in entries)]
    for i, h in enumerate(entries):
        out[(1 + i) * WORDS : (2 + i) * WORDS] = h.words()
    return out


def read_batch(words: Words, max_batch: int, max_payload: int) -> tuple[int, list[Header]]:
    """``(attempt, entries)`` from :func:`batch_words`; no entries means stop.

    Raises:
        ValidationError: ``GROUP_HEADER_INVALID`` for a count over ``max_batch``, an
            entry :meth:`Header.from_words` refuses, two entries for one request;
            ``GROUP_HEADER_INVALID`` if the entries' sizes do not add up to the total.
    """
    if int(words[0]) == 0:
        return int(words[1]), []
    count, total = int(words[2]), int(words[3])
    if int(words[0]) != 1 or not 1 <= count <= max_batch:
        raise ValidationError(ErrorCode.GROUP_HEADER_INVALID, "attempt header out of bounds")
    entries = [
        Header.from_words(words[(1 + i) * WORDS : (2 + i) * WORDS], max_payload)
        for i in range(count)
    ]
    if len({h.request for h in entries}) != count:
        raise ValidationError(ErrorCode.GROUP_HEADER_INVALID, "two entries for one request")
    if sum(h.nbytes for h in entries) != total:
        raise ValidationError(ErrorCode.GROUP_HEADER_INVALID, "entry sizes do not add up")
    return int(words[1]), entries


def max_payload(vocab_size: int) -> int:
    """The most bytes a payload may hold: MAX_DEPTH rows of ``vocab_size`` ids and values."""
    return MAX_DEPTH * (8 + 8 * vocab_size)


def rows_nbytes(rows: Sequence[QRow]) -> int:
    """The bytes :func:`pack_rows` writes for ``rows``."""
    return 8 * len(rows) + sum(r.length * (4 if r.ids is None else 8) for r in rows)


def pack_rows(
    rows: Sequence[QRow], out: npt.NDArray[np.uint8] | None = None
) -> tuple[npt.NDArray[np.uint8], bool]:
    """The rows as one payload (tokens, lengths, then per row ids if sparse and q32) in
    ``out`` (exactly :func:`rows_nbytes` bytes; None: a new array), and whether sparse.

    Raises:
        ValueError: if dense and sparse rows are mixed, or ``out`` has the wrong size.
    """
    sparse = bool(rows) and rows[0].ids is not None
    if any((r.ids is not None) != sparse for r in rows):
        raise ValueError("a proposal's rows are all dense or all sparse")
    size = rows_nbytes(rows)
    buf = np.empty(size, dtype=np.uint8) if out is None else out
    if buf.size != size:
        raise ValueError(f"{buf.size} bytes for rows of {size}")
    n = len(rows)
    buf[: 4 * n].view("<i4")[:] = [r.token for r in rows]
    buf[4 * n : 8 * n].view("<i4")[:] = [r.length for r in rows]
    at = 8 * n
    for r in rows:
        length = r.length
        if sparse:
            assert r.ids is not None
            buf[at : at + 4 * length].view("<i4")[:] = r.ids
            at += 4 * length
        q = buf[at : at + 4 * length].view("<f4")
        if r.q32 is not None:
            q[:] = r.q32
        else:
            assert r.counts is not None
            scale = np.float32(1.0 / dyadic.M)
            np.multiply(r.counts, scale, out=q, dtype=np.float32, casting="unsafe")
        at += 4 * length
    return buf, sparse


def unpack_rows(payload: npt.NDArray[np.uint8], rows: int, sparse: bool) -> tuple[QRow, ...]:
    """The rows :func:`pack_rows` wrote; q views ``payload`` (no copy).

    Raises:
        ValidationError: ``GROUP_HEADER_INVALID`` if the lengths do not fill the payload exactly.
    """
    head = 8 * rows
    if payload.nbytes < head:
        raise ValidationError(ErrorCode.GROUP_HEADER_INVALID, "payload shorter than its row table")
    tokens = payload[: 4 * rows].view("<i4")
    lengths = payload[4 * rows : head].view("<i4")
    per_entry = 8 if sparse else 4
    if int(lengths.min(initial=0)) < 0 or head + per_entry * int(lengths.sum()) != payload.nbytes:
        raise ValidationError(ErrorCode.GROUP_HEADER_INVALID, "row lengths do not fill the payload")
    out = []
    at = head
    for token, length in zip(tokens.tolist(), lengths.tolist(), strict=True):
        ids = None
        if sparse:
            ids = payload[at : at + 4 * length].view("<i4").astype(np.int32, copy=False)
            at += 4 * length
        q32 = payload[at : at + 4 * length].view("<f4").astype(np.float32, copy=False)
        at += 4 * length
        out.append(QRow(token=int(token), q32=q32, ids=ids))
    return tuple(out)


# The fields a PROPOSAL header carries of its proposal: (header field, proposal field).
_CARRIED = (
    ("session", "session"),
    ("generation", "generation"),
    ("round_id", "round_id"),
    ("position", "position"),
    ("prefix_digest", "digest"),
    ("depth", "depth"),
    ("context", "context"),
    ("stop", "stop"),
    ("cut", "cut"),
)


def proposal_of(header: Header, rows: tuple[QRow, ...]) -> Proposal:
    """The proposal a PROPOSAL header and its rows describe."""
    return Proposal(rows=rows, **{theirs: getattr(header, ours) for ours, theirs in _CARRIED})


def header_of(
    request: int, proposal: Proposal, payload: npt.NDArray[np.uint8], sparse: bool
) -> Header:
    """The PROPOSAL header for ``proposal`` packed as ``payload``."""
    return Header(
        kind=Kind.PROPOSAL,
        request=request,
        rows=len(proposal.rows),
        sparse=sparse,
        nbytes=payload.nbytes,
        payload_digest=digest(payload),
        **{ours: getattr(proposal, theirs) for ours, theirs in _CARRIED},
    )


def target_only_header(request: int, verifier: RequestVerifier, round_id: int) -> Header:
    """The TARGET_ONLY header for ``round_id`` of ``request`` after ``verifier``'s prefix."""
    return Header(
        kind=Kind.TARGET_ONLY,
        request=request,
        session=verifier.session,
        generation=verifier.generation,
        round_id=round_id,
        position=verifier.position,
        prefix_digest=verifier.digest,
        context=verifier.context,
        payload_digest=digest(b""),
    )


def encode_outcome(result: RoundResult | None, reason: ErrorCode | None) -> Words:
    """The owner's outcome words: ``[ok, reason, round, accepted, n, outcome, finished,
    extra, tokens…]``, -1 padded."""
    out = np.full(WORDS, -1, dtype=np.int64)
    out[0] = int(result is not None)
    out[1] = int(reason) if reason is not None else 0
    if result is not None:
        n = len(result.tokens)
        out[2:8] = [
            result.round_id,
            result.accepted,
            n,
            _OUTCOMES.index(result.outcome),
            int(result.finished),
            -1 if result.extra is None else result.extra,
        ]
        out[8 : 8 + n] = result.tokens
    return out


def decode_outcome(words: Words) -> tuple[RoundResult | None, ErrorCode | None]:
    """Inverse of :func:`encode_outcome`; an outcome that cannot be one reads as failed.

    Never raises: an unreadable outcome is ``(None, GROUP_OUTCOME_MISMATCH)``.
    """
    w = [int(v) for v in words.tolist()]
    reason = code_of(w[1])
    if w[0] != 1:
        return None, reason or ErrorCode.GROUP_OUTCOME_MISMATCH
    n = w[4]
    if not 1 <= n <= MAX_DEPTH + 1 or not 0 <= w[5] < len(_OUTCOMES) or not 0 <= w[3] <= n:
        return None, ErrorCode.GROUP_OUTCOME_MISMATCH
    return (
        RoundResult(
            round_id=w[2],
            accepted=w[3],
            tokens=tuple(w[8 : 8 + n]),
            extra=None if w[7] < 0 else w[7],
            outcome=_OUTCOMES[w[5]],
            finished=bool(w[6]),
            new_position=-1,  # each rank's own prefix says where it lands
        ),
        None,
    )


def code_of(value: int) -> ErrorCode | None:
    """The error code a word carries (0: none; an unknown value reads as a mismatch)."""
    try:
        return ErrorCode(value) if value else None
    except ValueError:
        return ErrorCode.GROUP_OUTCOME_MISMATCH
