"""The committed prefix costs O(new tokens) per round: incremental digest, no prefix copies."""

from __future__ import annotations

import tracemalloc
from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pp1wire.q import proposal as proposal_module
from pp1wire.q.proposal import ExtendedPrefix, PrefixDigest, prefix_digest
from pp1wire.wire.spark_events import ProposalReady

from . import pairs
from .pairs import VOCAB, make_pair, step

tokens = st.lists(st.integers(0, 0x7FFFFFFF), max_size=40)


@given(st.lists(tokens, max_size=8))
def test_the_incremental_digest_is_the_one_shot_digest_at_every_length(chunks):
    running = PrefixDigest()
    seen: list[int] = []
    for chunk in chunks:
        before = running.copy()
        running.extend(chunk)
        seen += chunk
        assert running.value == prefix_digest(seen)
        assert before.value == prefix_digest(seen[: len(seen) - len(chunk)])  # copies are apart
        assert running.length == len(seen)


def test_a_bad_token_extends_nothing():
    running = PrefixDigest([1, 2])
    with pytest.raises(ValueError, match="int32"):
        running.extend([3, -1])
    assert running.value == prefix_digest([1, 2])


@given(tokens, tokens, st.data())
def test_an_extended_prefix_reads_like_the_list_it_stands_for(base, tail, data):
    view = ExtendedPrefix(array("i", base))
    for t in tail:
        view.append(t)
    whole = base + tail
    assert len(view) == len(whole)
    assert list(view) == whole
    if whole:
        i = data.draw(st.integers(-len(whole), len(whole) - 1))
        assert view[i] == whole[i]
    start = data.draw(st.integers(-50, 50) | st.none())
    stop = data.draw(st.integers(-50, 50) | st.none())
    step = data.draw(st.sampled_from([None, 1, 2, -1, -3]))
    assert view[start:stop:step] == whole[start:stop:step]
    with pytest.raises(IndexError):
        view[len(whole)]


MILLION = 1_000_000


@pytest.fixture
def hashed_bytes(monkeypatch):
    """Counts the bytes every prefix digest hashes from here on."""
    counted = [0]
    original = proposal_module._token_bytes

    def counting(tokens):
        data = original(tokens)
        counted[0] += memoryview(data).nbytes
        return data

    monkeypatch.setattr(proposal_module, "_token_bytes", counting)
    return counted


def test_rounds_at_a_million_token_prefix_touch_only_the_new_tokens(hashed_bytes):
    # Work per round must not grow with the prefix: hashing it again (4 MB) or
    # copying it (4 MB as int32, 8 MB and more as a list) would show here.
    pair = make_pair(worker_kw={"max_prefix": MILLION}, spark_kw={"max_prefix": MILLION})
    prefix = (np.arange(MILLION) % VOCAB).tolist()
    pair.spark.open_slot(0, seed=3, prefix=prefix)
    pair.pump()
    verifier = pairs.verifier(pair, 3, prefix)
    del prefix

    def one_round() -> None:
        round_id = step(pair.spark, 0, depth=3, temperature=1.0, support=0, now=0.0)
        (ready,) = [e for e in pair.pump() if isinstance(e, ProposalReady)]
        result = verifier.verify(ready.proposal)
        committed = verifier.committed[-(result.accepted + 1) :]
        pair.spark.release_proposal(0, round_id)
        pair.spark.commit(0, round_id=round_id, tokens=committed, accepted=result.accepted)
        pair.pump()

    # The first round grows each side's prefix container once (amortized
    # over-allocation leaves room for the rounds measured after it).
    one_round()
    hashed_bytes[0] = 0
    tracemalloc.start()
    try:
        for _ in range(5):
            one_round()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    hashed = hashed_bytes[0]
    assert pair.worker.slots[0].digest == prefix_digest(verifier.committed)
    assert pair.spark.slots[0].digest == verifier.digest
    # Each round hashes at most its 4 new tokens on each of three sides.
    assert hashed <= 5 * 3 * 4 * 4, hashed
    assert peak < 1 << 20, peak
