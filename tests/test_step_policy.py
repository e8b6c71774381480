"""The round driver's straggler allowance: how long a step waits for its late proposals.

A step waits, once its first proposal arrived, a fraction of the typical
STEP→proposal time for the others. Before any was measured (the first step),
the typical time is the one the step's first proposal took, not zero: a
worker that drafts every slot together answers them at once, and they arrive
and validate one after another, so a 2 ms floor alone would split the first
step in two and leave the halves out of step.
"""

from __future__ import annotations

import pytest

from pp1wire.apps.driver import LocalStrategy, Plan, RoundDriver, SparkMetrics
from pp1wire.apps.models import target_factory


@pytest.fixture
def driver():
    plan = Plan(
        requests=2, concurrency=2, max_tokens=4, depth=5, support=0, temperature=1.0,
        seed=0, eos=None, audit=False, vocab_size=16, prompts=[[1, 2]],
    )  # fmt: skip
    target = target_factory(16, 0)
    d = RoundDriver(plan, LocalStrategy(target.batch), target, None, SparkMetrics(5))
    yield d
    d._thread.shutdown(wait=False)


def test_before_any_measure_the_first_proposals_time_sets_the_allowance(driver):
    assert driver.straggler_wait(0.040) == pytest.approx(0.020)
    assert driver.straggler_wait(0.0) == pytest.approx(0.002)  # the floor


def test_once_measured_the_median_of_the_recent_round_trips_does(driver):
    driver.recent_trips.extend([0.010, 0.030, 0.050])
    assert driver.straggler_wait(0.5) == pytest.approx(0.015)
    driver.recent_trips.extend([0.001] * 100)  # only the last 64 count
    assert driver.straggler_wait(0.5) == pytest.approx(0.002)


def test_the_window_keeps_rolling_past_the_summarys_first_100000(driver):
    # The summary's median keeps the run's first 100,000 round trips; the straggler
    # window must follow the recent ones for the whole run.
    for _ in range(100_000):
        driver.record_trip(0.001)
    for _ in range(64):
        driver.record_trip(0.100)
    assert len(driver.round_trips) == 100_000
    assert driver.straggler_wait(0.5) == pytest.approx(0.050)
