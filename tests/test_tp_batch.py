"""Rank 0's batcher, with a fake leader (no processes, no torch)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pp1wire.tp.batch import Batcher
from pp1wire.tp.fanout import Item


class FakeLeader:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.attempts: list[list[int]] = []
        self.release = threading.Event()
        self.entered = threading.Event()  # an attempt is in flight
        self.fail_on: int | None = None

    def lead(self, items):
        self.entered.set()
        self.release.wait(5)
        self.attempts.append([i.request for i in items])
        if self.fail_on is not None and self.fail_on in self.attempts[-1]:
            raise RuntimeError("group failed")
        return [f"decided {i.request}" for i in items]


def item(request: int) -> Item:
    return Item(request, None, None, 0)  # type: ignore[arg-type]


def test_rounds_queued_behind_an_attempt_go_out_together_distinct_and_bounded():
    async def scenario():
        leader = FakeLeader(max_batch=2)
        batcher = Batcher(leader)
        first = asyncio.ensure_future(batcher.submit(item(0)))
        assert await asyncio.to_thread(leader.entered.wait, 5)  # attempt 1 is in flight
        later = [asyncio.ensure_future(batcher.submit(item(r))) for r in (1, 1, 2, 3)]
        await asyncio.sleep(0)  # one loop turn: each submits (synchronously) and waits
        leader.release.set()
        got = await asyncio.gather(first, *later)
        batcher.close()
        return leader.attempts, got

    attempts, got = asyncio.run(scenario())
    assert attempts[0] == [0]
    # At most 2 per attempt, never one request twice in an attempt, queue order kept.
    assert attempts[1:] == [[1, 2], [1, 3]]
    assert got == ["decided 0", "decided 1", "decided 1", "decided 2", "decided 3"]


def test_a_failed_attempt_fails_every_round_in_it():
    async def scenario():
        leader = FakeLeader(max_batch=4)
        leader.fail_on = 5
        batcher = Batcher(leader)
        first = asyncio.ensure_future(batcher.submit(item(4)))
        assert await asyncio.to_thread(leader.entered.wait, 5)  # attempt 1 is in flight
        both = asyncio.gather(
            batcher.submit(item(5)), batcher.submit(item(6)), return_exceptions=True
        )
        await asyncio.sleep(0)  # one loop turn: 5 and 6 queue for attempt 2
        leader.release.set()
        results = [await first, *await both]
        batcher.close()
        return results

    results = asyncio.run(scenario())
    assert results[0] == "decided 4"
    assert all(isinstance(r, RuntimeError) for r in results[1:])


def test_call_runs_after_everything_submitted():
    async def scenario():
        leader = FakeLeader(max_batch=1)
        batcher = Batcher(leader)
        pending = [asyncio.ensure_future(batcher.submit(item(r))) for r in range(3)]
        await asyncio.sleep(0)
        leader.release.set()
        seen = await batcher.call(lambda: list(leader.attempts))
        await asyncio.gather(*pending)
        batcher.close()
        return seen

    assert asyncio.run(scenario()) == [[0], [1], [2]]


@pytest.mark.parametrize("n", [0, 1])
def test_an_idle_batcher_sends_nothing(n):
    leader = FakeLeader(max_batch=n + 1)
    Batcher(leader).close()
    assert leader.attempts == []


def test_without_torch_the_package_runs_and_tp_asks_for_the_extra():
    import sys

    from . import cli

    code = (
        "import sys; sys.modules['torch'] = None\n"  # any 'import torch' now fails
        "import pp1wire.apps.spark, pp1wire.apps.demo, pp1wire.tp.fanout, pp1wire.tp.batch\n"
        "sys.exit(pp1wire.apps.spark.main(['--tp', '2', '--worker', '127.0.0.1:9']))\n"
    )
    done = cli.run(sys.executable, "-c", code)
    assert done.returncode == 2, done.stderr
    assert "pp1-spark: --tp above 1 needs torch: pip install 'pp1wire[tp]'" in done.stderr
