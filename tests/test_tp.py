"""The Spark side as a TP2 group on gloo (two processes here), against a real worker.

Main acceptance: for the same seeds, prompts and requests, TP2 commits exactly
TP1's tokens (dense, sparse:K, depth 0, and once at the full vocabulary).
Faults are injected through the testing entry point ``pp1wire.testing.tp_faults``
under torchrun. Every run checks that the ranks ran the same number of
collectives (4 per attempt, plus the stop header and the final report) and
hold the same committed prefixes, and that the worker committed exactly the
tokens rank 0 reports (no partial commit).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pp1wire.apps.launch import worker_process
from pp1wire.apps.models import target_factory

from . import cli
from .test_verify import _chi_square_ok
from .waiting import scrape, scrape_page

pytest.importorskip("torch")

VOCAB = 32
SEED = 5
FULL_VOCAB = 129_280


@pytest.fixture(scope="module")
def worker():
    with worker_process("--metrics-port", "0", vocab=VOCAB, seed=SEED) as running:
        yield running


def flags(address: str, out: Path, *extra: str, vocab: int = VOCAB) -> list[str]:
    return [
        "--worker",
        address,
        "--vocab",
        str(vocab),
        "--seed",
        str(SEED),
        "--requests",
        "6",
        "--max-tokens",
        "20",
        "--concurrency",
        "3",
        "--output",
        str(out),
        "--json",
        "--group-timeout",
        "5",
        *extra,
    ]


def torchrun(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return cli.run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *args,
        env=None if env is None else {**os.environ, **env},
        timeout=timeout,
    )


def tokens(out: Path) -> list[list[int]]:
    return [json.loads(line)["tokens"] for line in out.read_text().splitlines()]


def summary_of(stdout: str) -> dict:
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))


def committed(worker) -> tuple[float, float]:
    """The worker's committed tokens and target-only COMMITs so far."""
    page = scrape_page(worker.metrics)
    target_only = 0.0
    for line in page.splitlines():
        if line.startswith('pp1_worker_commits_total{round="target_only"}'):
            target_only = float(line.split()[1])
    return scrape(worker.metrics, "pp1_worker_committed_tokens_total"), target_only


def check_group(summary: dict) -> None:
    ranks = summary["tp_ranks"]
    assert summary["tp"] == 2
    assert len(ranks) == 2
    assert summary["tp_prefixes_agree"] is True
    # 3 per attempt, +1 for the payload when it has one (every rank agrees on
    # which), +1 for the stop header, +1 for the final report.
    expected = 3 * (ranks[0]["attempts"] - 1) + ranks[0]["bulk"] + 2
    assert ranks[0]["collectives"] == ranks[1]["collectives"] == expected
    assert ranks[0]["bulk"] == ranks[1]["bulk"]
    assert ranks[0]["attempts"] == ranks[1]["attempts"] == summary["tp_attempts"]


@pytest.mark.parametrize(
    ("extra", "launcher"),
    [
        (["--support", "dense"], "tp-flag"),
        (["--support", "sparse:6"], "torchrun"),
        (["--depth", "0"], "tp-flag"),
    ],
    ids=["dense", "sparse", "depth0"],
)
def test_tp2_commits_exactly_the_tokens_of_tp1(worker, tmp_path, extra, launcher):
    one, two = tmp_path / "tp1.jsonl", tmp_path / "tp2.jsonl"
    single = cli.run(sys.executable, "-m", "pp1wire.spark", *flags(worker.address, one, *extra))
    assert single.returncode == 0, single.stderr
    before = committed(worker)
    if launcher == "torchrun":
        done = torchrun("-m", "pp1wire.spark", *flags(worker.address, two, *extra))
    else:
        cmd = flags(worker.address, two, *extra, "--tp", "2")
        done = cli.run(sys.executable, "-m", "pp1wire.spark", *cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert tokens(two) == tokens(one)
    assert all(len(t) >= 20 for t in tokens(two))
    summary = summary_of(done.stdout)
    check_group(summary)
    assert summary["tp_votes_failed_by_reason"] == {}
    if "--depth" not in extra:
        assert summary["draft_tokens"] > 0
        assert summary["tp_fanout_bytes"] > 0
        after = committed(worker)
        # The worker holds exactly what rank 0 committed.
        assert after[0] - before[0] == sum(map(len, tokens(two)))


def test_tp2_equals_tp1_at_the_full_vocabulary(tmp_path):
    with worker_process(vocab=FULL_VOCAB, seed=SEED) as running:
        one, two = tmp_path / "tp1.jsonl", tmp_path / "tp2.jsonl"
        extra = ["--requests", "2", "--max-tokens", "12"]
        single = cli.run(
            sys.executable,
            "-m",
            "pp1wire.spark",
            *flags(running.address, one, *extra, vocab=FULL_VOCAB),
        )
        assert single.returncode == 0, single.stderr
        cmd = flags(running.address, two, *extra, "--tp", "2", vocab=FULL_VOCAB)
        done = cli.run(sys.executable, "-m", "pp1wire.spark", *cmd, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert tokens(two) == tokens(one)
    summary = summary_of(done.stdout)
    check_group(summary)
    # Every fanned-out row is the whole dense q: FULL_VOCAB FP32 entries.
    assert summary["tp_fanout_bytes"] >= summary["draft_tokens"] * FULL_VOCAB * 4


def test_a_corrupt_copy_and_a_failed_target_on_rank_1_fall_back_on_every_rank(worker, tmp_path):
    out = tmp_path / "o.jsonl"
    before = committed(worker)
    done = torchrun(
        "-m",
        "pp1wire.testing.tp_faults",
        "--fault",
        "corrupt:1:3",
        "--fault",
        "target:1:8",
        "--",
        *flags(worker.address, out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = summary_of(done.stdout)
    check_group(summary)
    # One round of attempt 3 is voted down by rank 1's digest check; in the first
    # attempt from 8 on in which rank 1 owns rounds (odd requests), its target fails.
    votes = summary["tp_votes_failed_by_reason"]
    assert votes.get("group_copy_mismatch") == 1
    assert votes.get("target_failed", 0) >= 1
    assert summary["fallbacks_by_reason"] == votes
    after = committed(worker)
    got = tokens(out)
    assert all(len(t) >= 20 for t in got)
    assert after[0] - before[0] == sum(map(len, got))
    # Each voted-down proposal became one target-only COMMIT; no other round did.
    assert after[1] - before[1] == summary["fallbacks"]
    assert summary["accepted_tokens"] > 0  # the rounds after the fault are normal


def test_every_round_voted_down_still_samples_the_target_law(worker, tmp_path):
    # Rank 1's copy is corrupt on every attempt, so every proposal is discarded
    # and every first token is the target-only fallback: its law must be
    # p(. | prompt). Tolerance declared before the run: Pearson chi-square at the
    # 1 - 1e-6 quantile (tests/test_verify.py), 300 requests.
    out = tmp_path / "o.jsonl"
    n = 300
    # One slot: each attempt carries one round, so the corrupt copy hits every proposal.
    args = flags(
        worker.address, out, "--requests", str(n), "--max-tokens", "1", "--concurrency", "1"
    )
    done = torchrun("-m", "pp1wire.testing.tp_faults", "--fault", "corrupt:1:*", "--", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = summary_of(done.stdout)
    check_group(summary)
    assert summary["fallbacks_by_reason"] == {"group_copy_mismatch": n}
    assert summary["draft_tokens"] == 0
    first = Counter(t[0] for t in tokens(out))
    p = target_factory(VOCAB, SEED)([1, 2, 3])
    law = {i: float(v) for i, v in enumerate(p)}
    assert _chi_square_ok(first, law, n), (first, law)


@pytest.mark.parametrize("fault", ["late:1:5", "die:1:5"])
def test_a_late_or_dead_rank_fails_closed_within_the_timeout(worker, tmp_path, fault):
    out = tmp_path / "o.jsonl"
    before = committed(worker)
    started = time.monotonic()
    done = torchrun(
        "-m",
        "pp1wire.testing.tp_faults",
        "--fault",
        fault,
        "--",
        # 40 tokens cannot be reached in the 4 attempts before the fault (at most one
        # round of depth 5 + 1 per request per attempt), however rounds are batched.
        *flags(worker.address, out, "--group-timeout", "2", "--max-tokens", "40"),
        env={"PP1_TP_LATE_S": "30"},
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    # Group start, 4 rounds and the 2 s timeout: far below the late rank's 30 s.
    assert elapsed < 25, elapsed
    assert "TP group failed: GROUP_FAILED" in done.stderr, done.stderr[-3000:]
    got = tokens(out)
    assert not any(json.loads(line)["finished"] for line in out.read_text().splitlines())
    # Attempts 1-4 committed everywhere, attempt 5 nowhere: the worker holds
    # exactly the tokens rank 0 wrote.
    assert committed(worker)[0] - before[0] == sum(map(len, got)) > 0


def test_group_runs_from_an_engines_own_process_group():
    script = Path(__file__).resolve().parent / "ranks" / "tp_embed.py"
    done = torchrun(str(script))
    assert done.returncode == 0, done.stderr[-3000:]
