"""What rank 0 publishes to the TP group, and the verifier's evaluate/apply split (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from pp1wire.apps.models import drafter_factory, target_factory
from pp1wire.errors import ErrorCode, Pp1Error, VerifyError
from pp1wire.q.proposal import propose
from pp1wire.q.rng import Role, RoundStreams
from pp1wire.q.verify import RequestVerifier, proposal_from_rows
from pp1wire.tp import fanout
from pp1wire.tp.fanout import Header, Kind

V = 24


def verifier(seed: int = 4) -> RequestVerifier:
    return RequestVerifier(
        session=3, seed=seed, vocab_size=V, prefix=[1, 2], target=target_factory(V, 1)
    )


def proposal(v: RequestVerifier, round_id: int, support: int | None):
    streams = RoundStreams(Role.WORKER, v.seed, v.generation, round_id)
    rows = propose(v.committed, 4, drafter_factory(V, 1), streams, support=support)
    return proposal_from_rows(v, rows, round_id, 4)


@pytest.mark.parametrize("support", [None, 5])
def test_rows_survive_the_payload_bit_for_bit(support):
    p = proposal(verifier(), 0, support)
    payload, sparse = fanout.pack_rows(p.rows)
    assert sparse is (support is not None)
    rows = fanout.unpack_rows(np.frombuffer(payload, dtype=np.uint8), len(p.rows), sparse)
    for a, b in zip(p.rows, rows, strict=True):
        assert a.token == b.token
        assert np.array_equal(a.dense_counts(V), b.dense_counts(V))
    header = fanout.header_of(0, p, payload, sparse)
    again = Header.from_words(header.words(), fanout.max_payload(V))
    assert again == header
    assert fanout.proposal_of(again, rows).tokens == p.tokens


def test_a_payload_whose_lengths_do_not_fill_it_is_refused():
    payload, _ = fanout.pack_rows(proposal(verifier(), 0, None).rows)
    buf = np.concatenate([payload, np.zeros(4, dtype=np.uint8)])
    with pytest.raises(Pp1Error) as info:
        fanout.unpack_rows(buf, 4, False)
    assert info.value.code is ErrorCode.GROUP_HEADER_INVALID


def test_headers_out_of_bounds_are_refused_before_any_allocation():
    too_big = Header(kind=Kind.PROPOSAL, rows=1, nbytes=fanout.max_payload(V) + 1)
    with pytest.raises(Pp1Error) as info:
        Header.from_words(too_big.words(), fanout.max_payload(V))
    assert info.value.code is ErrorCode.GROUP_HEADER_INVALID
    words = Header(kind=Kind.PROPOSAL).words()
    words[0] = 9
    with pytest.raises(Pp1Error):
        Header.from_words(words, fanout.max_payload(V))


def test_evaluate_commits_nothing_and_apply_commits_what_verify_would():
    v, alone = verifier(), verifier()
    for round_id in range(5):
        p = proposal(v, round_id, None)
        before = (list(v.committed), v.digest, v.last_round)
        result = v.evaluate(p)
        assert (list(v.committed), v.digest, v.last_round) == before
        words = fanout.encode_outcome(result, None)
        decoded, reason = fanout.decode_outcome(words)
        assert reason is None
        assert decoded is not None
        v.apply(decoded)
        want = alone.verify(proposal(alone, round_id, None))
        assert decoded.tokens == want.tokens
        assert v.committed == alone.committed
        assert v.digest == alone.digest
    with pytest.raises(VerifyError) as info:
        v.apply(decoded)  # the same round twice
    assert info.value.code is ErrorCode.ROUND_REUSED


def test_target_only_evaluation_equals_decode_and_discard_clears_a_failure():
    v, alone = verifier(), verifier()
    result = v.evaluate_target_only(0)
    assert v.committed == alone.committed
    v.apply(result)
    assert result.tokens == alone.decode_target_only(0).tokens
    assert v.committed == alone.committed

    calls = {"n": 0}
    good = target_factory(V, 1)

    def flaky(prefix):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("transient")
        return good(prefix)

    w = RequestVerifier(session=3, seed=4, vocab_size=V, prefix=[1, 2], target=flaky)
    with pytest.raises(VerifyError):
        w.evaluate_target_only(0)
    assert w.poisoned
    w.discard()
    w.apply(w.evaluate_target_only(0))
    assert w.committed == verifier().committed[:2] + list(result.tokens)


def test_an_unreadable_outcome_reads_as_a_failure():
    words = fanout.encode_outcome(None, ErrorCode.TARGET_FAILED)
    assert fanout.decode_outcome(words) == (None, ErrorCode.TARGET_FAILED)
    bad = fanout.encode_outcome(verifier().evaluate_target_only(0), None)
    bad[4] = 99  # more tokens than a round can commit
    assert fanout.decode_outcome(bad) == (None, ErrorCode.GROUP_OUTCOME_MISMATCH)


def test_requests_are_dealt_round_robin():
    assert [fanout.owner_of(i, 2) for i in range(5)] == [0, 1, 0, 1, 0]
    assert [fanout.owner_of(i, 3) for i in range(4)] == [0, 1, 2, 0]


def test_an_attempt_naming_one_request_twice_is_refused():
    p = proposal(verifier(), 0, None)
    payload, sparse = fanout.pack_rows(p.rows)
    entry = fanout.header_of(3, p, payload, sparse)
    words = fanout.batch_words(1, [entry, entry], 4)
    with pytest.raises(Pp1Error) as info:
        fanout.read_batch(words, 4, fanout.max_payload(V))
    assert info.value.code is ErrorCode.GROUP_HEADER_INVALID
    assert fanout.read_batch(fanout.batch_words(1, [entry], 4), 4, fanout.max_payload(V))[1] == [
        entry
    ]


def test_sessions_and_contexts_above_2_63_survive_the_attempt_header():
    # Before: the header wrote the session as it came, and a session of 2**63 or more
    # overflowed the int64 word (the context likewise).
    h = Header(Kind.PROPOSAL, request=3, session=(1 << 64) - 5, context=(1 << 63) + 7, rows=1)
    assert Header.from_words(h.words(), max_payload=1) == h
