"""One rule for a failing target in every mode, and fail-closed groups that still write.

A target that fails (raises, or gives a row that is not a distribution) stops
the request whose round it was scoring — ``"stopped": "target_failed"``,
nothing of that round committed — the other requests go on, every result is
written, and ``pp1-spark`` exits 4 (docs/operators.md §5, docs/tp.md §6). One
rank and the vocabulary-sharded group are checked here, the replicated group in
tests/test_tp.py. A group that fails (its ranks decide differently, a rank
vanishes) stops every request, writes every result and exits 3.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pp1wire.apps.launch import worker_group, worker_process

from . import cli, plugins
from .groups import lead, run_group, run_one

VOCAB = 32
SEED = 5
PROMPTS = [[1, 2, 3], [*plugins.MARK, 1], [4, 5]]


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def fault():
    saved = dict(plugins.FAULT)
    yield plugins.FAULT
    plugins.FAULT.clear()
    plugins.FAULT.update(saved)


def argv(address: str, prompts: Path, *extra: str) -> list[str]:
    return [
        "--worker", address, "--vocab", str(VOCAB), "--seed", str(SEED),
        "--requests", "3", "--concurrency", "3", "--max-tokens", "12",
        "--prompts", str(prompts), "--target", "tests.plugins:failing_target_factory",
        *extra,
    ]  # fmt: skip


def check_one_stopped(records: list[dict]) -> None:
    assert [r["request"] for r in records] == [0, 1, 2]
    stopped = records[1]
    assert stopped["stopped"] == "target_failed"
    assert not stopped["finished"]
    assert stopped["tokens"] == []  # its first round was the failing one: nothing committed
    for r in (records[0], records[2]):
        assert r["stopped"] is None
        assert r["finished"]
        assert len(r["tokens"]) >= 12


@pytest.fixture(scope="module")
def worker():
    with worker_process(vocab=VOCAB, seed=SEED) as running:
        yield running


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_one_rank_stops_the_request_its_target_failed_and_goes_on(
    worker, prompts, fault, tmp_path, how
):
    fault["how"] = how
    out = tmp_path / "o.jsonl"
    done = run_one(*argv(worker.address, prompts, "--output", str(out)))
    assert done.code == 4
    assert done.summary is not None
    assert done.summary["stopped_by_reason"] == {"target_failed": 1}
    check_one_stopped([json.loads(line) for line in out.read_text().splitlines()])


def test_the_process_exits_4_with_every_result_and_no_traceback(worker, prompts, tmp_path):
    # Before: a traceback, exit 1, and every result lost.
    out = tmp_path / "o.jsonl"
    done = cli.run(
        sys.executable, "-m", "pp1wire.spark", *argv(worker.address, prompts, "--output", str(out)),
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr
    assert "pp1-spark: the target failed: 1 request(s) stopped" in done.stderr
    check_one_stopped([json.loads(line) for line in out.read_text().splitlines()])


@pytest.fixture(scope="module")
def workers():
    pytest.importorskip("torch")
    with worker_group(vocab=VOCAB, seed=SEED) as running:
        yield running


@pytest.mark.parametrize(("how", "rank"), [("raise", 1), ("nan", 0)])
def test_a_sharded_group_stops_the_request_whose_target_failed_on_any_rank(
    workers, prompts, fault, tmp_path, how, rank
):
    # Before: both ranks printed tracebacks, exit 1, an empty --output.
    fault.update(how=how, rank=rank)
    out = tmp_path / "o.jsonl"
    done = lead(run_group(2, *argv(workers.address, prompts, "--output", str(out)), sharded=True))
    assert done.code == 4
    check_one_stopped([json.loads(line) for line in out.read_text().splitlines()])


def _group_failed(results, out: Path) -> None:
    first = results[0]
    assert not isinstance(first, BaseException), first
    assert first.code == 3
    assert first.summary is not None
    assert "GROUP_FAILED" in first.summary["tp_failure"]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3  # every request's record is written
    assert not any(r["finished"] for r in records if r["request"] == 1)
    assert {r["stopped"] for r in records} <= {"group_failed", None}


def test_a_split_vote_fails_the_sharded_group_closed_and_writes(
    workers, prompts, tmp_path, monkeypatch
):
    # The ranks' kernels share every decision, so honest ranks never disagree: the
    # vote is the net for a rank whose state or hardware went wrong. Rank 1 is made
    # to report another outcome for its first decided round.
    from pp1wire.errors import ErrorCode, VerifyError
    from pp1wire.tp.shard_spark import ShardedVerifyGroup

    vote = ShardedVerifyGroup._vote

    def split(self, decided):
        if self.rank == 1 and decided:
            decided = [VerifyError(ErrorCode.INTERNAL), *decided[1:]]
        return vote(self, decided)

    monkeypatch.setattr(ShardedVerifyGroup, "_vote", split)
    out = tmp_path / "o.jsonl"
    results = run_group(2, *argv(workers.address, prompts, "--output", str(out)), sharded=True)
    _group_failed(results, out)
    assert not isinstance(results[1], BaseException)
    assert results[1].code == 3


def test_a_vanished_sharded_rank_fails_the_group_closed_within_its_timeout(
    workers, prompts, fault, tmp_path
):
    fault.update(how="vanish", rank=1)
    out = tmp_path / "o.jsonl"
    args = argv(workers.address, prompts, "--output", str(out))
    results = run_group(2, *args, sharded=True, timeout=2.0)
    assert isinstance(results[1], plugins.Vanished)
    _group_failed(results, out)
