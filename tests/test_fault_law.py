"""Faults that depend on the drafts, through the real daemons: the output keeps the target's law.

A worker whose drafter fails (or is slow past ``--reply-timeout``) only on a
context that ends in a given token faults exactly the blocks that drafted that
token and then wanted another row. Discarding those blocks whole would select
blocks by their drafts (``docs/adaptive.md`` §7: on this model P(first token = 4)
moves from 0.674 to 0.477 when the drafter fails after a drafted 4, and P(0) from
0.173 to 0.059 when it fails after a drafted 0, computed exactly by
``tests/test_fault_exact.py``); verifying the rows before the fault keeps it.
Each test compares the law of the first committed token with target-only
decoding of the same prompt under other request seeds, and checks that the
faulted rounds were cut (their rows verified), not thrown away.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from math import sqrt

import pytest

from pp1wire.apps.launch import worker_process
from pp1wire.apps.spark import build_parser

from . import cli

VOCAB = 8
SEED = 0
PROMPT = [1, 2, 3]
N = 1000


WARNING = "pp1-spark: warning: "


def spark(
    address: str, tmp_path, *extra: str, requests: int, name: str, warned: list | None = None
):
    """Run pp1-spark: its summary and records; its warning lines go to ``warned``."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPT) + "\n")
    out = tmp_path / f"{name}.jsonl"
    done = cli.spark(
        address, VOCAB,
        "--seed", str(SEED), "--requests", str(requests), "--max-tokens", "1",
        "--prompts", prompts, "--output", out, "--json", *extra,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    if warned is not None:
        warned += [x for x in done.stderr.splitlines() if x.startswith(WARNING)]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return json.loads(done.stdout), records


@pytest.fixture(scope="module")
def target_only(tmp_path_factory):
    # Requests N..2N-1 of a target-only run: the same target and prompt, other seeds
    # than the faulty runs' requests 0..N-1.
    with worker_process(vocab=VOCAB, seed=SEED) as worker:
        summary, records = spark(
            worker.address, tmp_path_factory.mktemp("zero"), "--depth", "0",
            requests=2 * N, name="zero",
        )  # fmt: skip
    assert summary["draft_tokens"] == 0
    return Counter(r["tokens"][0] for r in records[N:])


def same_law(ours: Counter, theirs: Counter, n: int, m: int) -> list[str]:
    # Tolerance declared before the run: for each of the 8 values of the first token,
    # the two samples' frequencies may differ by at most six standard deviations of
    # their difference (pooled) plus one count of each: about 2e-9 false alarm per
    # value. The whole-block discard moves the faulted token's frequency by 0.197
    # (token 4, about 9 deviations) and by 0.114 (token 0, about 8 deviations, past the
    # bound in about 96 % of runs): tests/test_fault_exact.py computes both exactly.
    off = []
    for v in range(VOCAB):
        a, b = ours.get(v, 0), theirs.get(v, 0)
        pooled = (a + b) / (n + m)
        sd = sqrt(pooled * (1 - pooled) * (1 / n + 1 / m))
        if abs(a / n - b / m) > 6 * sd + 1 / n + 1 / m:
            off.append(f"token {v}: {a}/{n} against {b}/{m}")
    return off


def faulty_worker(drafter: str, trigger: int, slow: float = 0.0, *extra: str):
    env = {**os.environ, "PP1_TEST_TRIGGER": str(trigger), "PP1_TEST_SLOW_S": str(slow)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    return worker_process(
        "--drafter", f"tests.fault_plugins:{drafter}", "--max-slots", "16", *extra,
        vocab=VOCAB, seed=SEED, env=env,
    )  # fmt: skip


def test_a_drafter_failing_after_a_drafted_token_keeps_the_law(tmp_path, target_only):
    # Token 4 is the drafter's favourite (q = 0.60): most blocks draft it first and
    # the drafter then fails on the second row.
    warned: list[str] = []
    with faulty_worker("failing_drafter_factory", trigger=4) as worker:
        summary, records = spark(
            worker.address, tmp_path, "--depth", "2", "--concurrency", "16",
            requests=N, name="failing", warned=warned,
        )  # fmt: skip
    assert summary["requests"] == N
    # The summary warns of these faults, which no reply timeout explains, by the row
    # they struck (row 1: after the one row drawn), as pp1_faults_by_row_total counts them.
    cut = int(summary["cuts_by_reason"]["internal"])
    assert warned == [
        f"{WARNING}{cut} of {N} proposals ended by a fault the reply timeout does not explain "
        f"(row 1: {cut}); a worker that fails the rows of drafts it dislikes biases the "
        "output: compare pp1_faults_by_row_total by row (docs/adaptive.md section 7)"
    ], warned
    # The faulted rounds verified the row before the failure; none fell back whole
    # for it (a context ending in 4 at the first row cannot occur: the prompt ends in 3).
    assert summary["cuts_by_reason"].get("internal", 0) > N // 3, summary["cuts_by_reason"]
    assert "internal" not in summary["fallbacks_by_reason"], summary["fallbacks_by_reason"]
    # Each request's record names its cut rounds by the fault (docs/runner.md §9.1).
    per_record = sum(r["cut_reasons"].get("internal", 0) for r in records)
    assert per_record == summary["cuts_by_reason"]["internal"]
    ours = Counter(r["tokens"][0] for r in records)
    assert same_law(ours, target_only, N, N) == []


def test_a_drafter_slow_past_the_reply_timeout_after_a_drafted_token_keeps_the_law(
    tmp_path, target_only
):
    # Token 0 (q = 0.14): a batch whose second row follows a drafted 0 takes 0.15 s, past
    # the 0.05 s reply timeout; the first rows were sent as they were drawn, so they
    # arrive in time and are verified (cut at the deadline).
    warned: list[str] = []
    # A COMMIT that names a slot still being drawn waits for the draw, past the answer
    # timeout (the reply timeout): the Spark side ends the connection and reconnects,
    # cutting the draws in flight, which the worker charges to its lineage (§4.4). The
    # abandon budget here is large enough that none of it is ever refused.
    slow_worker = faulty_worker("slow_drafter_factory", 0, 0.15, "--abandon-burst", "60000")
    with slow_worker as worker:
        summary, records = spark(
            worker.address, tmp_path, "--depth", "2", "--concurrency", "16",
            "--reply-timeout", "0.05", requests=N, name="slow", warned=warned,
        )  # fmt: skip
    assert summary["requests"] == N
    assert warned == []  # every fault is one of the run's own deadlines: explained
    assert summary["cuts_by_reason"].get("reply_timeout", 0) > 0, summary["cuts_by_reason"]
    per_record = sum(r["cut_reasons"].get("reply_timeout", 0) for r in records)
    assert per_record == summary["cuts_by_reason"]["reply_timeout"]
    # What --help says of the flag is what just happened: the block was cut.
    (flag,) = [a for a in build_parser()._actions if "--reply-timeout" in a.option_strings]
    assert "cut" in flag.help, flag.help
    assert "rows that arrived" in flag.help, flag.help
    ours = Counter(r["tokens"][0] for r in records)
    assert same_law(ours, target_only, N, N) == []


def test_faults_before_any_row_are_counted_at_row_zero_and_warned_of(tmp_path):
    # Before: a fault before any row fell back whole and was counted only as a
    # fallback, so an operator watching pp1_blocks_cut_total missed it (603 of 1,000
    # rounds of a worker that withholds a disliked token, round four). Now every
    # fault is counted by the row it struck, 0 before any row, and the summary warns.
    env = {**os.environ, "PP1_TEST_AT_LENGTH": str(len(PROMPT))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    warned: list[str] = []
    with worker_process(
        "--drafter", "tests.fault_plugins:failing_drafter_factory", vocab=VOCAB, seed=SEED,
        env=env,
    ) as worker:  # fmt: skip
        summary, _ = spark(
            worker.address, tmp_path, "--depth", "2", requests=20, name="first", warned=warned
        )
    assert summary["fallbacks_by_reason"] == {"internal": 20}
    assert summary["cuts"] == 0
    assert len(warned) == 1, warned
    assert "20 of 20 proposals" in warned[0], warned
    assert "(row 0: 20)" in warned[0]
