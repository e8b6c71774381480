"""A row's bytes never depend on its own draw (``docs/adaptive.md`` §7, protocol §4.5).

Theorem 2 of ``docs/adaptive.md`` needs every fault at row i+1 to be decided
without x_(i+1). A fault placed by bytes (a reset after N bytes, a proxy's
``reset_after`` or ``blackhole_after``) sees only the frames' lengths, so a
REPLY's length must not depend on its token: the token is a 4-byte bin. Here:

- every REPLY of a given shape frames to one length whatever its token, through
  the real encoder and decoder, tagged or not (a property test);
- a reset after N bytes, for every N across a reply, through the real Spark
  side, keeps the target's law exactly, in rationals, while the same reset on
  the older encoding (a shortest-form uint token, built here from the real
  frames) is biased: the design's toy, 3/4 instead of 1/2;
- a block whose COMPLETION was lost after all its rows is verified exactly as
  the complete block (COMPLETION's ``reply_checksum`` depends on every token);
- a peer without ``row_format`` is refused at HELLO, both ways.
"""

from __future__ import annotations

from fractions import Fraction

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.errors import ErrorCode, ProtocolError
from pp1wire.q import dyadic, oracle
from pp1wire.q.proposal import QRow, prefix_digest
from pp1wire.q.stoprules import FIXED, STOP_RULES, StopRule
from pp1wire.q.verify import RequestVerifier
from pp1wire.testing.builders import SESSION, completion, older_hello_frame, uint_token_frame
from pp1wire.testing.golden.common import hello, spark_config
from pp1wire.wire import framing, spark_core
from pp1wire.wire.messages import (
    MESSAGE_TYPES,
    ROW_FORMAT,
    TOKEN_MAX,
    Error,
    Hello,
    MsgType,
    Opened,
    Reply,
    Step,
)
from pp1wire.wire.replies import ReplyEncoder, reply_frames
from pp1wire.wire.spark_events import ProposalFailed, ProposalReady
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol

from .pairs import make_pair, verifier
from .test_adaptive_exact import HALF, MODELS

# -- every REPLY of one shape has one length ---------------------------------------------------


@st.composite
def shapes(draw: st.DrawFn) -> tuple[Step, int, int, tuple[int, int] | None, QRow]:
    """A STEP, a row index, ``row_entries``, a link range (None: unsharded) and a row
    whose token is to be replaced: every field but the token drawn."""
    dense = draw(st.booleans())
    vocab = draw(st.integers(1, 40))
    row_entries = vocab + draw(st.integers(0, 8))
    sharded = vocab > 1 and draw(st.booleans())
    if sharded:
        cut = draw(st.integers(1, vocab - 1))
        shard: tuple[int, int] | None = draw(st.sampled_from([(0, cut), (cut, vocab)]))
    else:
        shard = None
    if dense:
        counts = np.asarray(
            draw(st.lists(st.integers(0, dyadic.M), min_size=vocab, max_size=vocab))
        )
        row = QRow(token=0, counts=counts)
    else:
        ids = sorted(draw(st.sets(st.integers(0, vocab - 1), max_size=8)))
        counts = np.asarray(
            draw(st.lists(st.integers(1, dyadic.M), min_size=len(ids), max_size=len(ids)))
        )
        row = QRow(token=0, counts=counts.astype(np.int64), ids=np.asarray(ids, dtype=np.int32))
    index = draw(st.integers(0, 4))
    step = Step(
        session=draw(st.integers(0, 2**64 - 1)),
        slot=draw(st.integers(0, 0xFFFF)),
        generation=draw(st.integers(0, 0xFFFFFFFF)),
        round=draw(st.integers(0, 0xFFFFFFFF)),
        position=draw(st.integers(0, 0xFFFFFFFF - 4)),
        digest=0,
        depth=5,
        temperature=1.0,
        support=0 if dense else 8,
        context=0,
    )
    return step, index, row_entries, shard, row


@settings(max_examples=150, deadline=None)
@given(
    shape=shapes(),
    drawn=st.lists(st.integers(0, TOKEN_MAX), min_size=1, max_size=4),
    tagged=st.booleans(),
)
def test_every_reply_of_one_shape_frames_to_one_length_whatever_its_token(shape, drawn, tagged):
    step, index, row_entries, shard, row = shape
    encoder = ReplyEncoder(step.session, step, row_entries, shard=shard, tagged=tagged)
    lengths = set()
    for token in (0, 127, 128, 255, 256, 65_535, 65_536, TOKEN_MAX, *drawn):
        parts = encoder.row(index, QRow(token=token, counts=row.counts, ids=row.ids))
        frame = b"".join(bytes(p) for p in parts)
        lengths.add(len(frame))
        # Through the real decoder: a tagged frame is followed by its tag (not checked here).
        (got,) = framing.FrameDecoder(1 << 20).feed(frame + bytes(16 if tagged else 0))
        assert isinstance(got.message, Reply)
        assert got.message.token == token
        assert bytes(got.payload) == bytes(parts[1])
    assert len(lengths) == 1, lengths


def dense8_row(token: int) -> bytes:
    """An unsharded dense row of 8 entries (the vectors' vocabulary), untagged."""
    step = Step(
        session=SESSION,
        slot=0,
        generation=0,
        round=0,
        position=3,
        digest=0,
        depth=1,
        temperature=1.0,
        support=0,
        context=0,
    )
    counts = np.full(8, dyadic.M // 8, dtype=np.int64)
    parts = ReplyEncoder(SESSION, step, 8).row(0, QRow(token=token, counts=counts))
    return b"".join(bytes(p) for p in parts)


def test_the_frame_lengths_protocol_section_11_states():
    # docs/protocol.md section 11: 70, 71, 72 and 74 bytes under the older shortest-form
    # uint; 75 for every token under the fixed width.
    tokens = {0: 70, 127: 70, 128: 71, 255: 71, 256: 72, 65_535: 72, 65_536: 74, TOKEN_MAX: 74}
    assert {t: len(uint_token_frame(dense8_row(t))) for t in tokens} == tokens
    assert {len(dense8_row(t)) for t in tokens} == {75}


def test_a_token_in_any_other_form_is_header_invalid():
    frame = dense8_row(200)
    old = uint_token_frame(frame)
    with pytest.raises(ProtocolError) as caught:
        framing.FrameDecoder(1 << 20).feed(old)
    assert caught.value.code is ErrorCode.HEADER_INVALID


# -- a reset after N bytes, through the real Spark side, in rationals --------------------------

#: The oracle's token indices as REPLY tokens: IDs whose shortest-form uint widths
#: differ (1, 2, 3 and 5 bytes), so the older encoding's rows differ in length.
WIRE_IDS = (5, 200, 300, 70_000)
WIRE_VOCAB = WIRE_IDS[-1] + 1


def uniform_5_200(_ctx: oracle.Prefix) -> list[Fraction]:
    """q = p uniform on the tokens 0 and 1 (IDs 5 and 200 on the wire)."""
    return [HALF, HALF]


def ready_spark(prefix: oracle.Prefix, depth: int, eos: int | None):
    """A Spark side with slot 0 open at ``prefix`` (wire IDs) and one sparse STEP of
    ``depth`` in flight: (the protocol, the STEP it sent)."""
    cfg = spark_core.SparkConfig(
        vocab_size=WIRE_VOCAB, max_support=len(WIRE_IDS), max_frame=1 << 20, max_prefix=64
    )
    spark = spark_core.SparkProtocol(cfg, now=0.0)
    spark.start(0.0)
    ours = spark._hello
    assert ours is not None
    worker_hello = msgspec.structs.replace(ours, role=1, session=SESSION)
    spark.receive_data(framing.encode_frame(worker_hello), 0.0)
    wire_prefix = [WIRE_IDS[t] for t in prefix]
    spark.open_slot(0, seed=1, prefix=wire_prefix, eos=None if eos is None else WIRE_IDS[eos])
    opened = Opened(
        session=SESSION,
        slot=0,
        generation=0,
        position=len(prefix),
        digest=prefix_digest(wire_prefix),
    )
    spark.receive_data(framing.encode_frame(opened), 0.0)
    spark.data_to_send()
    spark.step(0, round_id=0, depth=depth, temperature=1.0, support=len(WIRE_IDS), now=0.0)
    (sent,) = framing.FrameDecoder(1 << 20).feed(b"".join(spark.data_to_send()))
    assert isinstance(sent.message, Step)
    return spark, sent.message


def blocks(prefix, depth, q_fn, eos):
    """Every block a worker drafts, with its probability: (drafts, their q rows, mass)."""
    out = []

    def walk(drafts, rows, mass):
        q = q_fn(prefix + drafts)
        for x, qx in enumerate(q):
            if not qx:
                continue
            drawn, with_row = (*drafts, x), (*rows, q)
            if len(drawn) == depth or x == eos:
                out.append((drawn, with_row, mass * qx))
            else:
                walk(drawn, with_row, mass * qx)

    walk((), (), Fraction(1))
    assert sum(m for *_, m in out) == 1
    return out


def wire_row(token: int, q: list[Fraction]) -> QRow:
    """A sparse row of q (exact counts) over the wire IDs, drawn at oracle token ``token``."""
    support = [t for t, v in enumerate(q) if v]
    counts = np.asarray([int(q[t] * dyadic.M) for t in support], dtype=np.int64)
    ids = np.asarray([WIRE_IDS[t] for t in support], dtype=np.int32)
    return QRow(token=WIRE_IDS[token], counts=counts, ids=ids)


def reply_bytes(step: Step, drafts, rows, *, older: bool) -> tuple[bytes, list[int]]:
    """The worker's reply to ``step`` for this block (every REPLY, then COMPLETION), in
    the fixed encoding or the older one, and the offset after each REPLY frame."""
    frames = reply_frames(
        SESSION, step, tuple(wire_row(x, q) for x, q in zip(drafts, rows, strict=True)), 0
    )
    body = [b"".join(bytes(p) for p in parts) for parts in frames[:-1]]
    if older:
        body = [uint_token_frame(f) for f in body]
    ends = list(np.cumsum([len(f) for f in body]))
    joined = b"".join(body)
    return joined + completion(step, joined, len(body)), [int(e) for e in ends]


def received_block(prefix, depth, eos, data: bytes) -> tuple[int, ...]:
    """The real Spark side's block when the connection resets after ``data``: the rows
    wholly received, cut by CONNECTION_LOST (docs/adaptive.md section 7), or none."""
    spark, _ = ready_spark(prefix, depth, eos)
    events = spark.receive_data(data, 0.0) + spark.connection_lost()
    ready = [e for e in events if isinstance(e, ProposalReady)]
    if not ready:
        assert any(isinstance(e, ProposalFailed) for e in events)
        return ()
    (got,) = ready
    return tuple(WIRE_IDS.index(t) for t in got.proposal.tokens)


def two_tokens(prefix, block, q_fn, p_fn, eos) -> dict[oracle.Prefix, Fraction]:
    """The law of the first two committed tokens when the round verifies ``block`` (an
    empty block: target-only), a round that commits one token followed by a target draw."""
    out: dict[oracle.Prefix, Fraction] = {}
    for tokens, mass in oracle.verify_block_distribution(prefix, block, q_fn, p_fn, eos).items():
        if len(tokens) >= 2 or tokens[-1] == eos:
            key = tokens[:2]
            out[key] = out.get(key, Fraction(0)) + mass
            continue
        for y, py in enumerate(p_fn(prefix + tokens)):
            if py:
                out[(*tokens, y)] = out.get((*tokens, y), Fraction(0)) + mass * py
    return out


def law_under_reset(prefix, depth, q_fn, p_fn, eos, *, older: bool):
    """For every reset point N across the reply, the law of the first two committed
    tokens under the fault rule. The fixed encoding goes through the real Spark side;
    the older one (which that side refuses to decode) keeps the rows wholly received,
    which is what the real side does with the fixed encoding (checked here)."""
    _spark, step = ready_spark(prefix, depth, eos)
    drafted = [
        (drafts, mass, *reply_bytes(step, drafts, rows, older=older))
        for drafts, rows, mass in blocks(prefix, depth, q_fn, eos)
    ]
    longest = max(len(data) for _d, _m, data, _e in drafted)
    laws = []
    for n in range(longest + 1):
        law: dict[oracle.Prefix, Fraction] = {}
        for drafts, mass, data, ends in drafted:
            whole = sum(1 for e in ends if e <= n)
            if not older:
                assert received_block(prefix, depth, eos, data[:n]) == drafts[:whole]
            for tokens, m in two_tokens(prefix, drafts[:whole], q_fn, p_fn, eos).items():
                law[tokens] = law.get(tokens, Fraction(0)) + mass * m
        laws.append(law)
    return laws


@pytest.mark.parametrize("depth", [1, 2])
def test_a_reset_after_n_bytes_keeps_the_law_of_the_toy(depth):
    # q = p uniform on {5, 200}: the design's two-token toy with a byte-placed fault.
    want = oracle.target_only_distribution((), 2, uniform_5_200, None)
    fixed = law_under_reset((), depth, uniform_5_200, uniform_5_200, None, older=False)
    assert all(law == want for law in fixed)
    older = law_under_reset((), depth, uniform_5_200, uniform_5_200, None, older=True)
    biased = [n for n, law in enumerate(older) if law != want]
    assert biased, "the older encoding's reset never selected a row by its token"


def test_the_older_encoding_under_a_reset_gives_three_quarters():
    # Depth 1, a reset that lets row 5's frame through but not row 200's (one byte
    # longer): the first token is 5 with probability 1/2 + 1/4 = 3/4, not 1/2.
    _spark, step = ready_spark((), 1, None)
    row_end = {x: reply_bytes(step, (x,), (uniform_5_200(()),), older=True)[1][0] for x in (0, 1)}
    assert row_end[1] == row_end[0] + 1
    older = law_under_reset((), 1, uniform_5_200, uniform_5_200, None, older=True)
    first = {}
    for tokens, mass in older[row_end[0]].items():
        first[tokens[0]] = first.get(tokens[0], Fraction(0)) + mass
    assert first == {0: Fraction(3, 4), 1: Fraction(1, 4)}
    fixed = law_under_reset((), 1, uniform_5_200, uniform_5_200, None, older=False)
    assert all(sum(m for t, m in law.items() if t[0] == 0) == HALF for law in fixed)


@pytest.mark.parametrize("model", MODELS)
def test_a_reset_after_n_bytes_keeps_the_law_when_q_sets_the_length(model):
    # Context-dependent q whose sparse support (and so the row's length) varies with
    # the drafts before it: allowed, since q_(i+1) is fixed before x_(i+1).
    prefix, q_fn, p_fn, eos = MODELS[model]
    want = oracle.target_only_distribution(prefix, 2, p_fn, eos)
    fixed = law_under_reset(prefix, 2, q_fn, p_fn, eos, older=False)
    assert all(law == want for law in fixed)
    older = law_under_reset(prefix, 2, q_fn, p_fn, eos, older=True)
    assert any(law != want for law in older)


# -- a lost COMPLETION: the cut block is verified as the complete one --------------------------


RULES = [FIXED, StopRule.parse("confidence:0.2"), StopRule.parse("joint:0.05")]


def proposals(rule: StopRule, depth: int, seed: int, eos: int | None):
    """The same STEP answered twice by the same worker: the proposal with its COMPLETION,
    and the one whose COMPLETION was lost (the connection reset after the last row)."""
    out = []
    for lose in (False, True):
        pair = make_pair(16, spark_kw={"stop_rules": STOP_RULES}, seed=3)
        pair.spark.open_slot(0, seed=seed, prefix=[1, 2], eos=eos)
        pair.pump()
        pair.spark.step(0, round_id=0, depth=depth, temperature=1.0, support=0, now=0.0, stop=rule)
        for chunk in pair.spark.data_to_send():
            pair.worker.receive_data(chunk, 0.0)
        reply = framing.FrameDecoder(1 << 24).feed(b"".join(pair.worker.data_to_send()))
        assert reply[-1].type is MsgType.COMPLETION
        kept = reply[:-1] if lose else reply
        events = pair.spark.receive_data(b"".join(bytes(f.raw) for f in kept), 0.0)
        if lose:
            events += pair.spark.connection_lost()
        (ready,) = [e for e in events if isinstance(e, ProposalReady)]
        out.append((pair, ready.proposal))
    return out


def request(pair, seed: int, eos: int | None) -> RequestVerifier:
    """The verifier of the request :func:`proposals` opened on ``pair``."""
    v = verifier(pair, seed, [1, 2])
    return RequestVerifier(
        session=v.session, seed=seed, vocab_size=16, prefix=[1, 2], target=v.target, eos=eos
    )


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_a_block_whose_completion_was_lost_is_verified_as_the_complete_block(rule):
    seen = set()
    for seed in range(12):
        for depth in (1, 3, 5):
            for eos in (None, 4):
                (pair_a, whole), (pair_b, cut) = proposals(rule, depth, seed, eos)
                assert whole.cut is None
                assert cut.cut is ErrorCode.CONNECTION_LOST
                assert whole.tokens == cut.tokens
                a = request(pair_a, seed, eos).verify(whole)
                b = request(pair_b, seed, eos).verify(cut)
                assert (a.tokens, a.accepted, a.outcome) == (b.tokens, b.accepted, b.outcome)
                seen.add(len(whole.tokens) < depth)
    assert seen == {False, True}  # blocks shorter than their depth, and full ones


# -- HELLO: a peer without row_format --------------------------------------------------------


def test_a_worker_refuses_a_spark_hello_without_row_format():
    worker = WorkerProtocol(
        WorkerConfig(vocab_size=8, max_support=4, max_frame=1 << 20, max_prefix=1024),
        lambda _p: [0.0] * 8,
        session=SESSION,
        now=0.0,
    )
    worker.receive_data(older_hello_frame(hello(2)), 0.0)
    (sent,) = framing.FrameDecoder(1 << 20).feed(b"".join(worker.data_to_send()))
    assert isinstance(sent.message, Error)
    assert sent.message.code == ErrorCode.ROW_FORMAT_MISMATCH
    assert (sent.message.answers, sent.message.scope) == (MsgType.HELLO, 2)


@pytest.mark.parametrize("row_format", [None, "", "pp1-fixed-rows-v2"])
def test_a_spark_side_refuses_a_worker_hello_without_our_row_format(row_format):
    spark = spark_core.SparkProtocol(spark_config(), now=0.0)
    spark.start(0.0)
    ours = spark._hello
    assert ours is not None
    assert ours.row_format == ROW_FORMAT
    spark.data_to_send()
    theirs = msgspec.structs.replace(ours, role=1, session=SESSION)
    if row_format is None:
        frame = older_hello_frame(theirs)  # fields 1..27: field 28 omitted
    else:
        frame = framing.encode_frame(msgspec.structs.replace(theirs, row_format=row_format))
    spark.receive_data(frame, 0.0)
    sent = framing.FrameDecoder(1 << 20).feed(b"".join(spark.data_to_send()))
    (error,) = [f.message for f in sent if isinstance(f.message, Error)]
    assert error.code == ErrorCode.ROW_FORMAT_MISMATCH
    assert (error.answers, error.scope) == (MsgType.HELLO, 2)
    assert spark.closed


def test_an_older_peer_refuses_our_hello_itself():
    # A decoder of the 27-field HELLO (this one's fields before row_format) refuses our
    # 30 fields: elements too many, HEADER_INVALID (section 3.2).
    end = Hello.__struct_fields__.index("row_format")
    fields = [
        (name, f.type, f.default)
        for name, f in zip(Hello.__struct_fields__, msgspec.structs.fields(Hello), strict=True)
    ][:end]
    older = msgspec.defstruct(
        "OlderHello",
        [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields],
        array_like=True,
        forbid_unknown_fields=True,
        tag=int(MsgType.HELLO),
    )
    ours = framing.encode_frame(hello(2))[framing.PREAMBLE_SIZE :]
    with pytest.raises(msgspec.ValidationError, match="at most length 27, got 30"):
        msgspec.msgpack.decode(ours, type=older)
    assert msgspec.msgpack.decode(older_hello_frame(hello(2))[framing.PREAMBLE_SIZE :], type=older)
    assert len(MESSAGE_TYPES[MsgType.HELLO].__struct_fields__) == 30
