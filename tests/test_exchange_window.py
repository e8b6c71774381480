"""The sharded worker group's exchange window: only keys that can match, shared fairly.

Two worker ranks run as threads of this process (``benchmarks/exchange_window.py``
holds the harness, and measures the same thing over more sizes). Before, each
exchange sent a rank's oldest 64 held keys whatever they were, so 100 STEPs that
could never match delayed a legitimate STEP until they expired (5 s, the
match timeout, measured 5.0-5.4 s: it was answered GROUP_UNMATCHED).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "exchange_window", ROOT / "benchmarks" / "exchange_window.py"
)
assert _spec is not None
assert _spec.loader is not None
window = importlib.util.module_from_spec(_spec)
sys.modules["exchange_window"] = window
_spec.loader.exec_module(window)

# The bound the window must keep a legitimate STEP under, declared before it runs:
# an idle group answers in tens of milliseconds; 0.5 s leaves a loaded machine room
# and is a tenth of the match timeout that the old window made it wait.
BOUND = 0.5


@pytest.fixture(scope="module")
def ranks():
    with window.worker_ranks() as running:
        yield running


def test_a_legitimate_step_under_250_unmatched_ones_is_answered_within_half_a_second(ranks):
    # 250 STEPs of a session with a link on rank 0 only, and 250 of a session with a
    # link on both ranks that sends on rank 0 only: held first, all older.
    took, statuses = window.legitimate_wait(ranks, 250)
    assert statuses == [0, 0], statuses  # drawn, not GROUP_UNMATCHED
    assert took < BOUND, took


def test_a_session_whose_other_link_comes_late_still_matches(ranks):
    # Its first exchanges find it on rank 0 only (its key stays out of the window);
    # once rank 1's link is there, the key enters and matches.
    tag = time.monotonic_ns().to_bytes(8, "little")
    nonce = tag + b"\x09" * 8
    answered: list[int] = []
    both = threading.Event()

    def done(result) -> None:
        answered.append(result.status)
        if len(answered) == 2:
            both.set()

    ranks[0].join("early", nonce)
    ranks[0].submit("early", window.step_job(4), done)
    time.sleep(0.6)  # at least two exchanges (the beat is 0.25 s)
    ranks[1].join("late", nonce)
    started = time.monotonic()
    ranks[1].submit("late", window.step_job(4), done)
    assert both.wait(window.MATCH_TIMEOUT), answered
    assert time.monotonic() - started < BOUND
    assert answered == [0, 0], answered
    ranks[0].leave("early")
    ranks[1].leave("late")
