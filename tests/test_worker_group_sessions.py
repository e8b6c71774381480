"""Group sessions of a sharded worker group: the exchange window, and who may join.

Two worker ranks run as threads of this process (``benchmarks/exchange_window.py``
holds the harness, and measures the window over more sizes).

The window: before, each exchange sent a rank's oldest 64 held keys whatever they
were, so 100 STEPs that could never match delayed a legitimate STEP until they
expired (5 s, the match timeout, measured 5.0-5.4 s: it was answered
GROUP_UNMATCHED). Now only keys that can match enter it, shared fairly.

Joining: a group nonce travels in clear without TLS. Before, once a link of a
session dropped, any peer presenting its nonce took its place on that rank and
was matched with the STEPs the session's other links still held: it received
that round's drafted tokens. Now the nonce stays closed on that rank while the
session lives on.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

from .waiting import wait_until

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


MATCH_TIMEOUT = 2.0  # the ranks' match timeout: longer than any measurement of the window


@pytest.fixture(scope="module")
def ranks():
    with window.worker_ranks(match_timeout=MATCH_TIMEOUT) as running:
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
    assert both.wait(MATCH_TIMEOUT), answered
    assert time.monotonic() - started < BOUND
    assert answered == [0, 0], answered
    ranks[0].leave("early")
    ranks[1].leave("late")


class Answers:
    """The statuses of the STEPs a link submitted, as they are answered."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self._lock = threading.Condition()

    def done(self, result) -> None:
        with self._lock:
            self.statuses.append(result.status)
            self._lock.notify_all()

    def wait(self, count: int, timeout: float) -> list[int]:
        with self._lock:
            self._lock.wait_for(lambda: len(self.statuses) >= count, timeout)
            return list(self.statuses)


def test_a_dropped_links_nonce_is_closed_to_newcomers_while_its_session_lives(ranks):
    from pp1wire.errors import ErrorCode

    nonce = time.monotonic_ns().to_bytes(8, "little") + b"\x0b" * 8
    victim, thief = Answers(), Answers()
    ranks[0].join("victim-0", nonce)
    ranks[1].join("victim-1", nonce)
    ranks[0].submit("victim-0", window.step_job(6), victim.done)
    ranks[1].leave("victim-1")  # rank 1's link drops before its copy of the STEP arrives
    # Before: the thief joined, sent the predictable matching STEP, and was drawn
    # with the victim's (its reply: the victim's drafted tokens).
    assert not ranks[1].join("thief", nonce)
    ranks[1].submit("thief", window.step_job(6), thief.done)
    assert thief.wait(1, 5) == [int(ErrorCode.INTERNAL)]  # not a link of the group
    assert victim.wait(1, MATCH_TIMEOUT + 5) == [int(ErrorCode.GROUP_UNMATCHED)]
    # Past the match timeout, still closed while rank 0's link of the session lives.
    assert not ranks[1].join("thief", nonce)
    # Once the session is gone from every rank (an exchange says so), the nonce is
    # free: nothing of the session is left to match.
    ranks[0].leave("victim-0")
    wait_until(lambda: ranks[1].join("later", nonce), 5, "the nonce freed once its session ended")
    ranks[1].leave("later")
