"""The same tokens for the same seeds in every mode, and as before the round driver.

``tests/data/reference_tokens.json`` holds what ``pp1-spark`` emitted, before its
requests ran through the round driver, for eight configurations (dense, sparse,
greedy, other temperatures, a terminal token, target-only, one slot serving
three requests, and the full 129,280-token vocabulary). Every mode must emit
exactly those tokens: one rank, a replicated TP2 group and a vocabulary-sharded
TP2 group (the groups run as threads of this process; the sharded workers are
a real worker group).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pp1wire.apps.launch import worker_group, worker_process

from .groups import lead, run_group, run_one, tokens

REFERENCE = json.loads((Path(__file__).parent / "data" / "reference_tokens.json").read_text())
SMALL = [name for name, c in REFERENCE.items() if c["vocab"] < 100_000]
FULL = [name for name, c in REFERENCE.items() if c["vocab"] >= 100_000]


def _argv(name: str, address: str) -> list[str]:
    c = REFERENCE[name]
    return ["--worker", address, "--vocab", str(c["vocab"]), "--seed", str(c["seed"]), *c["args"]]


@pytest.fixture(scope="module")
def workers():
    """One worker per (vocabulary, seed) of the small configurations."""
    keys = sorted({(REFERENCE[n]["vocab"], REFERENCE[n]["seed"]) for n in SMALL})
    with (
        worker_process(vocab=keys[0][0], seed=keys[0][1]) as a,
        worker_process(vocab=keys[1][0], seed=keys[1][1]) as b,
        worker_process(vocab=keys[2][0], seed=keys[2][1]) as c,
    ):
        yield dict(zip(keys, (a.address, b.address, c.address), strict=True))


def _address(workers: dict, name: str) -> str:
    return workers[(REFERENCE[name]["vocab"], REFERENCE[name]["seed"])]


@pytest.mark.parametrize("name", SMALL)
def test_one_rank_emits_the_recorded_tokens(workers, name):
    done = run_one(*_argv(name, _address(workers, name)))
    assert done.code == 0
    assert tokens(done) == REFERENCE[name]["tokens"]


@pytest.mark.parametrize("name", SMALL)
def test_a_replicated_tp2_group_emits_the_recorded_tokens(workers, name):
    pytest.importorskip("torch")
    done = lead(run_group(2, *_argv(name, _address(workers, name))))
    assert done.code == 0
    assert tokens(done) == REFERENCE[name]["tokens"]
    assert done.summary is not None
    assert done.summary["tp_prefixes_agree"] is True
    assert done.summary["tp_votes_failed_by_reason"] == {}


def test_a_sharded_tp2_group_emits_the_recorded_tokens():
    pytest.importorskip("torch")
    names = [n for n in SMALL if (REFERENCE[n]["vocab"], REFERENCE[n]["seed"]) == (1000, 7)]
    assert len(names) >= 5
    with worker_group(vocab=1000, seed=7) as group:
        for name in names:
            done = lead(run_group(2, *_argv(name, group.address), sharded=True))
            assert done.code == 0, name
            assert tokens(done) == REFERENCE[name]["tokens"], name
            assert done.summary is not None
            assert done.summary["fallbacks"] == 0, (name, done.summary)


@pytest.mark.parametrize("name", FULL)
def test_every_mode_emits_the_recorded_tokens_at_the_full_vocabulary(name):
    pytest.importorskip("torch")
    c = REFERENCE[name]
    with worker_process(vocab=c["vocab"], seed=c["seed"]) as single:
        assert tokens(run_one(*_argv(name, single.address))) == c["tokens"]
        assert tokens(lead(run_group(2, *_argv(name, single.address)))) == c["tokens"]
    with worker_group(vocab=c["vocab"], seed=c["seed"]) as group:
        done = lead(run_group(2, *_argv(name, group.address), sharded=True, timeout=60))
    assert tokens(done) == c["tokens"]
    assert done.summary is not None
    assert done.summary["shard_ranges"] == [[0, 64_640], [64_640, c["vocab"]]]
