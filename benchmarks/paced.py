"""Toy plugins with a fixed cost per call, standing in for a real target and drafter.

``target_factory``: the toy target, 5 ms per call (a forward pass); ``drafter_factory``:
the toy drafter, 0.5 ms per call. The cost is a sleep, which releases the GIL
as a call into a GPU runtime would. Used by ``benchmarks/speedup.py`` as
``--target benchmarks.paced:target_factory`` and ``--drafter
benchmarks.paced:drafter_factory`` (run from the repository root).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from pp1wire.apps.models import ToyLM

TARGET_SECONDS = 5e-3
DRAFTER_SECONDS = 0.5e-3


def _paced(
    fn: Callable[[Sequence[int]], npt.NDArray[np.float64]], seconds: float
) -> Callable[[Sequence[int]], npt.NDArray[np.float64]]:
    def call(prefix: Sequence[int]) -> npt.NDArray[np.float64]:
        time.sleep(seconds)
        return fn(prefix)

    return call


def target_factory(
    vocab_size: int, seed: int = 0
) -> Callable[[Sequence[int]], npt.NDArray[np.float64]]:
    """The toy target's probabilities, at 5 ms per call."""
    return _paced(ToyLM(vocab_size, seed).probs, TARGET_SECONDS)


def drafter_factory(
    vocab_size: int, seed: int = 0
) -> Callable[[Sequence[int]], npt.NDArray[np.float64]]:
    """The toy drafter's logits, at 0.5 ms per call."""
    return _paced(ToyLM(vocab_size, seed, draft=True).logits, DRAFTER_SECONDS)


SLOW_DRAFTER_SECONDS = 40e-3


def slow_drafter_factory(
    vocab_size: int, seed: int = 0
) -> Callable[[Sequence[int]], npt.NDArray[np.float64]]:
    """The toy drafter's logits at 40 ms per call: a depth-5 draw takes 200 ms
    (``benchmarks/run.py`` pings the worker while one runs)."""
    return _paced(ToyLM(vocab_size, seed, draft=True).logits, SLOW_DRAFTER_SECONDS)
