"""Prepared blocks (``pp1-worker --prepare``, docs/adaptive.md §8) through the daemons.

A served prepared block is the block the STEP would have drawn: the draws are keyed by
seed, generation, round and position, and the block is served only to the STEP whose
every field it was drawn for. So a worker that prepares emits, for the same seeds,
exactly the tokens of one that does not: the recorded tokens of
``tests/data/reference_tokens.json``, with one rank and a replicated TP2 group. The
tests also check that prepared blocks were really served (the metrics count them).
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections import Counter
from math import sqrt
from pathlib import Path

import numpy as np
import pytest

from pp1wire.apps import worker as worker_app
from pp1wire.apps.launch import worker_process
from pp1wire.apps.settings import SettingsError
from pp1wire.q.proposal import DraftJob, QRow
from pp1wire.wire.prepared import Hypothesis, PreparedBlocks, hypotheses, key_of, runner_up

from .groups import lead, run_group, run_one, tokens
from .test_e2e import SEED, VOCAB, spark

REFERENCE = json.loads((Path(__file__).parent / "data" / "reference_tokens.json").read_text())
NAMES = [n for n, c in REFERENCE.items() if (c["vocab"], c["seed"]) == (1000, 7)]


def _argv(name: str, address: str) -> list[str]:
    c = REFERENCE[name]
    return ["--worker", address, "--vocab", str(c["vocab"]), "--seed", str(c["seed"]), *c["args"]]


def _counts(metrics: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    found = re.findall(rf'^{name}_total{{hypothesis="([^"]+)"}} (\S+)$', text, re.M)
    return {h: float(v) for h, v in found}


@pytest.fixture(scope="module")
def preparing():
    """A worker that prepares three blocks a slot, with its metrics."""
    with worker_process("--prepare", "3", "--metrics-port", "0", vocab=1000, seed=7) as w:
        yield w


@pytest.mark.parametrize("name", NAMES)
def test_a_preparing_worker_emits_the_recorded_tokens(preparing, name):
    done = run_one(*_argv(name, preparing.address))
    assert done.code == 0
    assert tokens(done) == REFERENCE[name]["tokens"]


def test_a_replicated_tp2_group_on_a_preparing_worker_emits_the_recorded_tokens(preparing):
    pytest.importorskip("torch")
    for name in ("dense-d5", "sparse32-d5"):
        done = lead(run_group(2, *_argv(name, preparing.address)))
        assert done.code == 0
        assert tokens(done) == REFERENCE[name]["tokens"], name


def test_prepared_blocks_were_served_by_hypothesis(preparing):
    # After the runs above (module order): blocks were prepared and some served.
    run_one(*_argv("dense-d5", preparing.address))
    made = _counts(preparing.metrics, "pp1_worker_prepared_blocks")
    used = _counts(preparing.metrics, "pp1_worker_prepared_used")
    assert made.get("bonus", 0) > 0, made
    assert made.get("reject@1", 0) > 0, made
    assert sum(used.values()) > 0, (made, used)
    assert all(used[h] <= made[h] for h in used)


def test_a_principal_a_rate_bounds_gets_no_prepared_blocks():
    # Its budget counts the draws it asks for (docs/adaptive.md §8): none is drawn for it.
    with worker_process(
        "--prepare", "3", "--principal-rate", "1000", "--metrics-port", "0", vocab=1000, seed=7
    ) as w:
        done = run_one(*_argv("dense-d5", w.address))
        assert tokens(done) == REFERENCE["dense-d5"]["tokens"]
        assert _counts(w.metrics, "pp1_worker_prepared_blocks") == {}


def test_prepare_is_refused_where_it_cannot_run():
    for flags in (["--vocab-shards", "2"], ["--draw-threads", "0"]):
        args = worker_app.build_parser().parse_args(["--prepare", "1", *flags])
        with pytest.raises(SettingsError, match="--prepare needs"):
            worker_app.config_from(args)


# -- the hypotheses and the store, alone -------------------------------------------


def _job(**kw):
    base = {"seed": 5, "generation": 1, "round_id": 3, "prefix": (1, 2), "depth": 3}
    return DraftJob(**{**base, **kw})


def test_runner_up_is_the_likeliest_other_token_dense_and_sparse():
    dense = QRow(2, counts=np.array([5, 9, 9, 1], dtype=np.int64))
    assert runner_up(dense) == 1  # tie between 1 and 2 after 2 is left out: only 1
    first = QRow(1, counts=np.array([5, 9, 9, 1], dtype=np.int64))
    assert runner_up(first) == 2
    sparse = QRow(
        40, counts=np.array([3, 7, 2], dtype=np.int64), ids=np.array([7, 40, 90], np.int32)
    )
    assert runner_up(sparse) == 7
    alone = QRow(3, counts=np.array([0, 0, 0, 8], dtype=np.int64))
    assert runner_up(alone) is None


def test_hypotheses_come_likeliest_first_and_skip_the_terminal_token():
    rows = [
        QRow(4, counts=np.array([1, 0, 0, 0, 6], dtype=np.int64)),
        QRow(2, counts=np.array([0, 3, 5, 0, 0], dtype=np.int64)),
    ]
    job = _job()
    hs = hypotheses(job, rows, 8, bonus=3)
    assert [h.name for h in hs] == ["bonus", "reject@1", "reject@2"]
    assert [tuple(h.job.prefix) for h in hs] == [(1, 2, 4, 2, 3), (1, 2, 0), (1, 2, 4, 1)]
    assert all(h.job.round_id == 4 and h.job.depth == 3 for h in hs)
    assert [h.name for h in hypotheses(job, rows, 1, bonus=None)] == ["reject@1"]
    ending = hypotheses(_job(eos=4), rows, 8, bonus=3)
    assert [h.name for h in ending] == ["reject@1"]  # the others commit the terminal 4


def test_a_prepared_block_is_served_once_and_only_for_its_exact_step():
    store = PreparedBlocks(2)
    slot = 1
    job = _job(round_id=4, prefix=(1, 2, 9))
    rows = (QRow(3, counts=np.array([1, 0, 0, 7], dtype=np.int64)),)
    store.put(slot, [(Hypothesis("bonus", job), rows)])
    assert store.take(slot, _job(round_id=4, prefix=(1, 2, 8))) is None  # another prefix
    assert store.take(slot, job) is None  # the miss above dropped the slot's blocks
    store.put(slot, [(Hypothesis("bonus", job), rows)])
    assert store.take(2, job) is None  # another slot's
    assert store.take(slot, job) is rows
    assert store.take(slot, job) is None  # never twice
    assert store.used["bonus"] == 1
    assert store.prepared["bonus"] == 2
    assert key_of(job) != key_of(_job(round_id=4, prefix=(1, 2, 9), depth=2))


def test_the_store_keeps_its_bounds():
    store = PreparedBlocks(1, max_origins=2, max_bytes=10_000)
    big = (QRow(0, counts=np.zeros(1000, dtype=np.int64)),)  # 8,000 bytes
    slots = [1, 2, 3]
    for s in slots:
        store.put(s, [(Hypothesis("bonus", _job()), big)])
    assert store.take(slots[0], _job()) is None
    assert store.take(slots[1], _job()) is None
    assert store.take(slots[2], _job()) is big
    with pytest.raises(ValueError, match=r"1\.\.8"):
        PreparedBlocks(9)


# -- the law through the daemons ---------------------------------------------------

N = 1000


@pytest.fixture(scope="module")
def target_only_two(tmp_path_factory):
    """Requests N..2N-1 of a target-only run: other seeds than the runs' 0..N-1."""
    with worker_process(vocab=VOCAB, seed=SEED) as w:
        summary, records = spark(
            w.address, tmp_path_factory.mktemp("zero"), "--depth", "0", "--concurrency", "16",
            requests=2 * N, max_tokens=2,
        )  # fmt: skip
    assert summary["draft_tokens"] == 0
    return Counter(tuple(r["tokens"][:2]) for r in records[N:])


@pytest.mark.parametrize("drafter", ["toy", "failing", "slow"])
def test_prepared_blocks_keep_the_law_of_the_first_two_tokens(tmp_path, drafter, target_only_two):
    # Tolerance declared before the run: for each of the 144 cells of the joint law of
    # the first two tokens, the two samples' frequencies may differ by at most six
    # standard deviations of their difference (pooled) plus one count of each: about
    # 2e-9 false alarm per cell. Depth 2 makes round 2 decide the second token whenever
    # round 1 committed one, so prepared blocks are served for it (checked below).
    # The failing and slow drafters fail, or sleep 20 ms, on a context ending in token 4.
    env = {**os.environ, "PP1_TEST_TRIGGER": "4", "PP1_TEST_SLOW_S": "0.02"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    plugin = (
        [] if drafter == "toy" else ["--drafter", f"tests.fault_plugins:{drafter}_drafter_factory"]
    )
    flags = ["--prepare", "3", "--max-slots", "16", "--metrics-port", "0", *plugin]
    with worker_process(*flags, vocab=VOCAB, seed=SEED, env=env) as w:
        summary, records = spark(
            w.address, tmp_path, "--depth", "2", "--concurrency", "16", requests=N, max_tokens=2
        )
        used = sum(_counts(w.metrics, "pp1_worker_prepared_used").values())
    assert summary["requests"] == N
    # Hundreds of second rounds: some of them served prepared (how many depends on
    # timing: a slow drafter leaves fewer blocks ready in time).
    if drafter == "toy":
        assert used >= 10, used
    ours = Counter(tuple(r["tokens"][:2]) for r in records)
    theirs = target_only_two
    for cell in set(ours) | set(theirs):
        a, b = ours.get(cell, 0), theirs.get(cell, 0)
        pooled = (a + b) / (2 * N)
        sd = sqrt(pooled * (1 - pooled) * (2 / N))
        assert abs(a - b) / N <= 6 * sd + 2 / N, (drafter, cell, a, b)


def test_a_lookup_is_pending_only_for_the_key_a_running_stage_draws():
    store = PreparedBlocks(2)
    job, other = _job(round_id=4), _job(round_id=4, prefix=(1, 3))
    rows = (QRow(0, counts=np.array([5, 0], dtype=np.int64)),)
    store.begin([7])
    assert store.lookup(7, job) is True  # no stage named yet: anything may come
    store.drawing(7, [job])
    assert store.lookup(7, job) is True  # this stage draws it: wait for the stage
    store.put(7, [(Hypothesis("bonus", job), rows)])
    store.drawing(7, [other])  # the next stage
    assert store.lookup(7, job) is rows  # served from the finished stage
    assert store.lookup(7, job) is False  # never twice
    store.end([7])
    store.begin([8])
    store.drawing(8, [job])
    assert store.lookup(8, other) is False  # another key: a miss at once
    store.end([8])
