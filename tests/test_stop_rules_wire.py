"""Stop rules through the wire: negotiated at HELLO, named by the STEP, applied by the
worker while drafting, flagged in COMPLETION, audited by the Spark side and the verifier.

``docs/adaptive.md`` is normative for the rules, ``docs/protocol.md`` §4.1, §4.4,
§4.6 and §6.4 for how they travel. The exact suite (``test_adaptive_exact.py``)
proves the output law; here each piece is checked against the integer
definitions of :mod:`pp1wire.q.stoprules`.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode, ProtocolError, ValidationError, VerifyError
from pp1wire.q.batch import propose_batch
from pp1wire.q.dyadic import M
from pp1wire.q.layout import ShardLayout
from pp1wire.q.proposal import DraftJob, Proposal, batched_drafter, propose
from pp1wire.q.rng import Role, RoundStreams
from pp1wire.q.stoprules import (
    FIXED,
    STOP_RULES,
    StopKind,
    StopRule,
    admits_next,
    audit,
    step_rule,
    stop_after,
    stopped_by_rule,
)
from pp1wire.q.verify import RequestVerifier, proposal_from_rows
from pp1wire.testing.builders import reply_step
from pp1wire.tp import fanout
from pp1wire.wire import framing
from pp1wire.wire.messages import Completion, Error, Hello, Step
from pp1wire.wire.spark_events import ProposalReady

from .pairs import make_pair

VOCAB = 32
PREFIX = [1, 2, 3]
RULES = [
    FIXED,
    StopRule.parse("confidence:0"),
    StopRule.parse("confidence:0.01"),
    StopRule.parse("confidence:0.2"),
    StopRule.parse("confidence:1"),
    StopRule.parse("joint:0.000001"),
    StopRule.parse("joint:0.1"),
]


def counts_of(rows) -> list[int]:
    return [r.count_at(r.token) for r in rows]


def stepped(pair, rule: StopRule, *, depth: int = 5, seed: int = 5, eos: int | None = None):
    """Open slot 0 and STEP it once under ``rule``: (its proposal, its COMPLETION)."""
    pair.spark.open_slot(0, seed=seed, prefix=PREFIX, eos=eos)
    pair.pump()
    pair.spark.step(0, round_id=0, depth=depth, temperature=1.0, support=0, now=0.0, stop=rule)
    start = len(pair.to_spark)
    events = pair.pump()
    (ready,) = [e for e in events if isinstance(e, ProposalReady)]
    frames = framing.FrameDecoder(1 << 24).feed(b"".join(pair.to_spark[start:]))
    (done,) = [f.message for f in frames if isinstance(f.message, Completion)]
    return ready.proposal, done


def negotiated(**worker_kw):
    return make_pair(VOCAB, spark_kw={"stop_rules": STOP_RULES}, worker_kw=worker_kw)


# -- the worker applies the rule ------------------------------------------------------------


def test_the_worker_applies_every_rule_and_a_stopped_block_is_the_fixed_blocks_prefix():
    seen_stop, seen_full = set(), set()
    for seed in range(12):
        fixed, _ = stepped(negotiated(), FIXED, seed=seed)
        assert len(fixed.rows) == 5
        for rule in RULES[1:]:
            got, done = stepped(negotiated(), rule, seed=seed)
            n = len(got.rows)
            # Where the integer rule ends the block, recomputed from the fixed block's rows.
            assert n == stop_after(rule, 5, counts_of(fixed.rows), fixed.tokens, None)
            assert got.tokens == fixed.tokens[:n]
            assert counts_of(got.rows) == counts_of(fixed.rows)[:n]
            assert got.stop == rule
            assert done.stopped is (n < 5)
            assert audit(rule, 5, counts_of(got.rows), got.tokens, None) is None
            (seen_stop if n < 5 else seen_full).add(rule)
    # The toy drafter's q at its draws spans 0.002..0.4: these rules both stopped
    # early and ran to the depth somewhere; the strict ones always stopped.
    assert {StopRule.parse(t) for t in ("confidence:0.01", "joint:0.000001")} <= (
        seen_stop & seen_full
    )
    assert {StopRule.parse(t) for t in ("confidence:0.2", "joint:0.1")} <= seen_stop
    assert StopRule.parse("confidence:0") not in seen_stop


def test_a_terminal_token_ends_a_ruled_block_without_the_stopped_flag():
    for seed in range(40):
        fixed, _ = stepped(negotiated(), FIXED, seed=seed)
        eos = fixed.tokens[0]
        got, done = stepped(negotiated(), StopRule.parse("confidence:0"), seed=seed, eos=eos)
        assert got.tokens == (eos,)
        assert done.stopped is False
        return
    pytest.fail("unreachable")


def test_a_step_without_a_rule_asks_for_the_fixed_rule():
    ruled = reply_step(0, depth=3, stop=2, threshold=M // 3)
    raw = msgspec.msgpack.decode(framing.encode_frame(ruled)[framing.PREAMBLE_SIZE :])
    assert raw[-2:] == [2, M // 3]
    # A STEP of the eleven elements before the stop rule decodes with the fixed rule.
    short = msgspec.msgpack.encode(raw[:-2])
    decoded = framing.FrameDecoder(1 << 20).feed(framing.encode_raw_frame(8, short))[0].message
    assert isinstance(decoded, Step)
    assert (decoded.stop, decoded.threshold) == (0, 0)


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("negotiate", "stop", "threshold"),
    [
        (True, 3, 0),  # an unknown kind
        (True, 255, 7),
        (True, 1, M + 1),  # a threshold above 2**24
        (True, 2, 0xFFFFFFFF),
        (True, 0, 1),  # the fixed rule has no threshold
        (False, 1, M // 2),  # a rule the HELLO did not negotiate
        (False, 2, 0),
    ],
)
def test_the_worker_refuses_a_bad_rule_and_changes_nothing(negotiate, stop, threshold):
    pair = negotiated() if negotiate else make_pair(VOCAB)
    pair.spark.open_slot(0, seed=5, prefix=PREFIX)
    pair.pump()
    # The STEP the Spark side would send next, but for its stop rule.
    bad = reply_step(0, depth=3, digest=pair.spark.slots[0].digest, stop=stop, threshold=threshold)
    pair.send_raw(bad)
    (frame,) = framing.FrameDecoder(1 << 20).feed(b"".join(pair.worker.data_to_send()))
    err = frame.message
    assert isinstance(err, Error)
    assert (ErrorCode(err.code), err.scope, err.round) == (ErrorCode.BAD_STOP_RULE, 0, 0)
    assert step_rule(stop, threshold, STOP_RULES if negotiate else "") is ErrorCode.BAD_STOP_RULE
    # Nothing drawn: the same round is still fresh, and a valid STEP is served.
    pair.send_raw(msgspec.structs.replace(bad, stop=0, threshold=0))
    frames = framing.FrameDecoder(1 << 20).feed(b"".join(pair.worker.data_to_send()))
    assert isinstance(frames[-1].message, Completion)
    assert frames[-1].message.rows == 3


def test_the_spark_side_never_sends_a_rule_it_did_not_negotiate():
    pair = make_pair(VOCAB)
    pair.spark.open_slot(0, seed=5, prefix=PREFIX)
    pair.pump()
    with pytest.raises(ProtocolError) as refused:
        pair.spark.step(0, round_id=0, depth=3, temperature=1.0, support=0, now=0.0, stop=RULES[3])
    assert refused.value.code is ErrorCode.BAD_STOP_RULE
    assert pair.spark.data_to_send() == []
    assert pair.spark.slots[0].flight is None


def test_a_hello_asking_for_rules_the_worker_lacks_is_refused():
    pair = make_pair(VOCAB, worker_kw={"stop_rules": ""}, spark_kw={"stop_rules": STOP_RULES})
    (frame,) = framing.FrameDecoder(1 << 20).feed(b"".join(pair.to_spark))
    assert isinstance(frame.message, Error)
    assert ErrorCode(frame.message.code) is ErrorCode.STOP_RULES_MISMATCH
    assert frame.message.scope == 2


def test_a_sharded_link_negotiates_the_stop_rules_as_an_unsharded_one():
    # Its worker group learns each row's count at its token with the token, and its
    # Spark group audits the stop from the counts its ranks gather (docs/tp.md §11).
    layout = ShardLayout((0, 16, VOCAB))
    worker_kw = {"layout": layout, "shard": 0}
    spark_kw = {**worker_kw, "stop_rules": STOP_RULES, "group": bytes(range(16))}
    pair = make_pair(VOCAB, worker_kw=worker_kw, spark_kw=spark_kw)
    assert pair.spark.stop_rules == STOP_RULES


def test_the_spark_side_refuses_an_echo_that_upgrades_it():
    pair = make_pair(VOCAB, handshake=False)
    pair.spark.start(0.0)
    pair.spark.data_to_send()
    ours = pair.spark._hello
    assert ours is not None
    upgraded = msgspec.structs.replace(ours, role=1, session=7, stop_rules=STOP_RULES)
    pair.spark.receive_data(framing.encode_frame(upgraded), 0.0)
    (frame,) = framing.FrameDecoder(1 << 20).feed(b"".join(pair.spark.data_to_send()))
    assert ErrorCode(frame.message.code) is ErrorCode.STOP_RULES_MISMATCH


def test_an_unknown_rule_set_is_a_configuration_error():
    from pp1wire.wire.worker_core import WorkerConfig

    with pytest.raises(ValueError, match="unknown stop-rule set"):
        WorkerConfig(vocab_size=VOCAB, stop_rules="pp1-stop-rules-v2")
    fields = Hello.__struct_fields__
    defaults = dict(
        zip(
            fields[len(fields) - len(Hello.__struct_defaults__) :],
            Hello.__struct_defaults__,
            strict=True,
        )
    )
    assert defaults["stop_rules"] == ""  # an omitted field means fixed only


# -- the chains ------------------------------------------------------------------------------


@pytest.mark.parametrize("row_entries", [None, 40])
def test_propose_batch_applies_each_jobs_rule_exactly_as_propose(row_entries):
    drafter = ToyLM(VOCAB, 4, draft=True)
    jobs = [
        DraftJob(
            seed=s,
            generation=1,
            round_id=s % 3,
            prefix=[s % VOCAB, 1],
            depth=1 + s % 5,
            temperature=1.0 if s % 4 else 0.7,
            support=0 if s % 3 else 6,
            eos=None if s % 5 else 3,
            stop=RULES[s % len(RULES)],
        )
        for s in range(28)
    ]
    got = propose_batch(batched_drafter(drafter.logits), jobs, VOCAB, row_entries=row_entries)
    for job, rows in zip(jobs, got, strict=True):
        assert not isinstance(rows, Exception)
        streams = RoundStreams(Role.WORKER, job.seed, job.generation, job.round_id)
        alone = propose(
            job.prefix,
            job.depth,
            drafter.logits,
            streams,
            temperature=job.temperature,
            support=job.support or None,
            eos=job.eos,
            stop=job.stop,
        )
        assert [r.token for r in rows] == [r.token for r in alone]
        assert counts_of(rows) == counts_of(alone)
        tokens = [r.token for r in rows]
        assert audit(job.stop, job.depth, counts_of(rows), tokens, job.eos) is None


# -- the verifier's audit -----------------------------------------------------------------------


def _verifier(eos: int | None = None) -> RequestVerifier:
    target = ToyLM(VOCAB, 9)
    return RequestVerifier(
        session=0, seed=11, vocab_size=VOCAB, prefix=PREFIX, target=target.probs, eos=eos
    )


def _fixed_rows(seed: int):
    drafter = ToyLM(VOCAB, 4, draft=True)
    return propose(PREFIX, 5, drafter.logits, RoundStreams(Role.WORKER, seed, 0, 0))


def test_check_key_relaxes_the_depth_only_for_a_rule_whose_audit_passes():
    rule = StopRule.parse("confidence:0.2")
    cases = 0
    for seed in range(30):
        rows = _fixed_rows(seed)
        end = stop_after(rule, 5, counts_of(rows), [r.token for r in rows], None)
        assert end is not None
        if end >= 4:
            continue
        cases += 1
        v = _verifier()
        ok = Proposal(**{**_key(v), "rows": tuple(rows[:end]), "stop": rule})
        v.check_key(ok)
        late = Proposal(**{**_key(v), "rows": tuple(rows[: end + 1]), "stop": rule})
        with pytest.raises(VerifyError) as caught:
            v.check_key(late)
        assert caught.value.code is ErrorCode.STOP_RULE_VIOLATED
        if end > 1:
            early = Proposal(**{**_key(v), "rows": tuple(rows[: end - 1]), "stop": rule})
            with pytest.raises(VerifyError) as caught:
                v.check_key(early)
            assert caught.value.code is ErrorCode.STOP_RULE_VIOLATED
        # The same short block under the fixed rule stays malformed.
        with pytest.raises(VerifyError) as caught:
            v.check_key(Proposal(**{**_key(v), "rows": tuple(rows[:end])}))
        assert caught.value.code is ErrorCode.MALFORMED_PROPOSAL
        # And the audited block verifies like any other.
        assert v.verify(ok).round_id == 0
    assert cases >= 5


def _key(v: RequestVerifier) -> dict:
    return {
        "session": v.session,
        "generation": v.generation,
        "round_id": 0,
        "position": v.position,
        "digest": v.digest,
        "depth": 5,
        "context": v.context,
    }


def test_stopped_is_what_only_a_rule_can_end():
    assert stopped_by_rule(3, [1], None)
    assert not stopped_by_rule(3, [1, 2, 4], None)
    assert not stopped_by_rule(3, [1, 2], 2)
    assert stopped_by_rule(3, [2, 1], 2)


@pytest.mark.parametrize("eos", [None, 2])
def test_admits_next_refuses_no_rows_with_a_value_error(eos):
    # With a terminal token set the token test must not read tokens[-1] of no rows first.
    with pytest.raises(ValueError, match="at least one"):
        admits_next(StopRule.confidence("0.5"), 3, [], [], eos)


# -- the replicated group carries the rule ---------------------------------------------------


@pytest.mark.parametrize(
    "rule", [FIXED, StopRule.parse("confidence:0.3"), StopRule(StopKind.JOINT, M)]
)
def test_the_attempt_header_carries_the_stop_rule(rule):
    v = _verifier()
    rows = _fixed_rows(1)[:2]
    proposal = proposal_from_rows(v, rows, 0, 5)
    proposal = Proposal(**{**proposal.__dict__, "stop": rule})
    payload = np.zeros(8, dtype=np.uint8)
    header = fanout.header_of(0, proposal, payload, sparse=False)
    back = fanout.Header.from_words(header.words(), 1 << 20)
    assert back.stop == rule
    assert fanout.proposal_of(back, proposal.rows).stop == rule


@pytest.mark.parametrize("word", [3 << 32, (1 << 32) | (M + 1), 5, -1])
def test_a_header_word_that_is_no_stop_rule_is_refused(word):
    words = fanout.Header(kind=fanout.Kind.PROPOSAL).words()
    words[1] = word
    with pytest.raises(ValidationError) as refused:
        fanout.Header.from_words(words, 1 << 20)
    assert refused.value.code is ErrorCode.GROUP_HEADER_INVALID


def test_the_batch_runner_drafts_with_the_steps_stop_rule():
    # The worker's default runner builds each job's DraftJob from its DrawJob: the
    # STEP's rule must travel with it, or a batched draw would ignore the rule.
    from pp1wire.wire.replies import ReplyEncoder
    from pp1wire.wire.worker_events import DrawJob

    class _Slot:
        seed, prefix, eos = 3, [1, 2], None

    step = Step(
        session=7, slot=0, generation=0, round=0, position=2, digest=0, depth=4,
        temperature=1.0, support=0, context=0, stop=1, threshold=1 << 20,
    )  # fmt: skip
    job = DrawJob(
        _Slot(), step, drafter=lambda p: [0.0] * 4, proposer=None, encoder=ReplyEncoder(7, step, 4)
    )
    assert job.draft_job().stop == StopRule.parse("confidence:0.0625")
