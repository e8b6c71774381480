"""The built-in toy models' batched forms give exactly the per-prefix rows."""

from __future__ import annotations

import numpy as np
import pytest

from pp1wire.apps.models import ToyLM, drafter_factory, target_factory
from pp1wire.q.proposal import ExtendedPrefix, batched_drafter
from pp1wire.q.verify import batched


@pytest.mark.parametrize("vocab", [2, 37, 4097, 129_280])
def test_batch_rows_equal_the_per_prefix_rows_bit_for_bit(vocab):
    prefixes = [[], [1], [5, 1], [vocab - 1], [3, 0], [1], ExtendedPrefix([2, 7 % vocab])]
    for draft in (False, True):
        model = ToyLM(vocab, 5, draft=draft)
        logits = model.logits_batch(prefixes)
        probs = model.probs_batch(prefixes)
        assert logits.shape == probs.shape == (len(prefixes), vocab)
        for i, p in enumerate(prefixes):
            assert logits[i].tobytes() == model.logits(p).tobytes()
            assert probs[i].tobytes() == model.probs(p).tobytes()


def test_the_plugins_offer_their_batch_form():
    drafter, target = drafter_factory(300, 2), target_factory(300, 2)
    prefixes = [[1, 2], [4], []]
    assert batched_drafter(drafter) == drafter.batch
    assert batched(target) == target.batch
    assert np.array_equal(drafter.batch(prefixes), np.stack([drafter(p) for p in prefixes]))
    assert np.array_equal(target.batch(prefixes), np.stack([target(p) for p in prefixes]))
    model = ToyLM(300, 2)
    assert batched(model) == model.batch  # the model itself is a target plugin too
    assert model(prefixes[0]).tobytes() == target(prefixes[0]).tobytes()


def test_an_empty_batch_has_no_rows():
    assert ToyLM(10, 0).logits_batch([]).shape == (0, 10)
    assert ToyLM(10, 0).probs_batch([]).shape == (0, 10)
