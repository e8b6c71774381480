"""Writing a drafter plugin and a target plugin.

A plugin is ``module:factory``; the factory is called with ``vocab_size=`` and
``seed=`` and returns a callable from a token prefix to one row over the global
vocabulary: logits for a drafter (``pp1-worker --drafter``), probabilities (or
non-negative weights) for a target (``pp1-spark --target``). Both must be
deterministic functions of the prefix.

Here the target is a smoothed bigram model with a repetition penalty, and the
drafter a cheaper unigram-ish approximation of it. Run both daemons with them:

    PYTHONPATH=examples pp1-worker --port 7070 --vocab 1000 --drafter plugins:drafter_factory
    PYTHONPATH=examples pp1-spark --worker 127.0.0.1:7070 --vocab 1000 \\
        --target plugins:target_factory --requests 4 --max-tokens 32

or simply ``python examples/plugins.py``, which does exactly that on a free port.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
from daemons import command, running_worker

Row = npt.NDArray[np.float64]


def _tables(vocab_size: int, seed: int) -> tuple[Row, npt.NDArray[np.float64]]:
    rng = np.random.default_rng(seed)
    unigram = rng.dirichlet(np.full(vocab_size, 0.3))
    shift = rng.integers(1, vocab_size, size=vocab_size)
    return unigram, shift.astype(np.float64)


def target_factory(vocab_size: int, seed: int) -> Callable[[Sequence[int]], Row]:
    """Target plugin: bigram-ish probabilities with a repetition penalty."""
    unigram, shift = _tables(vocab_size, seed)

    def target(prefix: Sequence[int]) -> Row:
        p = unigram.copy()
        if prefix:
            favourite = int((prefix[-1] + shift[prefix[-1]]) % vocab_size)
            p[favourite] += 0.5  # a strong "next token" given the last one
            for token in set(prefix[-8:]):
                p[token] *= 0.3  # repetition penalty, a pure function of the prefix
        return p / p.sum()

    return target


def drafter_factory(vocab_size: int, seed: int) -> Callable[[Sequence[int]], Row]:
    """Drafter plugin: the same structure without the penalty, as logits."""
    unigram, shift = _tables(vocab_size, seed)

    def drafter(prefix: Sequence[int]) -> Row:
        w = unigram.copy()
        if prefix:
            w[int((prefix[-1] + shift[prefix[-1]]) % vocab_size)] += 0.5
        return np.log(w)

    return drafter


def main() -> int:
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(here)}
    plugin = ("--drafter", "plugins:drafter_factory")
    with running_worker(*plugin, "--vocab", "1000", "--log-level", "warning", env=env) as address:
        done = subprocess.run(
            [
                command("pp1-spark"),
                "--worker",
                address,
                "--vocab",
                "1000",
                "--target",
                "plugins:target_factory",
                "--requests",
                "4",
                "--max-tokens",
                "32",
            ],
            env=env,
            check=False,
        )
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
