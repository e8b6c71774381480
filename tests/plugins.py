"""Target plugins that fail on purpose, for the tests of the one failure rule.

``failing_target_factory`` builds the toy target, except that, for a prefix
starting with :data:`MARK` (the prompt a test gives one request), it does what
:data:`FAULT` says: ``raise`` (the plugin fails), ``nan`` (a row that is not a
distribution) or ``vanish`` (the rank's thread ends, as a killed rank
process would). ``FAULT["rank"]`` limits the fault to the thread of
that rank when a group runs as threads (``tests/groups.py``: rank r's target
is built on the thread named ``rank-r``); None: everywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from pp1wire.apps.models import ToyLM

MARK = (9, 9)


class Vanished(BaseException):
    """Ends a rank's thread: not an Exception, so nothing on the way catches it."""


FAULT: dict[str, Any] = {"how": "raise", "rank": None}


def failing_target_factory(vocab_size: int, seed: int) -> Any:
    base = ToyLM(vocab_size, seed)
    # Each rank builds its target on its own thread (its calls run on others).
    built_on = threading.current_thread().name

    def target(prefix: Sequence[int]) -> np.ndarray:
        p = base.probs(prefix)
        rank = FAULT["rank"]
        if tuple(prefix[: len(MARK)]) != MARK:
            return p
        if rank is not None and built_on != f"rank-{rank}":
            return p
        if FAULT["how"] == "raise":
            raise RuntimeError("device lost")
        if FAULT["how"] == "nan":
            return np.full_like(p, np.nan)
        raise Vanished(built_on)

    return target
