"""The Spark side as a replicated TP2 group on gloo, against a real worker.

Most groups here run as threads of the test process (``tests/groups.py``): the
same collectives as rank processes, without starting any. Two runs start real
rank processes, once through ``--tp 2`` and once through torchrun, and a dead
rank is a real killed process. Every run checks that the ranks ran the same
number of collectives and hold the same committed prefixes, and that the
worker committed exactly the tokens rank 0 reports (no partial commit).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from pp1wire.apps.launch import worker_process
from pp1wire.wire.budgets import SHARE_WINDOW_S

from . import cli, groups
from .groups import lead, output_tokens, run_group, run_one, summary_of, tokens, workload
from .waiting import scrape, scrape_page, wait_until

pytest.importorskip("torch")

from pp1wire.testing.tp_faults import InjectedFaults, parse_fault

VOCAB = 32
SEED = 5


@pytest.fixture(scope="module")
def worker():
    with worker_process("--metrics-port", "0", vocab=VOCAB, seed=SEED) as running:
        yield running


def flags(address: str, *extra: str) -> list[str]:
    return workload(address, *extra, vocab=VOCAB, seed=SEED, requests=6, tokens=20, slots=3)


def faults(*specs: str, late: float = 3.0) -> InjectedFaults:
    return InjectedFaults([parse_fault(s) for s in specs], late=late, threads=True)


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
    "extra", [["--support", "dense"], ["--support", "sparse:6"], ["--depth", "0"]]
)
def test_tp2_commits_exactly_the_tokens_of_tp1(worker, extra):
    single = run_one(*flags(worker.address, *extra))
    assert single.code == 0
    before = committed(worker)
    done = lead(run_group(2, *flags(worker.address, *extra)))
    assert done.code == 0
    assert tokens(done) == tokens(single)
    assert all(len(t) >= 20 for t in tokens(done))
    summary = done.summary
    assert summary is not None
    check_group(summary)
    assert summary["tp_votes_failed_by_reason"] == {}
    if "--depth" not in extra:
        assert summary["draft_tokens"] > 0
        assert summary["tp_fanout_bytes"] > 0
        # The worker holds exactly what rank 0 committed.
        assert committed(worker)[0] - before[0] == sum(map(len, tokens(done)))


def test_rank_processes_started_by_the_tp_flag(worker, tmp_path):
    # The torchrun path is taken by the dead-rank test below.
    out = tmp_path / "o.jsonl"
    argv = flags(worker.address, "--output", str(out), "--json", "--group-timeout", "10")
    argv += ["--connect-timeout", "5"]  # below the group timeout (the settings refuse others)
    done = cli.run(sys.executable, "-m", "pp1wire.spark", *argv, "--tp", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert output_tokens(out) == tokens(run_one(*flags(worker.address)))
    check_group(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_corrupt_copy_falls_back_and_a_failed_target_stops_its_request(worker, tmp_path):
    out = tmp_path / "o.jsonl"
    before = committed(worker)
    results = run_group(
        2, *flags(worker.address, "--output", str(out)), faults=faults("corrupt:1:3", "target:1:8")
    )
    done = lead(results)
    # The one rule for a target failure: that request stops, the others go on,
    # every result is written, and the run says so in its exit status.
    assert done.code == 4
    summary = done.summary
    assert summary is not None
    check_group(summary)
    votes = summary["tp_votes_failed_by_reason"]
    assert set(votes) == {"group_copy_mismatch", "target_failed"}
    assert votes["group_copy_mismatch"] == 1
    assert summary["fallbacks_by_reason"] == {"group_copy_mismatch": 1}
    records = [json.loads(line) for line in out.read_text().splitlines()]
    stopped = [r for r in records if r["stopped"]]
    # Rank 1's one target call of that step failed: every round it scored there
    # (it evaluates the odd requests) stopped its request, and only those.
    assert (
        summary["stopped_by_reason"]
        == {"target_failed": len(stopped)}
        == {"target_failed": votes["target_failed"]}
    )
    assert all(r["request"] % 2 == 1 and not r["finished"] for r in stopped)
    assert all(r["finished"] and len(r["tokens"]) >= 20 for r in records if not r["stopped"])
    after = committed(worker)
    assert after[0] - before[0] == sum(len(r["tokens"]) for r in records)
    # The voted-down proposal became one target-only COMMIT; no other round did.
    assert after[1] - before[1] == 1


def test_every_round_voted_down_still_samples_the_target_law(worker):
    # Rank 1's copy is corrupt on every attempt, so every proposal is discarded
    # and every first token is the target-only fallback: its law must be
    # p(. | prompt). Tolerance declared before the run: Pearson chi-square at the
    # 1 - 1e-6 quantile (tests/test_verify.py), 300 requests.
    n = 300
    # Each discarded proposal is passed over by the target-only COMMIT after it, an
    # abandon while another principal drew in the last second (docs/protocol.md §4.4):
    # the earlier tests' Spark sides, lineages of their own, must be past that window.
    time.sleep(SHARE_WINDOW_S)
    # One slot: each attempt carries one round, so the corrupt copy hits every proposal.
    args = flags(worker.address, "--requests", str(n), "--max-tokens", "1", "--concurrency", "1")
    done = lead(run_group(2, *args, faults=faults("corrupt:1:*")))
    check_group(summary_of(done))
    groups.assert_all_fell_back(done, "group_copy_mismatch", n, VOCAB, SEED)


def _failed_closed(worker, out: Path, before: tuple[float, float]) -> None:
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records
    assert not any(r["finished"] for r in records)
    assert {r["stopped"] for r in records if r["tokens"]} <= {"group_failed", None}
    # Attempts before the fault committed everywhere, the failed one nowhere: the
    # worker holds exactly the tokens rank 0 wrote.
    assert committed(worker)[0] - before[0] == sum(len(r["tokens"]) for r in records) > 0


def test_a_late_rank_fails_the_group_closed_within_its_timeout(worker, tmp_path):
    out = tmp_path / "o.jsonl"
    before = committed(worker)
    # 40 tokens cannot be reached in the 4 attempts before the fault.
    argv = flags(worker.address, "--max-tokens", "40", "--output", str(out))
    started = time.monotonic()
    results = run_group(2, *argv, faults=faults("late:1:5", late=2.5), timeout=1.0)
    elapsed = time.monotonic() - started
    done = results[0]
    assert not isinstance(done, BaseException), done
    assert done.code == 3
    assert done.summary is not None
    assert "GROUP_FAILED" in done.summary["tp_failure"]
    # Rank 0 gave up after its 1 s timeout and wrote everything; the late rank's
    # own 2.5 s sleep bounds how long the group's threads take to end.
    assert elapsed < 2.5 + 5.0, elapsed
    _failed_closed(worker, out, before)


def test_a_dead_rank_process_fails_the_group_closed(worker, tmp_path):
    import subprocess
    import threading

    out = tmp_path / "o.jsonl"
    before = committed(worker)
    argv = flags(worker.address, "--max-tokens", "40", "--output", str(out), "--group-timeout", "2")
    argv += ["--reply-timeout", "1", "--connect-timeout", "1", "--metrics-port", "0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "pp1wire.testing.tp_faults", "--fault", "die:1:5", "--", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    formed: list[float] = []  # when rank 0 said the group had formed (its metrics line)

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("pp1-spark metrics on ") and not formed:
                formed.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        if not reader.is_alive():
            proc.stderr.close()
    ended, stderr = time.monotonic(), "".join(lines)
    assert proc.returncode != 0
    # From the group's forming (the three interpreters' start, torch's import above
    # all, is no part of the failure: on a loaded machine it alone took 40 s).
    assert formed, stderr[-3000:]
    assert ended - formed[0] < 30
    assert "TP group failed: GROUP_FAILED" in stderr, stderr[-3000:]
    _failed_closed(worker, out, before)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_sigterm_to_the_launcher_stops_and_reaps_every_rank():
    # The launcher passes SIGTERM on to its ranks and reaps them (docs/tp.md §8);
    # the ranks here wait for a worker that never answers.
    import signal
    import subprocess

    argv = ["--worker", "127.0.0.1:1", "--connect-timeout", "25", "--vocab", str(VOCAB)]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pp1wire.spark", *argv, "--tp", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(
            lambda: len(cli.children(launcher.pid)) == 2 or launcher.poll() is not None,
            30,
            "both ranks started",
        )
        ranks = cli.children(launcher.pid)
        assert len(ranks) == 2, (ranks, launcher.poll())
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)
        assert not [pid for pid in ranks if cli.alive(pid)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        assert launcher.stderr is not None
        launcher.stderr.close()


def test_a_link_wait_past_the_group_timeout_fails_the_group_so_it_is_refused():
    # Confirmed: with --reply-timeout above --group-timeout, rank 0 waiting for a
    # slow proposal (3 s here, within its 4 s reply timeout) leaves the follower in
    # a collective past the 2 s group timeout, and the group fails though nothing
    # went wrong. The settings refuse that combination now (and --connect-timeout's).
    import asyncio
    import os
    import threading

    import torch.distributed as dist

    from pp1wire.apps import spark
    from pp1wire.apps.settings import SettingsError
    from pp1wire.tp.coordinator import GroupCoordinator

    from .groups import args_of

    env = {**os.environ, "PP1_PACED_DRAFTER_MS": "3000"}
    drafter = ("--drafter", "pp1wire.apps.paced:drafter_factory")
    with worker_process(*drafter, vocab=VOCAB, seed=SEED, env=env) as slow:
        argv = workload(slow.address, vocab=VOCAB, seed=SEED, requests=1, tokens=2, slots=1)
        argv += ["--depth", "1", "--tp", "2", "--group-timeout", "2"]
        refused = (("4", "1", "--reply-timeout 4"), ("1", "4", "--connect-timeout 4"))
        for reply, connect, says in refused:
            with pytest.raises(SettingsError, match=f"{says} is not below --group-timeout 2"):
                spark.check_settings(
                    args_of(*argv, "--reply-timeout", reply, "--connect-timeout", connect)
                )
        store = dist.HashStore()  # type: ignore[attr-defined]
        results: list[object] = [None, None]

        def rank_main(rank: int) -> None:
            args = args_of(*argv, "--reply-timeout", "1", "--connect-timeout", "1")
            plan, _ = spark.check_settings(args)
            args.reply_timeout = 4.0  # what the settings accepted before
            coord = GroupCoordinator.over_store(store, rank, 2, 2.0)
            try:
                results[rank] = asyncio.run(spark.run_rank(args, plan, coord))
            except BaseException as exc:  # reported below
                results[rank] = exc

        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    lead_run = results[0]
    assert isinstance(lead_run, spark.RankRun), results
    assert lead_run.code == 3, lead_run  # the group failed
    assert lead_run.summary is not None
    assert "GROUP_FAILED" in lead_run.summary["tp_failure"]
    assert lead_run.summary["fallbacks_by_reason"].get("reply_timeout", 0) == 0  # nothing late
