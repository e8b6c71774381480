"""The worker's sans-IO core: handshake, fencing, replay and refusals (exact codes)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pp1wire.errors import ErrorCode
from pp1wire.q.proposal import DraftingStoppedError, prefix_digest
from pp1wire.q.rng import Role
from pp1wire.testing.builders import open_message, reply_step
from pp1wire.wire import framing
from pp1wire.wire.handshake import build_hello
from pp1wire.wire.messages import (
    WIRE_VERSION,
    Auth,
    Close,
    Commit,
    Error,
    Hello,
    MsgType,
    Ping,
    Pong,
    Reset,
    Scope,
)
from pp1wire.wire.spark_events import ProposalReady
from pp1wire.wire.transitions import State
from pp1wire.wire.worker_core import (
    ConnectionClosing,
    DrawRequested,
    Refused,
    StepReplayed,
    StepServed,
    WorkerConfig,
)

from .pairs import VOCAB, make_pair

PREFIX = [1, 2, 3]


def frames_of(chunks: list[bytes]) -> list:
    decoder = framing.FrameDecoder(1 << 24)
    return [f for c in chunks for f in decoder.feed(c)]


def open_slot(pair, slot=0, prefix=PREFIX, seed=5, **kw):
    pair.spark.open_slot(slot, seed=seed, prefix=prefix, **kw)
    pair.pump()


def step(**over):
    """A STEP on slot 0 of session 7 at PREFIX, depth 3, dense (any field overridden)."""
    return msgspec.structs.replace(reply_step(0, depth=3), **over)


def ready_pair(**kw):
    pair = make_pair(**kw)
    open_slot(pair)
    return pair


def reply_bytes(pair, msg) -> bytes:
    pair.send_raw(msg)
    return b"".join(pair.worker.data_to_send())


def error_of(data: bytes) -> Error:
    (frame,) = frames_of([data])
    assert isinstance(frame.message, Error)
    return frame.message


# -- handshake ---------------------------------------------------------------------


def test_handshake_assigns_session_and_limits():
    pair = make_pair()
    assert pair.spark.state is State.READY
    assert pair.spark.session == 7
    assert pair.worker.state is State.READY


def _spark_hello(pair, **over) -> Hello:
    pair.spark.start(0.0)
    ours = pair.spark._hello
    return msgspec.structs.replace(ours, **over)


def _fatal_code(pair) -> ErrorCode:
    err = error_of(b"".join(pair.worker.data_to_send()))
    assert err.scope == Scope.CONNECTION
    assert pair.worker.closed
    return ErrorCode(err.code)


def test_message_before_hello_is_refused():
    pair = make_pair(handshake=False)
    pair.send_raw(step())
    assert _fatal_code(pair) is ErrorCode.HANDSHAKE_REQUIRED


def test_second_hello_is_refused():
    pair = make_pair()
    pair.send_raw(pair.spark._hello)
    assert _fatal_code(pair) is ErrorCode.DUPLICATE_HELLO


@pytest.mark.parametrize(
    ("over", "code"),
    [
        ({"wire_version": WIRE_VERSION + 1}, ErrorCode.WIRE_VERSION_MISMATCH),
        ({"q_semantic": "dyadic16-v1"}, ErrorCode.Q_SEMANTIC_MISMATCH),
        ({"verifier": "other-verifier"}, ErrorCode.VERIFIER_MISMATCH),
        ({"rng_abi": "pp1-philox4x32-10-v0"}, ErrorCode.RNG_ABI_MISMATCH),
        ({"precision": "bf16"}, ErrorCode.PRECISION_MISMATCH),
        ({"vocab_size": VOCAB + 1, "row_entries": VOCAB + 1}, ErrorCode.VOCAB_SIZE_MISMATCH),
        ({"vocab_hash": 99}, ErrorCode.VOCAB_HASH_MISMATCH),
        ({"target_identity": "another-target"}, ErrorCode.IDENTITY_MISMATCH),
        ({"draft_identity": "another-drafter"}, ErrorCode.IDENTITY_MISMATCH),
        ({"max_slots": 5}, ErrorCode.LIMIT_EXCEEDED),
        ({"max_support": 48}, ErrorCode.LIMIT_EXCEEDED),
        ({"row_entries": VOCAB + 4}, ErrorCode.LIMIT_EXCEEDED),
        ({"max_prefix": (1 << 20) + 1}, ErrorCode.LIMIT_EXCEEDED),
        ({"role": 1}, ErrorCode.UNEXPECTED_MESSAGE),
    ],
)
def test_hello_mismatch_is_refused(over, code):
    pair = make_pair(handshake=False, worker_kw={"max_support": 32}, spark_kw={"max_support": 32})
    pair.send_raw(_spark_hello(pair, **over))
    assert _fatal_code(pair) is code
    assert pair.worker.slots == {}


def test_handshake_timeout():
    pair = make_pair(handshake=False)
    assert pair.worker.next_deadline() == 5.0
    assert pair.worker.handle_timer(4.9) == []
    events = pair.worker.handle_timer(5.0)
    assert ConnectionClosing(ErrorCode.HANDSHAKE_TIMEOUT) in events
    assert _fatal_code(pair) is ErrorCode.HANDSHAKE_TIMEOUT


def test_idle_timeout():
    pair = make_pair(worker_kw={"idle_timeout": 10.0})
    pair.worker.handle_timer(9.0)
    assert not pair.worker.closed
    pair.worker.handle_timer(10.0)
    assert _fatal_code(pair) is ErrorCode.IDLE_TIMEOUT


def test_pings_alone_do_not_keep_a_connection_alive():
    pair = make_pair(worker_kw={"idle_timeout": 10.0})
    for t in (3.0, 6.0, 9.0):
        pair.now = t
        pair.send_raw(Ping(nonce=int(t)))
        pair.worker.data_to_send()
    pair.worker.handle_timer(10.0)
    assert _fatal_code(pair) is ErrorCode.IDLE_TIMEOUT


def test_real_work_keeps_a_connection_alive():
    pair = make_pair(worker_kw={"idle_timeout": 10.0})
    pair.now = 6.0
    open_slot(pair)
    pair.worker.handle_timer(15.0)
    assert not pair.worker.closed
    pair.worker.handle_timer(16.0)
    assert _fatal_code(pair) is ErrorCode.IDLE_TIMEOUT


def test_ping_pong():
    pair = make_pair()
    pair.send_raw(Ping(nonce=99))
    (frame,) = frames_of(pair.worker.data_to_send())
    assert frame.message == Pong(nonce=99)


# -- authentication ---------------------------------------------------------------------


def test_psk_handshake_succeeds_and_fails_closed():
    good = make_pair(worker_kw={"psk": b"k" * 32}, spark_kw={"psk": b"k" * 32})
    assert good.spark.state is State.READY
    bad = make_pair(worker_kw={"psk": b"k" * 32}, spark_kw={"psk": b"x" * 32})
    assert bad.spark.closed
    assert bad.worker.slots == {}
    assert any(getattr(e, "code", None) is ErrorCode.AUTH_FAILED for e in bad.spark_events)


def test_worker_refuses_a_forged_auth_and_allocates_nothing():
    pair = make_pair(worker_kw={"psk": b"k" * 32}, handshake=False)
    pair.send_raw(_spark_hello(pair))
    pair.worker.data_to_send()
    pair.send_raw(Auth(proof=bytes(32)))
    assert _fatal_code(pair) is ErrorCode.AUTH_FAILED


def test_step_before_auth_is_refused():
    pair = make_pair(worker_kw={"psk": b"k" * 32}, handshake=False)
    pair.send_raw(_spark_hello(pair))
    pair.worker.data_to_send()
    pair.send_raw(step())
    assert _fatal_code(pair) is ErrorCode.HANDSHAKE_REQUIRED


def test_a_worker_without_key_refuses_a_spark_side_that_requires_integrity():
    pair = make_pair(spark_kw={"psk": b"k" * 32})
    assert pair.spark.closed
    assert any(getattr(e, "code", None) is ErrorCode.INTEGRITY_MISMATCH for e in pair.spark_events)


def test_spark_with_key_refuses_a_worker_that_answers_hello_without_a_challenge():
    # A worker that skips the CHALLENGE (and ignores the integrity field) never
    # proved it knows the key.
    pair = make_pair(spark_kw={"psk": b"k" * 32}, handshake=False)
    pair.spark.start(0.0)
    pair.spark.data_to_send()
    hello = build_hello(
        Role.WORKER,
        WorkerConfig(vocab_size=pair.spark.config.vocab_size, psk=b"k" * 32),
        draft_identity="pp1-toy-drafter",
        draft_native=True,
        limits=pair.spark._hello,
        nonce=bytes(16),
        session=7,
    )
    events = pair.spark.receive_data(framing.encode_frame(hello), 0.0)
    assert pair.spark.closed
    assert any(getattr(e, "code", None) is ErrorCode.AUTH_REQUIRED for e in events)


def test_spark_without_key_refuses_a_challenge():
    pair = make_pair(worker_kw={"psk": b"k" * 32})
    assert pair.spark.closed
    assert any(getattr(e, "code", None) is ErrorCode.AUTH_REQUIRED for e in pair.spark_events)


# -- STEP -------------------------------------------------------------------------------


def test_retried_step_gets_byte_identical_reply():
    pair = ready_pair()
    first = reply_bytes(pair, step())
    events = pair.send_raw(step())
    assert b"".join(pair.worker.data_to_send()) == first
    assert events == [StepReplayed(0, 0)]


def test_reply_is_deterministic_across_connections():
    a, b = ready_pair(), ready_pair()
    assert reply_bytes(a, step(round=4)) == reply_bytes(b, step(round=4))
    assert reply_bytes(a, step(round=5)) != reply_bytes(b, step(round=6))


STEP_REFUSALS = [
    ({"slot": 1}, ErrorCode.UNKNOWN_SLOT),
    ({"session": 8}, ErrorCode.WRONG_SESSION),
    ({"depth": 0}, ErrorCode.DEPTH_OUT_OF_RANGE),
    ({"depth": 6}, ErrorCode.DEPTH_OUT_OF_RANGE),
    ({"support": 257}, ErrorCode.SUPPORT_OUT_OF_RANGE),
    ({"generation": 1}, ErrorCode.FUTURE_GENERATION),
    ({"position": 4}, ErrorCode.WRONG_POSITION),
    ({"digest": 12345}, ErrorCode.PREFIX_DIGEST_MISMATCH),
    ({"context": 3}, ErrorCode.CONTEXT_MISMATCH),
    ({"temperature": float("nan")}, ErrorCode.BAD_TEMPERATURE),
    ({"temperature": -1.0}, ErrorCode.BAD_TEMPERATURE),
]


@pytest.mark.parametrize(("over", "code"), STEP_REFUSALS)
def test_step_refusal_has_exact_code_and_changes_nothing(over, code):
    pair = ready_pair()
    twin = ready_pair()
    err = error_of(reply_bytes(pair, step(**over)))
    assert ErrorCode(err.code) is code
    assert err.answers == MsgType.STEP
    assert err.scope == Scope.MESSAGE
    # Afterwards a valid STEP gets exactly what a worker that never saw the
    # refused one sends: no state changed, no draw was consumed.
    assert reply_bytes(pair, step()) == reply_bytes(twin, step())


def test_reused_round_with_different_content_is_refused():
    pair = ready_pair()
    first = reply_bytes(pair, step(round=2))
    err = error_of(reply_bytes(pair, step(round=2, depth=2)))
    assert ErrorCode(err.code) is ErrorCode.ROUND_REUSED
    err = error_of(reply_bytes(pair, step(round=1)))
    assert ErrorCode(err.code) is ErrorCode.ROUND_REUSED
    assert reply_bytes(pair, step(round=2)) == first


def test_stale_generation_after_reset():
    pair = ready_pair()
    reply_bytes(pair, step())
    pair.send_raw(Reset(session=7, slot=0, generation=1))
    pair.worker.data_to_send()
    err = error_of(reply_bytes(pair, step(round=1)))
    assert ErrorCode(err.code) is ErrorCode.STALE_GENERATION
    # Round numbering restarts with the generation; round 0 is fresh again.
    fresh = reply_bytes(pair, step(generation=1, round=0))
    assert frames_of([fresh])[0].type != MsgType.ERROR


def test_more_slots_than_negotiated():
    pair = make_pair(spark_kw={"max_slots": 2}, worker_kw={"max_slots": 4})
    pair.send_raw(open_message(7, 2, []))
    err = error_of(b"".join(pair.worker.data_to_send()))
    assert ErrorCode(err.code) is ErrorCode.SLOT_LIMIT
    assert pair.worker.slots == {}


def test_open_validates_prefix():
    pair = make_pair()
    tokens = np.array([1, VOCAB], dtype="<i4").tobytes()
    pair.send_raw(
        open_message(7, 0, [1, VOCAB]),
        tokens,
    )
    assert (
        ErrorCode(error_of(b"".join(pair.worker.data_to_send())).code)
        is ErrorCode.TOKEN_OUT_OF_RANGE
    )
    pair.send_raw(
        open_message(7, 0, [1]),
        tokens,
    )
    assert (
        ErrorCode(error_of(b"".join(pair.worker.data_to_send())).code) is ErrorCode.PAYLOAD_LENGTH
    )
    pair.send_raw(
        open_message(7, 0, [0] * 1, digest=5),
        tokens[:4],
    )
    assert (
        ErrorCode(error_of(b"".join(pair.worker.data_to_send())).code)
        is ErrorCode.PREFIX_DIGEST_MISMATCH
    )
    assert pair.worker.slots == {}


def test_slot_in_use():
    pair = ready_pair()
    pair.send_raw(open_message(7, 0, [], seed=9))
    assert ErrorCode(error_of(b"".join(pair.worker.data_to_send())).code) is ErrorCode.SLOT_IN_USE


def test_drafter_failure_gives_a_failed_completion_not_a_dead_connection():
    pair = ready_pair()

    def broken(_prefix):
        raise RuntimeError("drafter crashed")

    pair.worker.drafter = broken
    events = pair.send_raw(step())
    frames = frames_of(pair.worker.data_to_send())
    assert [f.type for f in frames] == [MsgType.COMPLETION]
    assert frames[0].message.status == ErrorCode.INTERNAL
    assert not pair.worker.closed
    assert [e.status for e in events if isinstance(e, StepServed)] == [ErrorCode.INTERNAL]


def test_a_batch_failure_after_streamed_rows_completes_after_those_rows():
    # A deferred draw streams its rows as they are drawn; when the batch runner
    # then fails for the whole batch (it raises, or returns the wrong count), the
    # shell completes the job with that bare failure. The rows already on the wire
    # stay the block's: the COMPLETION reports the failure after them (protocol
    # §4.6, adaptive §7), and the cached reply is exactly what went out. It used to
    # restart from no rows, so the COMPLETION was never sent.
    pair = ready_pair()
    pair.worker.defer_draws = True
    pair.spark.step(0, round_id=0, depth=3, temperature=1.0, support=0, now=0.0)
    requested = [
        e
        for chunk in pair.spark.data_to_send()
        for e in pair.worker.receive_data(chunk, 0.0)
        if isinstance(e, DrawRequested)
    ]
    (job,) = (e.job for e in requested)
    calls = []
    drafter = job.drafter

    def fails_third(prefix):
        calls.append(len(prefix))
        if len(calls) == 3:
            raise RuntimeError("drafter crashed at the third row")
        return drafter(prefix)

    class Streamer:
        def send(self, frames):
            pair.worker.stream_rows(job, [f for _, f in frames])

    job.drafter = fails_third
    job.streamer = Streamer()
    with pytest.raises(DraftingStoppedError):
        job.draw()  # as a batch runner that then fails for the batch
    streamed = pair.worker.data_to_send()
    assert [f.type for f in frames_of(streamed)] == [MsgType.REPLY, MsgType.REPLY]
    batch_failure = RuntimeError("the batch runner returned 0 results for 1 jobs")
    events = pair.worker.finish_draw(job, job.complete(batch_failure))
    rest = pair.worker.data_to_send()
    (completion,) = frames_of(rest)
    assert completion.type == MsgType.COMPLETION
    assert ErrorCode(completion.message.status) is ErrorCode.INTERNAL
    assert completion.message.rows == 2
    (served,) = (e for e in events if isinstance(e, StepServed))
    assert (served.rows, served.status, served.failure) == (2, ErrorCode.INTERNAL, batch_failure)
    sent = b"".join(bytes(c) for c in streamed + rest)
    slot = pair.worker.slots[0]
    assert b"".join(bytes(p) for parts in slot.reply for p in parts) == sent
    tokens = [f.message.token for f in frames_of(streamed)]
    assert list(slot.drafts) == tokens
    # The Spark side verifies the two rows as a block cut by the failure.
    got = [e for c in streamed + rest for e in pair.spark.receive_data(c, 0.0)]
    (ready,) = (e for e in got if isinstance(e, ProposalReady))
    assert list(ready.proposal.tokens) == tokens
    assert ready.proposal.cut is ErrorCode.INTERNAL


# -- COMMIT / RESET / CLOSE ---------------------------------------------------------------


def _drafts(pair, msg) -> list[int]:
    return [f.message.token for f in frames_of([reply_bytes(pair, msg)]) if f.type == MsgType.REPLY]


def commit(round=0, accepted=0, extra=5, position=4, digest=None, generation=0, tokens=None):
    toks = tokens if tokens is not None else [extra]
    return Commit(
        session=7,
        slot=0,
        generation=generation,
        round=round,
        accepted=accepted,
        extra=extra,
        position=position,
        digest=prefix_digest(PREFIX + toks) if digest is None else digest,
    )


def test_commit_applies_and_is_idempotent():
    pair = ready_pair()
    drafts = _drafts(pair, step(depth=3))
    msg = commit(accepted=2, extra=9, position=6, tokens=[*drafts[:2], 9])
    first = reply_bytes(pair, msg)
    assert frames_of([first])[0].type == MsgType.COMMITTED
    assert list(pair.worker.slots[0].prefix) == [*PREFIX, *drafts[:2], 9]
    assert reply_bytes(pair, msg) == first  # retried COMMIT: same acknowledgement
    assert list(pair.worker.slots[0].prefix) == [*PREFIX, *drafts[:2], 9]


@pytest.mark.parametrize(
    ("build", "code"),
    [
        (
            lambda d: commit(accepted=4, extra=1, position=8, tokens=[*d, 1, 1]),
            ErrorCode.COMMIT_INVALID,
        ),
        (
            lambda d: commit(accepted=1, extra=1, position=9, tokens=[d[0], 1]),
            ErrorCode.WRONG_POSITION,
        ),
        (
            lambda d: commit(accepted=1, extra=1, position=5, digest=1),
            ErrorCode.PREFIX_DIGEST_MISMATCH,
        ),
        (
            lambda d: commit(accepted=1, extra=None, position=4, tokens=[d[0]]),
            ErrorCode.COMMIT_INVALID,
        ),
        (lambda d: commit(accepted=0, extra=VOCAB, position=4), ErrorCode.TOKEN_OUT_OF_RANGE),
        (lambda d: commit(generation=1, position=4), ErrorCode.FUTURE_GENERATION),
        (
            lambda d: commit(round=1, accepted=1, extra=1, position=5, tokens=[d[0], 1]),
            ErrorCode.COMMIT_INVALID,
        ),
    ],
)
def test_commit_refusals_change_nothing(build, code):
    pair = ready_pair()
    drafts = _drafts(pair, step(depth=3))
    err = error_of(reply_bytes(pair, build(drafts)))
    assert ErrorCode(err.code) is code
    assert list(pair.worker.slots[0].prefix) == PREFIX
    # The round is still committable.
    ok = reply_bytes(pair, commit(accepted=1, extra=2, position=5, tokens=[drafts[0], 2]))
    assert frames_of([ok])[0].type == MsgType.COMMITTED


def test_commit_for_an_old_round_is_refused():
    pair = ready_pair()
    reply_bytes(pair, commit(round=3))
    err = error_of(reply_bytes(pair, commit(round=2, position=5, tokens=[5, 5])))
    assert ErrorCode(err.code) is ErrorCode.ROUND_REUSED
    # And a STEP for a committed round cannot be replayed into the new prefix.
    err = error_of(reply_bytes(pair, step(round=3, position=4, digest=prefix_digest([*PREFIX, 5]))))
    assert ErrorCode(err.code) is ErrorCode.ROUND_REUSED


def test_reset_invalidates_replay_cache_and_is_idempotent():
    pair = ready_pair()
    reply_bytes(pair, step())
    first = reply_bytes(pair, Reset(session=7, slot=0, generation=1))
    assert frames_of([first])[0].type == MsgType.RESET_DONE
    assert reply_bytes(pair, Reset(session=7, slot=0, generation=1)) == first
    err = error_of(reply_bytes(pair, Reset(session=7, slot=0, generation=0)))
    assert ErrorCode(err.code) is ErrorCode.STALE_GENERATION
    assert pair.worker.slots[0].reply is None


def test_close_drops_the_slot():
    pair = ready_pair()
    assert frames_of([reply_bytes(pair, Close(session=7, slot=0))])[0].type == MsgType.CLOSED
    err = error_of(reply_bytes(pair, step()))
    assert ErrorCode(err.code) is ErrorCode.UNKNOWN_SLOT


def test_framing_error_closes_the_connection():
    pair = ready_pair()
    events = pair.worker.receive_data(b"XX" + b"\x00" * 30, 0.0)
    assert any(isinstance(e, ConnectionClosing) for e in events)
    assert any(isinstance(e, Refused) and e.code is ErrorCode.BAD_MAGIC for e in events)
    assert pair.worker.slots == {}


def test_every_refusal_names_what_it_refuses():
    # docs/protocol.md section 4.9: slot, generation and round copied from the
    # refused message whatever the code, and `answers` is the refused type.
    pair = ready_pair()
    err = error_of(reply_bytes(pair, step(session=99, generation=2, round=5)))
    assert ErrorCode(err.code) is ErrorCode.WRONG_SESSION
    assert (err.answers, err.slot, err.generation, err.round) == (int(MsgType.STEP), 0, 2, 5)
    err = error_of(reply_bytes(pair, step(slot=3, generation=1, round=4)))
    assert ErrorCode(err.code) is ErrorCode.UNKNOWN_SLOT
    assert (err.slot, err.generation, err.round) == (3, 1, 4)
    pair.send_raw(open_message(99, 1, [1], generation=6), np.array([1], "<i4").tobytes())
    err = error_of(b"".join(pair.worker.data_to_send()))
    assert (err.answers, err.slot, err.generation, err.round) == (int(MsgType.OPEN), 1, 6, None)


def test_a_peer_that_never_commits_gets_one_fresh_proposal_per_slot():
    # 1,000 STEPs for distinct rounds, never committed: one draw, 999 refusals,
    # and the output stays one reply plus small ERRORs however many arrive.
    pair = ready_pair()
    served = refused = 0
    out = 0
    for r in range(1000):
        events = pair.send_raw(step(round=r))
        out += sum(len(c) for c in pair.worker.data_to_send())
        served += sum(isinstance(e, StepServed) for e in events)
        refused += sum(
            isinstance(e, Refused) and e.code is ErrorCode.STEP_UNCOMMITTED for e in events
        )
    assert (served, refused) == (1, 999)
    assert out < 4 * VOCAB * 3 + 1000 * 64
    # The uncommitted STEP's retry still replays (committing then frees the slot:
    # every round trip of the e2e and conformance tests does that).
    assert isinstance(pair.send_raw(step(round=0))[0], StepReplayed)


@pytest.mark.parametrize("psk", [None, b"k" * 32], ids=["plain", "keyed"])
def test_each_row_is_written_once_and_handed_to_the_transport_as_it_is(psk):
    # The q payload goes from its array to the transport without being joined
    # to its header or copied again; a replay hands out the very same views.
    pair = ready_pair(worker_kw={"psk": psk}, spark_kw={"psk": psk})

    def send_step() -> list:
        sealer = pair.spark._sealer  # a keyed connection tags what it sends
        frame = framing.encode_frame(step(), tagged=sealer is not None)
        pair.worker.receive_data(frame if sealer is None else sealer.seal(frame), 0.0)
        return pair.worker.data_to_send()

    first = send_step()
    rows = [c for c in first if isinstance(c, memoryview) and c.nbytes == 4 * VOCAB]
    assert len(rows) == 3  # depth 3, dense
    again = send_step()  # a retry: answered from the cache
    assert [c for c in again if isinstance(c, memoryview)] == rows
    assert all(any(c is r for c in again) for r in rows)  # the same objects, not copies


def test_a_commit_below_a_pending_step_is_refused_and_the_step_still_replays():
    # A target-only COMMIT (accepted = 0) for a round below the STEP still
    # waiting to be committed was accepted: it cleared the replay entry, and the
    # identical STEP retried then hit an assertion that killed the connection.
    pair = ready_pair()
    first = reply_bytes(pair, step(round=5))
    retried = step(round=5)
    answer = frames_of([reply_bytes(pair, commit(round=3))])
    assert [f.type for f in answer] == [MsgType.ERROR], [f.message for f in answer]
    assert ErrorCode(answer[0].message.code) is ErrorCode.ROUND_REUSED
    assert list(pair.worker.slots[0].prefix) == PREFIX
    events = pair.send_raw(retried)  # raised AssertionError in the core
    assert b"".join(pair.worker.data_to_send()) == first
    assert events == [StepReplayed(0, 5)]
    assert not pair.worker.closed
    # The pending round is still committable, and a target-only round above it too.
    drafts = [f.message.token for f in frames_of([first]) if f.type == MsgType.REPLY]
    ok = reply_bytes(pair, commit(round=5, accepted=1, extra=2, position=5, tokens=[drafts[0], 2]))
    assert frames_of([ok])[0].type == MsgType.COMMITTED
