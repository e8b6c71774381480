"""A drafter of fixed cost for ``benchmarks/run.py``: the toy drafter at 40 ms per call.

The fixed-cost target and drafter of ``benchmarks/speedup.py`` and ``pp1-demo``
are in the package (:mod:`pp1wire.apps.paced`); this one only makes a draw
slow enough (a depth-5 draw: 200 ms) that ``run.py`` can ping the worker while
one runs. Used as ``--drafter paced:slow_drafter_factory`` with this folder on
``PYTHONPATH``.
"""

from __future__ import annotations

from pp1wire.apps.models import ToyLM
from pp1wire.apps.paced import CONTEXTS, PacedModel

SLOW_DRAFTER_SECONDS = 40e-3


def slow_drafter_factory(vocab_size: int, seed: int = 0) -> PacedModel:
    """The toy drafter's logits at 40 ms per call (a prefix or a batch)."""
    model = ToyLM(vocab_size, seed, draft=True)
    contexts = [[t] for t in range(min(CONTEXTS, vocab_size))]
    return PacedModel(model.logits_batch(contexts), SLOW_DRAFTER_SECONDS)
