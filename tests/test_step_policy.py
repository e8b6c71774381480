"""The round driver's straggler allowance: how long a step waits for its late proposals.

A step waits, once its first proposal arrived, a fraction of the typical
STEP→proposal time for the others. Before any was measured (the first step),
the typical time is the one the step's first proposal took, not zero: a
worker that drafts every slot together answers them at once, and they arrive
and validate one after another, so a 2 ms floor alone would split the first
step in two and leave the halves out of step.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pp1wire.apps.driver import LocalStrategy, Plan, RoundDriver, SparkMetrics
from pp1wire.apps.models import target_factory
from pp1wire.errors import ErrorCode, Pp1Error


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


class _CuttingClient:
    """A link's client whose cut settles the flights it names, as AsyncClient.cut does."""

    def __init__(self) -> None:
        self.flights: dict[int, asyncio.Future] = {}
        self.cuts: list[tuple[list[int], ErrorCode]] = []

    def cut(self, slots: list[int], code: ErrorCode) -> None:
        self.cuts.append((list(slots), code))
        for slot in slots:
            self.flights[slot].set_exception(Pp1Error(code, "cut"))


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["requested", "agreed"])
async def test_a_stop_cuts_the_flights_at_once_on_every_rank(driver, how):
    # Before: only a rank whose own signal requested the stop cut its flights; a rank
    # that learned of it through the group's agreement (stopping) waited for its
    # proposals up to the reply timeout, and held the whole group's step with it.
    client = _CuttingClient()
    st = driver._new_request(0)
    st.round_id, st.opened, st.sent = 0, client, time.perf_counter()
    st.flight = client.flights[st.slot] = asyncio.get_running_loop().create_future()
    if how == "requested":
        driver.request_stop()
    else:
        driver.stopping = True  # agreed at an earlier step, no signal on this rank
    ready = await asyncio.wait_for(driver._ready([st]), timeout=2.0)
    assert ready == [st]  # decided in this step, with the rows that arrived (none here)
    assert client.cuts == [([st.slot], ErrorCode.SHUTTING_DOWN)]
