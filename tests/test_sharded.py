"""The vocabulary-sharded TP2 pipeline: 2 worker ranks, 2 Spark ranks, one link per pair.

Main acceptance: for the same seeds, prompts and requests, the sharded pipeline
emits exactly the tokens of the unsharded TP1 pipeline (dense and sparse:K, at a
small vocabulary and at 129,280). Faults are injected on worker rank 1 through
the testing entry point ``pp1wire.testing.shard_faults`` under torchrun; each
must make every Spark rank fall back for that round (counted by reason), the
workers must see exactly the target-only COMMITs and tokens the Spark side
reports (no partial commit), and the rounds after it must use proposals again.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from pp1wire.apps.launch import RunningGroup, worker_group, worker_process
from pp1wire.apps.models import target_factory

from . import cli
from .test_verify import _chi_square_ok
from .waiting import scrape, scrape_page

pytest.importorskip("torch")

VOCAB = 32
SEED = 5
FULL_VOCAB = 129_280


def committed(group: RunningGroup) -> list[tuple[float, float]]:
    """Each rank's committed tokens and target-only COMMITs."""
    out = []
    for address in group.metrics:
        page = scrape_page(address)
        target_only = 0.0
        for line in page.splitlines():
            if line.startswith('pp1_worker_commits_total{round="target_only"}'):
                target_only = float(line.split()[1])
        out.append((scrape(address, "pp1_worker_committed_tokens_total"), target_only))
    return out


def sharded_workers(*faults: str, vocab: int = VOCAB, env: dict[str, str] | None = None):
    return worker_group("--log-level", "warning", vocab=vocab, seed=SEED, faults=faults, env=env)


@pytest.fixture(scope="module")
def group():
    with sharded_workers() as running:
        yield running


@pytest.fixture(scope="module")
def tp1_worker():
    with worker_process(vocab=VOCAB, seed=SEED) as running:
        yield running


def spark_flags(address: str, out: Path, *extra: str, vocab: int = VOCAB) -> list[str]:
    return [
        "--worker",
        address,
        "--vocab",
        str(vocab),
        "--seed",
        str(SEED),
        "--requests",
        "3",
        "--max-tokens",
        "20",
        "--concurrency",
        "3",
        "--output",
        str(out),
        "--json",
        "--group-timeout",
        "10",
        *extra,
    ]


def sharded_spark(address: str, out: Path, *extra: str, vocab: int = VOCAB, timeout: float = 120):
    return cli.module(
        "pp1wire.spark",
        "--tp",
        "2",
        "--vocab-shards",
        "2",
        *spark_flags(address, out, *extra, vocab=vocab),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=timeout,
    )


def tokens(out: Path) -> list[list[int]]:
    return [json.loads(line)["tokens"] for line in out.read_text().splitlines()]


def summary_of(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))


@pytest.mark.parametrize("support", ["dense", "sparse:6"])
def test_sharded_tp2_emits_the_tokens_of_unsharded_tp1(group, tp1_worker, tmp_path, support):
    ref, out = tmp_path / "tp1.jsonl", tmp_path / "sharded.jsonl"
    done = cli.module("pp1wire.spark", *spark_flags(tp1_worker.address, ref, "--support", support))
    assert done.returncode == 0, done.stderr
    before = committed(group)
    done = sharded_spark(group.address, out, "--support", support)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = summary_of(done.stdout)
    assert summary["fallbacks"] == 0, summary
    assert summary["draft_tokens"] > 0
    assert summary["shard_ranges"] == [[0, 16], [16, 32]]
    assert tokens(out) == tokens(ref)
    # Both worker ranks committed exactly the tokens the Spark side emitted.
    emitted = sum(len(t) for t in tokens(out))
    after = committed(group)
    assert [a[0] - b[0] for a, b in zip(after, before, strict=True)] == [emitted, emitted]


@pytest.mark.parametrize("support", ["dense", "sparse:32"])
def test_sharded_equals_unsharded_at_the_full_vocabulary(tmp_path, support):
    ref, out = tmp_path / "tp1.jsonl", tmp_path / "sharded.jsonl"
    extra = ["--requests", "1", "--concurrency", "1", "--max-tokens", "8", "--support", support]
    with worker_process(vocab=FULL_VOCAB, seed=SEED) as single:
        done = cli.module(
            "pp1wire.spark", *spark_flags(single.address, ref, *extra, vocab=FULL_VOCAB)
        )
    assert done.returncode == 0, done.stderr
    with sharded_workers(vocab=FULL_VOCAB) as workers:
        done = sharded_spark(workers.address, out, *extra, vocab=FULL_VOCAB, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = summary_of(done.stdout)
    assert summary["fallbacks"] == 0
    assert summary["shard_ranges"] == [[0, 64_640], [64_640, FULL_VOCAB]]
    assert tokens(out) == tokens(ref)


def test_each_fault_on_one_link_falls_back_on_every_rank_then_rounds_resume(tmp_path):
    # One request on one slot: the group's draw k is the request's round k.
    out = tmp_path / "o.jsonl"
    faults = ("mass:1:2", "missing:1:4", "corrupt:1:6", "late:1:8")
    extra = ["--requests", "1", "--concurrency", "1", "--max-tokens", "60"]
    extra += ["--reply-timeout", "1"]
    with sharded_workers(*faults, env={"PP1_SHARD_LATE_S": "1.5"}) as workers:
        done = sharded_spark(workers.address, out, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = summary_of(done.stdout)
        reasons = summary["fallbacks_by_reason"]
        # The shard with the wrong total passed its own checks: the group refused it.
        assert reasons.get("group_mass_mismatch") == 1, reasons
        assert reasons.get("internal") == 1, reasons  # the missing shard's COMPLETION status
        assert reasons.get("negative") == 1, reasons  # refused by rank 1's own shard checks
        # The late shard misses the reply timeout; the round right after it may time
        # out too while rank 1 catches up.
        assert 1 <= reasons.get("reply_timeout", 0) <= 2, reasons
        assert set(reasons) == {"group_mass_mismatch", "internal", "negative", "reply_timeout"}
        emitted = sum(len(t) for t in tokens(out))
        fallbacks = summary["fallbacks"]
        # Every rank's worker saw exactly the target-only COMMITs and the tokens the
        # Spark side emitted: no round was committed on one link and not the other.
        assert committed(workers) == [(emitted, fallbacks), (emitted, fallbacks)]
    # Rounds after the faults used proposals again.
    record = json.loads(out.read_text())
    assert record["rounds"] > fallbacks + 4
    assert record["draft_tokens"] >= 5 * (record["rounds"] - fallbacks)


def test_a_shard_from_a_stale_generation_is_dropped_and_the_round_falls_back(tmp_path):
    # Two requests on one slot: the second reopens it at generation 1, and rank 1's
    # first shard there names generation 0. Spark rank 1 drops those frames (counted
    # on its link), its shard never completes, and every rank falls back once.
    out = tmp_path / "o.jsonl"
    extra = ["--requests", "2", "--concurrency", "1", "--max-tokens", "10"]
    extra += ["--reply-timeout", "0.5"]
    with sharded_workers("stale:1:*") as workers:
        done = sharded_spark(workers.address, out, *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = summary_of(done.stdout)
        assert summary["fallbacks_by_reason"] == {"reply_timeout": 1}, summary
        emitted = sum(len(t) for t in tokens(out))
        assert committed(workers) == [(emitted, 1), (emitted, 1)]
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert first["fallbacks"] == 0
    assert second["fallbacks"] == 1
    assert second["draft_tokens"] > 0  # the rounds after it used proposals


def test_a_dead_worker_rank_leaves_the_spark_group_decoding_target_only(tmp_path):
    out = tmp_path / "o.jsonl"
    extra = ["--requests", "2", "--concurrency", "2", "--max-tokens", "12"]
    extra += ["--reply-timeout", "1"]
    with sharded_workers("die:1:3") as workers:
        done = sharded_spark(workers.address, out, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = summary_of(done.stdout)
    assert summary["fallbacks"] >= 1
    assert summary["finished"] == 2
    assert all(len(t) >= 12 for t in tokens(out))


def test_a_spark_side_with_another_layout_is_refused_at_hello(group, tmp_path):
    out = tmp_path / "o.jsonl"
    done = cli.module("pp1wire.spark", *spark_flags(group.address, out), timeout=60)
    assert done.returncode == 1
    assert "SHARD_LAYOUT_MISMATCH" in done.stderr


def test_every_round_refused_by_the_group_still_samples_the_target_law(tmp_path):
    # Rank 1's shard carries a wrong total in every reply, so the group discards
    # every proposal and every first token is the target-only fallback: its law
    # must be p(. | prompt). Tolerance declared before the run: Pearson
    # chi-square at the 1 - 1e-6 quantile (tests/test_verify.py), 200 requests.
    out = tmp_path / "o.jsonl"
    n = 200
    extra = ["--requests", str(n), "--max-tokens", "1", "--concurrency", "4", "--depth", "1"]
    with sharded_workers("mass:1:*") as workers:
        done = sharded_spark(workers.address, out, *extra, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = summary_of(done.stdout)
    assert summary["fallbacks_by_reason"] == {"group_mass_mismatch": n}
    assert summary["draft_tokens"] == 0
    first = Counter(t[0] for t in tokens(out))
    p = target_factory(VOCAB, SEED)([1, 2, 3])
    law = {i: float(v) for i, v in enumerate(p)}
    assert _chi_square_ok(first, law, n), (first, law)


def test_conformance_cases_pass_against_the_sharded_worker_group(group):
    done = cli.module(
        "pp1wire.testing.conformance",
        "--worker",
        group.address,
        "--vocab",
        str(VOCAB),
        "--vocab-shards",
        "2",
        "--case",
        "4.1",
        "6.7",
        "--json",
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    results = {
        r["id"]: r["grade"]
        for r in map(json.loads, (ln for ln in done.stdout.splitlines() if ln.startswith("{")))
    }
    assert {i: g for i, g in results.items() if i.startswith("6.7")} == {
        f"6.7.{n}": "pass" for n in range(1, 6)
    }
    assert all(g in ("pass", "informational") for g in results.values()), results
