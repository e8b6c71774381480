"""The Spark side's sans-IO core: fail closed, drop late frames, publish only after COMPLETION."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode, LocalStateError, ProposalReleasedError, ProtocolError
from pp1wire.q.verify import RequestVerifier
from pp1wire.wire import framing, messages
from pp1wire.wire.messages import MsgType, Scope
from pp1wire.wire.spark_events import (
    CommitAcked,
    ConnectionFailed,
    FrameDropped,
    ProposalFailed,
    ProposalReady,
    ResetAcked,
    SlotDesynced,
)

from .pairs import VOCAB, make_pair, next_round, step, verifier

PREFIX = [1, 2, 3]


def opened(**kw):
    pair = make_pair(**kw)
    pair.spark.open_slot(0, seed=5, prefix=PREFIX)
    pair.pump()
    return pair


def split_frames(chunks: list[bytes]) -> list[bytes]:
    decoder = framing.FrameDecoder(1 << 24)
    return [bytes(f.raw) for c in chunks for f in decoder.feed(c)]


def held_reply(pair, **step_kw):
    """Send a STEP to the worker but hold its reply frames (not yet delivered)."""
    r = step(
        pair.spark,
        0,
        depth=step_kw.get("depth", 3),
        temperature=1.0,
        support=step_kw.get("support", 0),
        now=pair.now,
    )
    for chunk in pair.spark.data_to_send():
        pair.worker.receive_data(chunk, pair.now)
    return r, split_frames(pair.worker.data_to_send())


def deliver(pair, frames):
    events = []
    for f in frames:
        events += pair.spark.receive_data(f, pair.now)
    return events


def test_proposal_is_published_only_after_completion():
    pair = opened()
    _, frames = held_reply(pair)
    assert deliver(pair, frames[:-1]) == []
    (ready,) = deliver(pair, frames[-1:])
    assert isinstance(ready, ProposalReady)
    assert len(ready.proposal.rows) == 3


def test_reply_timeout_discards_and_late_rows_are_dropped():
    pair = opened(spark_kw={"reply_timeout": 1.0})
    r, frames = held_reply(pair)
    assert pair.spark.next_deadline() == 1.0
    assert pair.spark.handle_timer(0.5) == []
    (failed,) = pair.spark.handle_timer(1.0)
    assert failed == ProposalFailed(0, 0, r, ErrorCode.REPLY_TIMEOUT)
    late = deliver(pair, frames)
    assert late == [FrameDropped(0, ErrorCode.LATE_FRAME)] * len(frames)
    # The next round works normally (after a target-only commit).
    pair.spark.commit(0, round_id=next_round(pair.spark, 0), tokens=[4], accepted=0)
    pair.pump()
    _, frames = held_reply(pair)
    assert any(isinstance(e, ProposalReady) for e in deliver(pair, frames))


def test_reset_mid_reply_discards_and_old_frames_are_dropped():
    pair = opened()
    r, frames = held_reply(pair)
    deliver(pair, frames[:1])
    generation = pair.spark.reset(0)
    events = pair.pump()
    assert ResetAcked(0, generation, len(PREFIX)) in events
    assert ProposalFailed(0, 0, r, ErrorCode.CANCELLED) in events
    late = deliver(pair, frames[1:])
    assert all(isinstance(e, FrameDropped) and e.code is ErrorCode.STALE_GENERATION for e in late)
    assert len(late) == len(frames) - 1
    _, frames = held_reply(pair)
    assert any(isinstance(e, ProposalReady) for e in deliver(pair, frames))


def test_worker_refusal_fails_the_in_flight_proposal():
    pair = opened()
    pair.worker.slots[0].hasher.extend([1])  # the worker now disagrees about the prefix
    r = step(pair.spark, 0, depth=2, temperature=1.0, support=0, now=0.0)
    events = pair.pump()
    assert events == [ProposalFailed(0, 0, r, ErrorCode.PREFIX_DIGEST_MISMATCH)]


def assert_step_refused_locally(pair, code):
    """STEP raises LocalStateError with ``code`` and queues nothing."""
    with pytest.raises(LocalStateError) as info:
        step(pair.spark, 0, depth=2, temperature=1.0, support=0, now=0.0)
    assert info.value.code is code
    assert pair.spark.data_to_send() == []


def test_connection_loss_fails_everything_in_flight():
    pair = opened()
    r, _ = held_reply(pair)
    events = pair.spark.connection_lost()
    assert ProposalFailed(0, 0, r, ErrorCode.CONNECTION_LOST) in events
    assert ConnectionFailed(ErrorCode.CONNECTION_LOST) in events
    assert_step_refused_locally(pair, ErrorCode.NOT_READY)


def test_commit_must_match_the_drafts():
    pair = opened()
    _, frames = held_reply(pair)
    (ready,) = deliver(pair, frames)
    drafts = list(ready.proposal.tokens)
    wrong = (drafts[0] + 1) % VOCAB
    with pytest.raises(ProtocolError) as info:
        pair.spark.commit(0, round_id=ready.proposal.round_id, tokens=[wrong, 1], accepted=1)
    assert info.value.code is ErrorCode.COMMIT_INVALID


def test_one_proposal_in_flight_per_slot():
    pair = opened()
    held_reply(pair)
    assert_step_refused_locally(pair, ErrorCode.SLOT_BUSY)


def test_corrupted_row_falls_back_and_next_round_works():
    pair = opened()
    r, frames = held_reply(pair)
    bad = bytearray(frames[0])
    bad[-1] ^= 0x01  # flip a payload bit: the row checksum no longer matches
    events = deliver(pair, [bytes(bad), *frames[1:]])
    assert events[1] == ProposalFailed(0, 0, r, ErrorCode.ROW_CHECKSUM_MISMATCH)
    pair.spark.commit(0, round_id=next_round(pair.spark, 0), tokens=[7], accepted=0)
    assert any(isinstance(e, CommitAcked) for e in pair.pump())
    _, frames = held_reply(pair)
    assert any(isinstance(e, ProposalReady) for e in deliver(pair, frames))


class FencingMachine(RuleBasedStateMachine):
    """Random interleavings of STEP, partial delivery, duplicates, RESET, COMMIT, reconnect.

    Invariants: a stale generation is never accepted; a retried STEP is either
    answered byte-identically or refused; RESET invalidates every in-flight row;
    a proposal is consumable only after a validated COMPLETION; both sides agree
    on the committed prefix whenever nothing is in flight.
    """

    @initialize()
    def setup(self):
        self.target = ToyLM(VOCAB, 1)
        self.committed = list(PREFIX)
        self.connect()

    def connect(self):
        self.pair = make_pair()
        self.pair.spark.open_slot(0, seed=5, prefix=self.committed)
        self.pair.pump()
        self.held: list[bytes] = []
        self.delivered: list[bytes] = []
        self.step_bytes: bytes | None = None
        self.first_reply: bytes | None = None
        self.ready = None
        self.stale: list[bytes] = []

    def _feed(self, frames):
        events = deliver(self.pair, frames)
        for e in events:
            if isinstance(e, ProposalReady):
                assert self.ready is None
                assert e.proposal.generation == self.pair.spark.slots[0].fence.generation
                self.ready = e.proposal
        return events

    @precondition(lambda self: self.pair.spark.slots[0].flight is None and self.ready is None)
    @rule(depth=st.integers(1, 5), sparse=st.booleans())
    def step(self, depth, sparse):
        step(self.pair.spark, 0, depth=depth, temperature=1.0, support=8 if sparse else 0, now=0.0)
        (self.step_bytes,) = self.pair.spark.data_to_send()
        self.pair.worker.receive_data(self.step_bytes, 0.0)
        self.first_reply = b"".join(self.pair.worker.data_to_send())
        self.held = split_frames([self.first_reply])
        self.delivered = []

    @precondition(lambda self: self.held)
    @rule(n=st.integers(1, 3))
    def deliver_some(self, n):
        frames, self.held = self.held[:n], self.held[n:]
        completion_in = any(f[3] == MsgType.COMPLETION for f in frames)
        events = self._feed(frames)
        if any(isinstance(e, ProposalReady) for e in events):
            assert completion_in
        self.delivered += frames

    @precondition(lambda self: self.delivered)
    @rule(i=st.integers(0, 10))
    def duplicate(self, i):
        frame = self.delivered[i % len(self.delivered)]
        rows = sum(f[3] == MsgType.REPLY for f in self.delivered)
        events = self._feed([frame])
        for e in events:
            if isinstance(e, ProposalReady):
                # A frame delivered twice never completes a block: a repeated row is
                # refused, which ends the block before it (a cut) with the rows
                # delivered once, in order (docs/adaptive.md section 7).
                assert e.proposal.cut is ErrorCode.ROW_OUT_OF_ORDER
                assert len(e.proposal.rows) == rows

    @precondition(lambda self: self.step_bytes is not None)
    @rule()
    def retry_step(self):
        self.pair.worker.receive_data(self.step_bytes, 0.0)
        again = b"".join(self.pair.worker.data_to_send())
        if again != self.first_reply:
            kinds = [f[3] for f in split_frames([again])]
            assert kinds == [MsgType.ERROR]

    @precondition(lambda self: self.stale)
    @rule()
    def deliver_stale(self):
        events = self._feed(self.stale)
        assert all(isinstance(e, FrameDropped) for e in events)
        self.stale = []

    @rule()
    def reset(self):
        self.stale += self.held
        self.held = []
        self.ready = None
        self.step_bytes = None
        self.pair.spark.reset(0)
        self.pair.pump()

    @precondition(lambda self: self.ready is not None)
    @rule()
    def verify_and_commit(self):
        spark = self.pair.spark
        v = RequestVerifier(
            session=spark.session,
            seed=5,
            vocab_size=VOCAB,
            prefix=self.committed,
            target=self.target.probs,
            generation=spark.slots[0].fence.generation,
        )
        v.last_round = self.ready.round_id - 1
        result = v.verify(self.ready)
        spark.commit(0, round_id=result.round_id, tokens=result.tokens, accepted=result.accepted)
        self.committed += result.tokens
        self.ready = None
        self.stale += self.held
        self.held = []
        self.step_bytes = None
        assert any(isinstance(e, CommitAcked) for e in self.pair.pump())

    @precondition(lambda self: self.pair.spark.slots[0].flight is None and self.ready is None)
    @rule(token=st.integers(0, VOCAB - 1))
    def target_only(self, token):
        spark = self.pair.spark
        spark.commit(0, round_id=next_round(spark, 0), tokens=[token], accepted=0)
        self.committed.append(token)
        self.stale += self.held
        self.held = []
        self.step_bytes = None
        assert any(isinstance(e, CommitAcked) for e in self.pair.pump())

    @rule()
    def reconnect(self):
        self.pair.spark.connection_lost()
        self.pair.worker.connection_lost()
        self.connect()

    @invariant()
    def prefixes_agree(self):
        if self.pair.spark.slots.get(0) is not None:
            assert list(self.pair.spark.slots[0].prefix) == self.committed
            assert list(self.pair.worker.slots[0].prefix) == self.committed


TestFencing = FencingMachine.TestCase
TestFencing.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


def test_late_frames_of_a_closed_slot_instance_are_never_consumed():
    # Found by the chaos run: a slot closed and reopened on one connection must not
    # accept the late reply of its earlier instance, even for the same round number.
    pair = opened()
    _, old_frames = held_reply(pair)
    pair.spark.close_slot(0)
    pair.pump()
    generation = pair.spark.open_slot(0, seed=6, prefix=PREFIX)
    pair.pump()
    assert generation == 1
    r, new_frames = held_reply(pair)
    assert r == 0  # the same round number as the old reply
    stale = deliver(pair, old_frames)
    assert all(isinstance(e, FrameDropped) and e.code is ErrorCode.STALE_GENERATION for e in stale)
    (ready,) = deliver(pair, new_frames)
    assert isinstance(ready, ProposalReady)
    assert ready.proposal.generation == 1


def test_reopening_needs_a_higher_generation():
    pair = opened()
    pair.spark.close_slot(0)
    pair.pump()
    with pytest.raises(ProtocolError) as info:
        pair.spark.open_slot(0, seed=6, prefix=PREFIX, generation=0)
    assert info.value.code is ErrorCode.STALE_GENERATION


def test_automatic_generation_respects_both_the_floor_and_a_minimum():
    pair = opened()
    pair.spark.close_slot(0)
    pair.pump()
    assert pair.spark.open_slot(0, seed=6, prefix=PREFIX, at_least=5) == 5  # new minimum wins
    pair.pump()
    pair.spark.close_slot(0)
    pair.pump()
    assert pair.spark.open_slot(0, seed=6, prefix=PREFIX, at_least=5) == 6  # the floor wins


def test_a_released_proposal_cannot_be_read():
    # The rows view the receive buffers; once released, those buffers carry
    # later replies, so reading the old q must be an error, not another round's q.
    pair = opened()
    step(pair.spark, 0, depth=3, temperature=1.0, support=0, now=0.0)
    (ready,) = [e for e in pair.pump() if isinstance(e, ProposalReady)]
    proposal = ready.proposal
    assert proposal.rows[0].q32 is not None  # readable while held
    pair.spark.release_proposal(0, proposal.round_id)
    for read in (
        lambda row: row.q32,
        lambda row: row.ids,
        lambda row: row.count_at(row.token),
        lambda row: row.dense_q(VOCAB),
    ):
        with pytest.raises(ProposalReleasedError, match="released"):
            read(proposal.rows[0])
    assert proposal.tokens == tuple(r.token for r in proposal.rows)  # tokens are copies
    request = verifier(pair, 5, PREFIX)
    with pytest.raises(ProposalReleasedError):
        request.verify(proposal)


def test_spark_errors_answer_the_message_that_failed():
    # A worker HELLO the Spark side refuses: its fatal ERROR answers HELLO (type 1).
    pair = make_pair(handshake=False)
    pair.spark.start(0.0)
    pair.spark.data_to_send()
    theirs = msgspec.structs.replace(
        pair.spark._hello, role=1, session=7, target_identity="another-target"
    )
    pair.spark.receive_data(framing.encode_frame(theirs), 0.0)
    (err,) = framing.FrameDecoder(1 << 20).feed(b"".join(pair.spark.data_to_send()))
    assert err.message.code == ErrorCode.IDENTITY_MISMATCH
    assert err.message.answers == int(MsgType.HELLO)
    assert err.message.scope == 2


def test_a_desynced_slot_refuses_local_calls_with_its_own_code():
    pair = opened()
    refusal = messages.Error(
        code=int(ErrorCode.COMMIT_INVALID),
        answers=int(MsgType.COMMIT),
        scope=int(Scope.SLOT),
        slot=0,
        generation=0,
    )
    events = pair.spark.receive_data(framing.encode_frame(refusal), pair.now)
    assert SlotDesynced(0, ErrorCode.COMMIT_INVALID) in events
    for call in (
        lambda: step(pair.spark, 0, depth=2, temperature=1.0, support=0, now=0.0),
        lambda: next_round(pair.spark, 0),
        lambda: pair.spark.commit(0, round_id=0, tokens=[1], accepted=0),
    ):
        with pytest.raises(LocalStateError) as info:
            call()
        assert info.value.code is ErrorCode.SLOT_DESYNCED
    assert pair.spark.data_to_send() == []
    pair.spark.close_slot(0)
    pair.spark.open_slot(0, seed=5, prefix=PREFIX)
    pair.pump()
    step(pair.spark, 0, depth=2, temperature=1.0, support=0, now=0.0)


# -- faults end a block; answers are owed in time (docs/adaptive.md section 7) ---------


def test_a_corrupt_row_after_a_valid_one_cuts_the_block_to_the_valid_row():
    pair = opened()
    _r, frames = held_reply(pair, depth=3)
    bad = bytearray(frames[1])
    bad[-1] ^= 0x01  # row 1's payload no longer matches its checksum
    events = deliver(pair, [frames[0], bytes(bad), *frames[2:]])
    ready = [e for e in events if isinstance(e, ProposalReady)]
    assert len(ready) == 1
    assert ready[0].proposal.cut is ErrorCode.ROW_CHECKSUM_MISMATCH
    assert len(ready[0].proposal.rows) == 1
    dropped = [e.code for e in events if isinstance(e, FrameDropped)]
    assert dropped == [ErrorCode.LATE_FRAME] * 2  # row 2 and the COMPLETION


def test_the_reply_deadline_cuts_at_the_rows_that_arrived_and_later_frames_are_late():
    pair = opened(spark_kw={"reply_timeout": 1.0})
    _r, frames = held_reply(pair, depth=3)
    deliver(pair, frames[:2])
    assert pair.spark.next_deadline() == pytest.approx(pair.now + 1.0)
    events = pair.spark.handle_timer(pair.now + 1.0)
    (ready,) = events
    assert isinstance(ready, ProposalReady)
    assert ready.proposal.cut is ErrorCode.REPLY_TIMEOUT
    assert ready.proposal.tokens == tuple(
        framing.FrameDecoder(1 << 20).feed(f)[0].message.token for f in frames[:2]
    )
    late = deliver(pair, frames[2:])
    assert [e.code for e in late] == [ErrorCode.LATE_FRAME] * 2


def test_cut_stops_waiting_now_with_the_rows_that_arrived_or_fails_without_any():
    pair = opened()
    r, frames = held_reply(pair, depth=3)
    deliver(pair, frames[:1])
    (ready,) = pair.spark.cut(0, ErrorCode.SHUTTING_DOWN)
    assert ready.proposal.cut is ErrorCode.SHUTTING_DOWN
    assert len(ready.proposal.rows) == 1
    assert pair.spark.cut(0) == []  # nothing in flight any more
    pair.spark.commit(0, round_id=r, tokens=[ready.proposal.tokens[0], 5], accepted=1)
    pair.pump()
    r, _ = held_reply(pair, depth=3)
    (failed,) = pair.spark.cut(0)
    assert failed == ProposalFailed(0, 0, r, ErrorCode.REPLY_TIMEOUT)


def test_a_connection_that_ends_after_rows_cuts_the_block_by_the_code_that_ended_it():
    # §6.5: CONNECTION_LOST when the stream ends; the framing code of a frame this
    # side refused fatally; the code of the worker's connection-scoped ERROR.
    ends = {
        ErrorCode.CONNECTION_LOST: lambda pair: pair.spark.connection_lost(),
        ErrorCode.BAD_MAGIC: lambda pair: pair.spark.receive_data(b"XX" + b"\0" * 14, pair.now),
        ErrorCode.GROUP_FAILED: lambda pair: pair.spark.receive_data(
            framing.encode_frame(
                messages.Error(code=int(ErrorCode.GROUP_FAILED), answers=0, scope=2)
            ),
            pair.now,
        ),
    }
    for code, end in ends.items():
        pair = opened()
        _r, frames = held_reply(pair, depth=3)
        deliver(pair, frames[:1])
        (ready,) = [e for e in end(pair) if isinstance(e, ProposalReady)]
        assert ready.proposal.cut is code
        assert len(ready.proposal.rows) == 1


def test_a_failure_reported_after_rows_is_a_block_cut_by_its_status():
    pair = opened()
    _r, frames = held_reply(pair, depth=3)
    # The worker drew row 0, then its drafter failed: it ships row 0 with the status.
    from pp1wire.testing.builders import completion

    step_msg = pair.spark.slots[0].flight.step
    fail = completion(step_msg, frames[0], 1, status=int(ErrorCode.INTERNAL))
    events = deliver(pair, [frames[0], fail])
    (ready,) = [e for e in events if isinstance(e, ProposalReady)]
    assert ready.proposal.cut is ErrorCode.INTERNAL
    assert len(ready.proposal.rows) == 1


def test_an_unanswered_open_ends_the_connection_at_the_reply_timeout():
    pair = make_pair(spark_kw={"reply_timeout": 2.0})
    pair.spark.open_slot(0, seed=5, prefix=PREFIX, now=10.0)
    pair.spark.data_to_send()  # the worker never sees it: it is mute
    assert pair.spark.next_deadline() == 12.0
    assert pair.spark.handle_timer(11.9) == []
    events = pair.spark.handle_timer(12.0)
    assert ConnectionFailed(ErrorCode.ANSWER_TIMEOUT) in events
    assert pair.spark.closed


def test_answers_settle_what_is_owed_slot_by_slot():
    pair = make_pair(spark_kw={"reply_timeout": 2.0})
    for slot in (0, 1):
        pair.spark.open_slot(slot, seed=5, prefix=PREFIX, now=0.0)
    pair.pump()  # both OPENED
    assert pair.spark.next_deadline() is None
    pair.spark.close_slot(1, now=0.0)
    pair.pump()  # CLOSED
    v = verifier(pair, 5, PREFIX)
    r, frames = held_reply(pair, depth=2)
    (ready,) = [e for e in deliver(pair, frames) if isinstance(e, ProposalReady)]
    res = v.verify(ready.proposal)
    pair.spark.commit(0, round_id=r, tokens=res.tokens, accepted=res.accepted, now=0.0)
    assert pair.spark.next_deadline() == 2.0  # COMMITTED owed
    pair.pump()
    assert pair.spark.next_deadline() is None
    pair.spark.reset(0, now=5.0)
    pair.spark.data_to_send()  # never delivered
    assert ConnectionFailed(ErrorCode.ANSWER_TIMEOUT) in pair.spark.handle_timer(7.0)
