"""``pp1-demo`` and its fixed-cost plugins: what a new user runs first."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

from pp1wire.apps import demo, ngram, paced
from pp1wire.apps.launch import pinned, split_cores
from pp1wire.apps.models import ToyLM

from . import cli


class Clock:
    """A fake ``time`` for :mod:`pp1wire.apps.paced`: sleeping moves it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_paced_call_costs_its_pace_whether_it_scores_one_prefix_or_a_batch(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(paced, "time", clock)
    monkeypatch.setenv(paced.TARGET_MS_ENV, "20")
    target = paced.target_factory(300, 1)
    one = target([5, 7])
    many = target.batch([[5, 7], [1], [], [64 + 7]] * 4)
    assert clock.sleeps == pytest.approx([0.020, 0.020])  # one deadline per call, not per prefix
    # The rows are the toy target's after the last token (mod the tabulated contexts).
    want = ToyLM(300, 1).probs([7])
    np.testing.assert_array_equal(one, want)
    np.testing.assert_array_equal(many[0], want)
    np.testing.assert_array_equal(many[3], want)  # 71 % 64 == 7
    np.testing.assert_array_equal(many[2], ToyLM(300, 1).probs([0]))
    assert not one.flags.writeable  # shared rows: no caller may change them


def test_the_paced_drafter_is_the_toy_drafter_at_its_own_pace(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(paced, "time", clock)
    monkeypatch.delenv(paced.DRAFTER_MS_ENV, raising=False)
    drafter = paced.drafter_factory(50, 2)
    rows = drafter.batch([[3], [49]])
    assert clock.sleeps == pytest.approx([paced.DEFAULT_DRAFTER_MS / 1e3])
    model = ToyLM(50, 2, draft=True)
    np.testing.assert_array_equal(rows[0], model.logits([3]))
    np.testing.assert_array_equal(rows[1], model.logits([49]))


@pytest.mark.parametrize("raw", ["-1", "nan", "1e9", "fast"])
def test_a_meaningless_pace_is_refused(monkeypatch, raw):
    monkeypatch.setenv(paced.TARGET_MS_ENV, raw)
    with pytest.raises(ValueError, match=paced.TARGET_MS_ENV):
        paced.target_factory(8, 0)


@pytest.fixture(scope="module")
def ngram_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a demo whose n-gram pair is cached in a folder of this module's."""
    return {**os.environ, ngram.CACHE_ENV: str(tmp_path_factory.mktemp("ngram-cache"))}


@pytest.mark.parametrize("pair", ["ngram", "toy"])
def test_the_demo_shows_target_only_and_speculative_side_by_side(pair, ngram_cache):
    # The n-gram pair by default; the toy run also leaves the daemons unpinned.
    models = [] if pair == "ngram" else ["--models", "toy", "--no-pin"]
    done = cli.run(
        sys.executable, "-m", "pp1wire.apps.demo", *models,
        "--vocab", "256", "--requests", "2", "--max-tokens", "6",
        "--target-ms", "2", "--drafter-ms", "0",
        timeout=120, env=ngram_cache,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # The commands, as a user would type them, each side on its half of the cores.
    halves = split_cores() if pair == "ngram" else None
    pins = ("", "") if halves is None else (f"taskset -c {cores(h)} " for h in halves)
    worker_pin, spark_pin = pins
    assert f"PP1_PACED_TARGET_MS=2 {spark_pin}pp1-spark" in out
    assert f"PP1_PACED_DRAFTER_MS=0 {worker_pin}pp1-worker" in out
    # The drafter hands over probabilities by default, as a draft head on a device does.
    drafter = {
        "ngram": "pp1wire.apps.ngram:paced_probs_drafter_factory",
        "toy": "pp1wire.apps.paced:probs_drafter_factory",
    }[pair]
    assert f"--drafter {drafter}" in out
    plugins = {"ngram": "pp1wire.apps.ngram:paced_", "toy": "pp1wire.apps.paced:"}[pair]
    assert f"--target {plugins}target_factory" in out
    title = {"ngram": "n-gram pair", "toy": "toy pair"}[pair]
    assert f"({title}, drafter hands over probs, vocabulary 256)" in out
    if pair == "ngram":  # both sides declare the tables they were built from
        drafter_id, target_id = (
            f"pp1-ngram{order}-d{d:g}-" for order, d in ((4, 0.5), (5, 0.4))
        )
        assert out.count(f"--target-identity {target_id}") == 4  # the worker and 3 runs
        assert f"--draft-identity {drafter_id}" in out
    rates = {}
    for title in ("target-only", "speculative, dense q", "speculative, sparse:32 q"):
        line = re.search(rf"^  {re.escape(title)} +([0-9.]+) +([0-9.]+)x", out, re.MULTILINE)
        assert line is not None, out
        rates[title] = (float(line[1]), float(line[2]))
    plain = rates["target-only"][0]
    for rate, ratio in rates.values():
        # Each ratio against the target-only run of the same demo (to the digits printed).
        assert ratio == pytest.approx(rate / plain, abs=0.006)
    assert "worker stopped on SIGTERM, exit code 0" in out


def cores(on: list[int]) -> str:
    return ",".join(map(str, on))


def test_a_pinned_command_runs_on_the_cores_it_names():
    mine = sorted(os.sched_getaffinity(0))
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    done = cli.run(*pinned([sys.executable, "-c", code], mine[-1:]), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(mine[-1:])


@pytest.mark.parametrize("pair", ["ngram", "toy"])
def test_the_in_process_demo_runs_either_pair(pair, ngram_cache, monkeypatch):
    monkeypatch.setenv(ngram.CACHE_ENV, ngram_cache[ngram.CACHE_ENV])
    stats = demo.run_in_process(
        pair=pair, vocab_size=512, seed=0, requests=2, max_tokens=8, depth=3, support=32,
        temperature=1.0, prompt=[1, 2, 3],
    )  # fmt: skip
    assert stats["tokens"] >= 2 * 8
    assert 0 < stats["mean_accepted_length"] <= 3


def test_the_demo_without_the_text_says_so_and_names_the_toy_pair(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, ngram.TEXT_MODULE, None)
    monkeypatch.setattr(ngram, "_memo", {})
    assert demo.main(["--vocab", "64", "--requests", "1", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "pydoc_data.topics" in err
    assert "--models toy" in err
