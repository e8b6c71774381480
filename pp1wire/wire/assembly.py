"""The Spark side's assembly of one reply: each row checked as it arrives, then COMPLETION,
in the order of ``docs/protocol.md`` §4.5, §4.6 and §6.2; the fencing rules read its state."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xxhash

from pp1wire.errors import ErrorCode, ValidationError
from pp1wire.q import layout, validate
from pp1wire.q.proposal import Lease, Proposal, QRow
from pp1wire.q.stoprules import StopKind, StopRule, audit, continues, stopped_by_rule
from pp1wire.wire.messages import Completion, Reply, Representation, Step


def status_code(value: int) -> ErrorCode:
    """The error code a peer's numeric status or ERROR code names (unknown ones: ``INTERNAL``)."""
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL


@dataclass
class ReplyAssembly:
    """One slot's outstanding STEP and the reply received for it so far."""

    step: Step
    deadline: float
    rows: list[QRow] = field(default_factory=list)
    hasher: xxhash.xxh3_64 = field(default_factory=xxhash.xxh3_64)
    nbytes: int = 0
    buffers: list[memoryview] = field(default_factory=list)
    settled: bool = False  # completed, cut or discarded: later frames of this round are late
    discarded: bool = False  # discarded or cut: its later frames are LATE_FRAME, not duplicates
    lease: Lease = field(default_factory=Lease)  # rows are readable until it is released
    counts: list[int] = field(default_factory=list)  # each row's count at its own token
    # A sharded link's: its stop-rule checks are its Spark group's (docs/tp.md §11).
    sharded: bool = False

    @property
    def rule(self) -> StopRule:
        """The STEP's stop rule (this side sent it: always a valid one)."""
        return StopRule(StopKind(self.step.stop), self.step.threshold)

    def _ended_by_eos(self, eos: int | None) -> bool:
        return bool(self.rows) and eos is not None and self.rows[-1].token == eos

    def check_row(
        self,
        msg: Reply,
        payload: memoryview,
        *,
        eos: int | None,
        validator: validate.DenseRowValidator,
        shard: tuple[int, int] | None = None,
    ) -> QRow | ErrorCode:
        """The next row as a :class:`QRow` viewing ``payload``, or the code that refuses it
        (``shard``: a sharded link's global ID range, its rows checked by §6.7's rules)."""
        step = self.step
        index = len(self.rows)
        self.sharded = shard is not None
        if msg.index != index or index >= step.depth or self._ended_by_eos(eos):
            return ErrorCode.ROW_OUT_OF_ORDER
        if self.counts and not continues(self.rule, self.counts):
            # The stop rule ended the block at the last row: this row was drawn
            # late (docs/adaptive.md §2), refused on arrival like a row after eos.
            return ErrorCode.STOP_RULE_VIOLATED
        if msg.position != step.position + index:
            return ErrorCode.WRONG_POSITION
        if (msg.start, msg.end) != (shard or (None, None)):
            return ErrorCode.SHARD_RANGE_MISMATCH
        if msg.entries == 0 and shard is None:
            return ErrorCode.MISSING_Q
        dense = step.support == 0
        if msg.representation != (Representation.DENSE if dense else Representation.SPARSE):
            return ErrorCode.BAD_REPRESENTATION
        width = validator.row_entries if shard is None else shard[1] - shard[0]
        if dense and msg.entries != width:
            return ErrorCode.ROW_LENGTH
        if not dense and msg.entries > step.support:
            return ErrorCode.SUPPORT_TOO_LARGE
        width = 4 if dense else 8
        if payload.nbytes != width * msg.entries:
            return ErrorCode.ROW_LENGTH
        if xxhash.xxh3_64_intdigest(payload) != msg.checksum:
            return ErrorCode.ROW_CHECKSUM_MISMATCH
        # The rows hold the token as a plain int: its fixed width is REPLY's wire form only.
        token, vocab = int(msg.token), validator.vocab_size
        try:
            if dense:
                q32 = np.frombuffer(payload, dtype="<f4")
                if shard is None:
                    validator.check(q32, msg.token)
                    q32 = q32[:vocab]
                else:
                    layout.check_dense_shard(q32, *shard, vocab, msg.token)
                return QRow(token=token, q32=q32, lease=self.lease)
            split = 4 * msg.entries
            ids = np.frombuffer(payload[:split], dtype="<i4")
            q = np.frombuffer(payload[split:], dtype="<f4")
            if shard is None:
                validate.check_sparse(ids, q, vocab, step.support, msg.token)
            else:
                layout.check_sparse_shard(ids, q, *shard, vocab, step.support, msg.token)
            return QRow(token=token, ids=ids, q32=q, lease=self.lease)
        except ValidationError as exc:
            return exc.code

    def add_row(self, row: QRow, raw: memoryview) -> None:
        """Take a checked row; ``raw`` (its whole frame) joins the reply's size and checksum."""
        self.rows.append(row)
        if self.rule.kind is not StopKind.FIXED and not self.sharded:
            # Counted once here: the next row's late check and the audit read it.
            self.counts.append(row.count_at(row.token))
        self.hasher.update(raw)
        self.nbytes += len(raw)
        self.buffers.append(raw)

    def check_completion(
        self, msg: Completion, *, eos: int | None, shard: tuple[int, int] | None = None
    ) -> ErrorCode | None:
        """None if COMPLETION closes this reply exactly; else the code that discards it.

        A nonzero ``status`` with no row discards with that status; after rows, the block
        is usable cut there. A block short of its depth without a terminal token needs
        ``stopped``, which needs status 0, a stop rule and a row; last, an unsharded
        link's block is audited (``docs/adaptive.md`` §2).
        """
        step = self.step
        got = len(self.rows)
        if msg.rows != got:
            return ErrorCode.COMPLETION_EARLY if msg.rows > got else ErrorCode.REPLY_SIZE_MISMATCH
        if msg.status and not got:
            return status_code(msg.status)
        rule = self.rule
        short = stopped_by_rule(step.depth, [r.token for r in self.rows], eos)
        if short and not msg.stopped and not msg.status:
            return ErrorCode.COMPLETION_EARLY
        # A rule decides only after a drawn row: no block of none is stopped.
        if msg.stopped and (msg.status or not got or not short or rule.kind is StopKind.FIXED):
            return ErrorCode.STOP_RULE_VIOLATED
        if msg.position != step.position:
            return ErrorCode.WRONG_POSITION
        if msg.context != step.context:
            return ErrorCode.CONTEXT_MISMATCH
        if (msg.start, msg.end) != (shard or (None, None)):
            return ErrorCode.SHARD_RANGE_MISMATCH
        if msg.reply_bytes != self.nbytes:
            return ErrorCode.REPLY_SIZE_MISMATCH
        if msg.reply_checksum != self.hasher.intdigest():
            return ErrorCode.REPLY_CHECKSUM_MISMATCH
        if rule.kind is not StopKind.FIXED and not msg.status and shard is None:
            # Late rows were refused on arrival; this finds a block cut early (a
            # sharded link's block is audited by its group).
            return audit(rule, step.depth, self.counts, [r.token for r in self.rows], eos)
        return None

    def proposal(
        self,
        session: int,
        rows: tuple[QRow, ...],
        shard: tuple[int, int] | None = None,
        cut: ErrorCode | None = None,
    ) -> Proposal:
        """The validated proposal of ``rows`` (``cut``: the fault that ended it after them)."""
        st = self.step
        at = (st.generation, st.round, st.position, st.digest, st.depth)
        return Proposal(session, *at, rows, st.context, shard, self.rule, cut)

    def settle(self, *, discarded: bool) -> list[memoryview]:
        """Mark the reply settled (later frames are late) and hand back its buffers."""
        self.settled = True
        self.discarded = discarded
        buffers, self.buffers = self.buffers, []
        return buffers
