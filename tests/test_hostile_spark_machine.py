"""A hostile Spark peer against the worker core, with accepted commits.

The refusal property tests (``test_refusals_change_nothing.py``) never got a
COMMIT accepted, so no sequence they produced moved a prefix under a pending
STEP. This machine plays a peer that mostly follows the protocol (it knows the
drafts it was sent and commits them, so commits really land) and keeps trying
what a hostile one would: rounds below, at and above the pending STEP, commits
below it, retries of every STEP it ever got an answer to, resets, reopenings,
wrong positions and digests.

Invariants after every message:

* no exception escapes the core, and the connection stays open (every message
  is well formed, so nothing here is fatal);
* a message answered with an ERROR changed nothing a later message can observe;
* the committed prefix is exactly what the COMMITTEDs said: each new COMMITTED
  names the length and digest of the prefix before it plus the tokens that
  COMMIT carried, and the worker's slot holds exactly those tokens;
* a retried STEP is answered with the byte-identical reply it got before, or
  refused with one ERROR; never with a fresh draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from pp1wire.q.proposal import prefix_digest
from pp1wire.testing.builders import open_message, token_bytes
from pp1wire.wire import framing
from pp1wire.wire.messages import (
    Close,
    Commit,
    Committed,
    Error,
    Message,
    MsgType,
    Reset,
    Scope,
    Step,
)

from .pairs import VOCAB, make_pair
from .test_refusals_change_nothing import worker_state

SLOTS = 2
EOS = 5
SESSION = 7


@dataclass
class ModelSlot:
    """What the peer knows of one open slot."""

    generation: int
    prefix: list[int]
    eos: int | None
    # The last STEP the worker answered with rows, and its drafts.
    step: Step | None = None
    drafts: tuple[int, ...] = ()
    last_round: int = -1  # the highest round this peer used in this generation
    last_commit: Commit | None = None
    last_ack: bytes = b""


@dataclass
class Answered:
    """A STEP and the exact bytes it was answered with."""

    step: Step
    reply: bytes


@dataclass
class Peer:
    slots: dict[int, ModelSlot] = field(default_factory=dict)
    generations: dict[int, int] = field(default_factory=dict)


def _frames(data: bytes) -> list[framing.Frame]:
    return framing.FrameDecoder(1 << 24).feed(data)


class HostileSpark(RuleBasedStateMachine):
    answered = Bundle("answered")

    def __init__(self) -> None:
        super().__init__()
        self.pair = make_pair(spark_kw={"max_slots": SLOTS})
        self.worker = self.pair.worker
        self.peer = Peer()

    # -- sending ---------------------------------------------------------------------

    def send(self, msg: Message, payload: bytes = b"") -> list[framing.Frame]:
        """Send one message; check that a refusal changed nothing; return the answer."""
        before = worker_state(self.worker)
        self.worker.receive_data(framing.encode_frame(msg, payload), 0.0)  # must not raise
        data = b"".join(self.worker.data_to_send())
        frames = _frames(data)
        assert not self.worker.closed, [f.message for f in frames]
        if frames and frames[0].type is MsgType.ERROR:
            err = frames[0].message
            assert isinstance(err, Error)
            assert len(frames) == 1, [f.message for f in frames]
            assert err.scope == Scope.MESSAGE
            assert worker_state(self.worker) == before, (msg, err)
        self.last_bytes = data
        return frames

    # -- slots -----------------------------------------------------------------------

    @initialize()
    def open_every_slot(self) -> None:
        for slot in range(SLOTS):
            self.open(slot, 0, [1, 2, 3], eos=slot == 1)

    @rule(
        slot=st.integers(0, SLOTS - 1),
        bump=st.integers(-1, 2),
        prefix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
        eos=st.booleans(),
    )
    def open(self, slot: int, bump: int, prefix: list[int], eos: bool) -> None:
        generation = max(0, self.peer.generations.get(slot, -1) + bump)
        msg = open_message(SESSION, slot, prefix, generation=generation, eos=EOS if eos else None)
        frames = self.send(msg, token_bytes(prefix))
        if frames[0].type is MsgType.OPENED and slot not in self.peer.slots:
            self.peer.slots[slot] = ModelSlot(generation, list(prefix), msg.eos)
            self.peer.generations[slot] = generation

    @precondition(lambda self: self.peer.slots)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.peer.slots)))
        frames = self.send(Close(session=SESSION, slot=slot))
        assert frames[0].type is MsgType.CLOSED
        del self.peer.slots[slot]

    @precondition(lambda self: self.peer.slots)
    @rule(data=st.data(), bump=st.integers(-1, 1))
    def reset(self, data: st.DataObject, bump: int) -> None:
        slot = data.draw(st.sampled_from(sorted(self.peer.slots)))
        m = self.peer.slots[slot]
        generation = max(0, m.generation + bump)
        frames = self.send(Reset(session=SESSION, slot=slot, generation=generation))
        if frames[0].type is MsgType.RESET_DONE and generation > m.generation:
            m.generation = generation
            self.peer.generations[slot] = generation
            m.step, m.drafts, m.last_round, m.last_commit = None, (), -1, None

    # -- STEP --------------------------------------------------------------------------

    @precondition(lambda self: self.peer.slots)
    @rule(
        target=answered,
        data=st.data(),
        round_move=st.sampled_from([-1, 0, 1, 1, 1, 2, 2, 3]),
        depth=st.integers(1, 5),
        spoil=st.sampled_from([*[None] * 8, "position", "digest", "depth", "context"]),
    )
    def step(self, data: st.DataObject, round_move: int, depth: int, spoil: str | None) -> object:
        slot = data.draw(st.sampled_from(sorted(self.peer.slots)))
        m = self.peer.slots[slot]
        msg = Step(
            session=SESSION,
            slot=slot,
            generation=m.generation,
            round=max(0, m.last_round + round_move),
            position=len(m.prefix),
            digest=prefix_digest(m.prefix),
            depth=depth,
            temperature=1.0,
            support=0,
            context=0,
        )
        if spoil == "position":
            msg = msgspec.structs.replace(msg, position=msg.position + 1)
        elif spoil == "digest":
            msg = msgspec.structs.replace(msg, digest=msg.digest ^ 1)
        elif spoil == "depth":
            msg = msgspec.structs.replace(msg, depth=6)
        elif spoil == "context":
            msg = msgspec.structs.replace(msg, context=1)
        frames = self.send(msg)
        if frames[0].type is MsgType.ERROR:
            return multiple()
        assert frames[-1].type is MsgType.COMPLETION
        m.last_round = max(m.last_round, msg.round)
        m.step = msg
        m.drafts = tuple(f.message.token for f in frames if f.type is MsgType.REPLY)
        return Answered(msg, self.last_bytes)

    @rule(prior=answered)
    def retry_step(self, prior: Answered) -> None:
        frames = self.send(prior.step)
        if frames[0].type is not MsgType.ERROR:
            assert self.last_bytes == prior.reply, "a retried STEP was drawn afresh"

    # -- COMMIT ------------------------------------------------------------------------

    def _commit(self, slot: int, msg: Commit, new: list[int]) -> None:
        m = self.peer.slots[slot]
        frames = self.send(msg)
        if frames[0].type is not MsgType.COMMITTED:
            return
        ack = frames[0].message
        assert isinstance(ack, Committed)
        if msg == m.last_commit:
            assert self.last_bytes == m.last_ack  # a replayed COMMITTED
            return
        expected = m.prefix + new
        assert (ack.position, ack.digest) == (len(expected), prefix_digest(expected))
        assert (ack.generation, ack.round) == (msg.generation, msg.round)
        m.prefix = expected
        m.last_round = max(m.last_round, msg.round)
        m.last_commit, m.last_ack = msg, self.last_bytes
        m.step, m.drafts = None, ()

    @precondition(lambda self: any(m.drafts for m in self.peer.slots.values()))
    @rule(data=st.data(), extra=st.integers(0, VOCAB - 1), spoil=st.integers(0, 9))
    def commit_drafts(self, data: st.DataObject, extra: int, spoil: int) -> None:
        """Commit some of the last proposal's drafts, as an honest peer would (mostly)."""
        slot = data.draw(st.sampled_from(sorted(s for s, m in self.peer.slots.items() if m.drafts)))
        m = self.peer.slots[slot]
        assert m.step is not None
        accepted = data.draw(st.integers(0, len(m.drafts)))
        stop = accepted and m.eos is not None and m.drafts[accepted - 1] == m.eos
        extra_or_none = None if stop and data.draw(st.booleans()) else extra
        new = list(m.drafts[:accepted]) + ([] if extra_or_none is None else [extra_or_none])
        msg = Commit(
            session=SESSION,
            slot=slot,
            generation=m.generation,
            round=m.step.round,
            accepted=accepted,
            extra=extra_or_none,
            position=len(m.prefix) + len(new),
            digest=prefix_digest(m.prefix + new),
        )
        if spoil == 0:
            msg = msgspec.structs.replace(msg, accepted=len(m.drafts) + 1)
        elif spoil == 1:
            msg = msgspec.structs.replace(msg, position=msg.position + 1)
        elif spoil == 2:
            msg = msgspec.structs.replace(msg, digest=msg.digest ^ 1)
        elif spoil == 3:
            msg = msgspec.structs.replace(msg, extra=None)
        self._commit(slot, msg, new)

    @precondition(lambda self: self.peer.slots)
    @rule(
        data=st.data(),
        round_move=st.sampled_from([-2, -1, 0, 1, 1, 2]),
        extra=st.integers(0, VOCAB),
    )
    def commit_target_only(self, data: st.DataObject, round_move: int, extra: int) -> None:
        """A target-only commit at rounds around the last one, some below a pending STEP."""
        slot = data.draw(st.sampled_from(sorted(self.peer.slots)))
        m = self.peer.slots[slot]
        new = [extra]
        msg = Commit(
            session=SESSION,
            slot=slot,
            generation=m.generation,
            round=max(0, m.last_round + round_move),
            accepted=0,
            extra=extra,
            position=len(m.prefix) + 1,
            digest=prefix_digest(m.prefix + new),
        )
        self._commit(slot, msg, new)

    @precondition(lambda self: any(m.last_commit for m in self.peer.slots.values()))
    @rule(data=st.data())
    def retry_commit(self, data: st.DataObject) -> None:
        slot = data.draw(
            st.sampled_from(sorted(s for s, m in self.peer.slots.items() if m.last_commit))
        )
        m = self.peer.slots[slot]
        assert m.last_commit is not None
        self._commit(slot, m.last_commit, [])

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def prefixes_are_what_was_committed(self) -> None:
        for slot, m in self.peer.slots.items():
            held = self.worker.slots[slot]
            assert list(held.prefix) == m.prefix
            assert held.digest == prefix_digest(m.prefix)
            assert held.fence.generation == m.generation


HostileSpark.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_a_hostile_spark_peer_with_accepted_commits = HostileSpark.TestCase
