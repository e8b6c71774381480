"""Drafter plugins whose faults depend on the drafted tokens, for ``tests/test_fault_law.py``.

Both are the toy drafter, except on a context that ends in :data:`TRIGGER`:
``failing_drafter_factory`` raises there (a drafter that cannot continue after
that token), and ``slow_drafter_factory`` sleeps :data:`SLOW_S` seconds before
answering (a drafter slower for some contexts, past the Spark side's reply
timeout). The trigger and the sleep come from the environment
(``PP1_TEST_TRIGGER``, ``PP1_TEST_SLOW_S``) so that a test sets them for the
worker process it starts; with ``PP1_TEST_AT_LENGTH`` set, the fault hits a
context of that many tokens instead (a block's second row after a prompt one
token shorter, whatever was drafted). A batched call sleeps once when any of
its prefixes triggers, as a device batch takes as long as its slowest row.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pp1wire.apps.models import toy_drafter

TRIGGER = int(os.environ.get("PP1_TEST_TRIGGER", "4"))
SLOW_S = float(os.environ.get("PP1_TEST_SLOW_S", "0.2"))
AT_LENGTH = int(os.environ.get("PP1_TEST_AT_LENGTH", "0"))


def _hits(prefix: Sequence[int]) -> bool:
    if AT_LENGTH:
        return len(prefix) == AT_LENGTH
    return len(prefix) > 0 and int(prefix[-1]) == TRIGGER


class _Faulty:
    def __init__(self, vocab_size: int, seed: int, how: str) -> None:
        self.model = toy_drafter(vocab_size, seed)
        self.how = how

    def _fault(self, prefixes: Sequence[Sequence[int]]) -> None:
        if not any(_hits(p) for p in prefixes):
            return
        if self.how == "fail":
            raise RuntimeError(f"the drafter cannot continue after token {TRIGGER}")
        time.sleep(SLOW_S)

    def __call__(self, prefix: Sequence[int]) -> np.ndarray:
        self._fault([prefix])
        return self.model.logits(prefix)

    def batch(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        if self.how == "fail":  # each prefix fails on its own, as a per-row plugin does
            return np.stack([self(p) for p in prefixes])
        self._fault(prefixes)
        return self.model.logits_batch(prefixes)


def failing_drafter_factory(vocab_size: int, seed: int) -> Any:
    """The toy drafter, raising on a context that ends in :data:`TRIGGER`."""
    return _Faulty(vocab_size, seed, "fail")


def slow_drafter_factory(vocab_size: int, seed: int) -> Any:
    """The toy drafter, :data:`SLOW_S` seconds slower on a context ending in :data:`TRIGGER`."""
    return _Faulty(vocab_size, seed, "slow")
