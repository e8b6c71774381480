"""End to end over real TCP on 127.0.0.1: both daemons, the CLI contract, the output law."""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter
from math import sqrt

import pytest

from pp1wire.apps.launch import worker_process
from pp1wire.apps.models import ToyLM

from . import cli
from .waiting import scrape, scrape_page, wait_until

VOCAB = 12
SEED = 3
PROMPT = [1, 2]


def spark(address: str, tmp_path, *extra: str, requests: int, max_tokens: int, name="out"):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPT) + "\n")
    out = tmp_path / f"{name}.jsonl"
    done = cli.spark(
        address,
        VOCAB,
        "--seed",
        str(SEED),
        "--requests",
        str(requests),
        "--max-tokens",
        str(max_tokens),
        "--prompts",
        prompts,
        "--output",
        out,
        "--json",
        *extra,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return json.loads(done.stdout), records


# Slots one connection may open on the shared worker: the large samples run 16
# requests at once (a quarter less CPU per request than 4, the same law).
SLOTS = 16


@pytest.fixture(scope="module")
def worker():
    """One worker for the tests that only run pp1-spark against it (each run its own sessions)."""
    with worker_process("--max-slots", str(SLOTS), vocab=VOCAB, seed=SEED) as running:
        yield running
    assert running.returncode == 0


def exact_first_two() -> dict[tuple[int, int], float]:
    target = ToyLM(VOCAB, SEED)
    p1 = target.probs(PROMPT)
    law = {}
    for a in range(VOCAB):
        p2 = target.probs([*PROMPT, a])
        for b in range(VOCAB):
            law[(a, b)] = float(p1[a] * p2[b])
    return law


@pytest.mark.parametrize("support", ["dense", "sparse:3"])
def test_first_two_tokens_follow_the_target_law(tmp_path, support, worker):
    # Tolerance declared before the run: every cell of the 12 x 12 joint law of
    # the first two generated tokens must be within six binomial standard
    # deviations plus one count of its expectation. 144 cells at ~2e-9 false
    # alarm each; a verifier that mixed in q, or reused noise, fails by far more.
    n = 3000
    summary, records = spark(
        worker.address,
        tmp_path,
        "--depth",
        "3",
        "--support",
        support,
        "--concurrency",
        str(SLOTS),
        requests=n,
        max_tokens=2,
    )
    assert summary["requests"] == n
    assert summary["fallbacks"] == 0
    assert summary["draft_tokens"] > 0
    counts = Counter(tuple(r["tokens"][:2]) for r in records)
    for cell, pr in exact_first_two().items():
        sd = sqrt(n * pr * (1 - pr))
        assert abs(counts.get(cell, 0) - n * pr) <= 6 * sd + 1, (cell, counts.get(cell), n * pr)


def test_cli_contract_and_depth_zero(tmp_path, worker):
    summary, records = spark(worker.address, tmp_path, requests=6, max_tokens=5)
    target_only, records0 = spark(
        worker.address, tmp_path, "--depth", "0", requests=6, max_tokens=5, name="zero"
    )
    for key in (
        "requests",
        "tokens",
        "draft_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "fallbacks",
        "seconds",
    ):
        assert key in summary
    assert summary["requests"] == 6
    assert summary["tokens"] >= 30
    assert 0 < summary["acceptance_rate"] <= 1
    assert [r["request"] for r in records] == list(range(6))
    for r in records:
        assert r["prompt"] == PROMPT
        assert len(r["tokens"]) >= 5
        assert r["fallbacks"] == 0
    assert target_only["draft_tokens"] == 0
    assert all(len(r["tokens"]) == 5 for r in records0)
    # Per-request seeds: a second run, against a worker started afresh, is identical.
    with worker_process(vocab=VOCAB, seed=SEED) as running:
        address = running.address
        _, again = spark(address, tmp_path, requests=6, max_tokens=5, name="again")
    assert [r["tokens"] for r in again] == [r["tokens"] for r in records]


def test_worker_unreachable_is_a_clear_error(tmp_path):
    done = cli.spark("127.0.0.1:1", 8, "--requests", "1", "--connect-timeout", "0.3")
    assert done.returncode == 1
    assert "cannot reach the worker" in done.stderr


def test_bad_settings_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such_key = 1\n")
    for args in (["--support", "sparse:x"], ["--config", str(bad)], ["--depth", "9"]):
        done = cli.module("pp1wire.apps.spark", *args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith("pp1-spark: ")


def test_worker_sigterm_under_load_loses_no_committed_token(tmp_path):
    # The worker is stopped mid-run: the Spark side must finish every request
    # target-only from its committed prefix, with no partial commit anywhere.
    #
    # Why 200 requests, and no more: the signal comes once
    # the worker has drawn 50 proposals, about 150 of the run's 8,000 tokens, so
    # the run is in its first wave at any request count. What the signal can
    # break happens to the rounds in flight then (at most --concurrency = 4
    # requests) and to the prefixes committed before it: the same rounds at 200
    # as at 2,000 (the refusal counter covers every COMMIT up to the signal; a
    # lost, unfinished or short record of those requests fails the record checks
    # at either size). After it every round is target-only with reason
    # connection_lost, one deterministic path: 200 requests run about 7,800
    # such rounds, so a defect that broke one round in a thousand of them would
    # pass unseen with probability 0.999^7800 < 0.001; 2,000 requests would run
    # ten times as many of the same rounds.
    n = 200
    with worker_process("--metrics-port", "0", vocab=VOCAB, seed=SEED) as running:
        address = running.address
        worker = running.process
        prompts = tmp_path / "p.jsonl"
        prompts.write_text(json.dumps(PROMPT) + "\n")
        out = tmp_path / "o.jsonl"
        proc = subprocess.Popen(
            cli.spark_args(
                address,
                VOCAB,
                "--seed",
                "1",
                "--requests",
                str(n),
                "--max-tokens",
                "40",
                "--prompts",
                prompts,
                "--output",
                out,
                "--json",
                "--reply-timeout",
                "0.5",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Mid-run: once the worker has drawn some proposals.
        wait_until(lambda: scrape(running.metrics, "pp1_worker_steps_total") >= 50)
        # Every COMMIT carries the digest of the Spark side's new prefix and the
        # worker refuses one that differs from its own (as it refuses a STEP whose
        # digest differs): no refusal means the two sides' prefixes always agreed.
        refusals = scrape_page(running.metrics)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=10) == 0
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["requests"] == n
    assert all(r["finished"] for r in records)
    assert all(len(r["tokens"]) >= 40 for r in records)
    assert summary["fallbacks"] > 0
    assert summary["draft_tokens"] > 0
    assert "pp1_worker_refusals_total{" not in refusals
    # Only the loss of the worker may cause a fallback: never a refused COMMIT.
    assert set(summary["fallbacks_by_reason"]) <= {"connection_lost", "reply_timeout"}, summary


def test_spark_sigterm_drains_and_writes_what_it_committed(tmp_path):
    with worker_process(vocab=VOCAB, seed=SEED) as running:
        address = running.address
        out = tmp_path / "o.jsonl"
        proc = subprocess.Popen(
            cli.spark_args(
                address,
                VOCAB,
                "--requests",
                "100000",
                "--max-tokens",
                "50",
                "--output",
                out,
                "--json",
                "--metrics-port",
                "0",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # The metrics line comes after the signal handlers are installed.
        line = proc.stderr.readline()
        assert line.startswith("pp1-spark metrics on "), line
        metrics = line.rsplit(" ", 1)[1].strip()
        wait_until(lambda: scrape(metrics, "pp1_requests_total") >= 1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert 0 < summary["requests"] < 100000
    assert len(records) == summary["requests"]
    assert sum(len(r["tokens"]) for r in records) == summary["tokens"]
    assert all(0 <= t < VOCAB for r in records for t in r["tokens"])


def test_busy_poll_worker_serves_normally(tmp_path):
    with worker_process("--busy-poll", vocab=VOCAB, seed=SEED) as running:
        address = running.address
        summary, records = spark(address, tmp_path, requests=8, max_tokens=6)
    assert summary["fallbacks"] == 0
    assert all(len(r["tokens"]) >= 6 for r in records)


def test_terminal_token_ends_requests(tmp_path, worker):
    target = ToyLM(VOCAB, SEED)
    p = target.probs(PROMPT)
    p[PROMPT] = 0  # a prompt that ends in the terminal token is already finished
    eos = int(p.argmax())  # a likely token, so requests do end
    summary, records = spark(
        worker.address, tmp_path, "--eos", str(eos), requests=40, max_tokens=30
    )
    ended = [r for r in records if eos in r["tokens"]]
    assert ended, "no request produced the terminal token"
    for r in records:
        assert r["finished"]
        if eos in r["tokens"]:
            assert r["tokens"].index(eos) == len(r["tokens"]) - 1  # nothing after it
        else:
            assert len(r["tokens"]) >= 30
    assert summary["fallbacks"] == 0


def test_padded_rows_when_both_sides_say_so(tmp_path):
    # --row-entries above the vocabulary: dense rows carry zero padding, and the
    # two sides agree on it (docs/protocol.md section 4.1); a mismatch is refused.
    with worker_process("--row-entries", "128", vocab=VOCAB, seed=SEED) as running:
        summary, _ = spark(
            running.address, tmp_path, "--row-entries", "128", requests=2, max_tokens=4
        )
        assert summary["fallbacks"] == 0
        assert summary["draft_tokens"] > 0
        refused = cli.spark(running.address, VOCAB, "--requests", "1", "--connect-timeout", "1")
    assert refused.returncode == 1
    assert "LIMIT_EXCEEDED" in refused.stderr


def test_audit_against_an_honest_worker(tmp_path, worker):
    summary, _ = spark(worker.address, tmp_path, "--audit", requests=6, max_tokens=8)
    assert summary["fallbacks"] == 0
    assert summary["draft_tokens"] > 0


# Adaptive blocks through both daemons: a two-sample test of the first two committed
# tokens against target-only decoding (--depth 0) of the same prompt under another seed.
ADAPTIVE = {
    "confidence": ["--depth", "3", "--stop", "confidence:0.15"],
    "joint": ["--depth", "3", "--stop", "joint:0.05"],
    "auto": ["--depth", "auto"],
}


@pytest.fixture(scope="module")
def target_only_sample(worker, tmp_path_factory):
    # Requests n..2n-1 of a target-only run: the same target (--seed builds it) and
    # prompt, other request seeds than the adaptive runs' requests 0..n-1.
    n = 1000
    summary, records = spark(
        worker.address,
        tmp_path_factory.mktemp("zero"),
        "--depth",
        "0",
        "--concurrency",
        str(SLOTS),
        requests=2 * n,
        max_tokens=2,
    )
    assert summary["draft_tokens"] == 0
    return Counter(tuple(r["tokens"][:2]) for r in records[n:]), n


@pytest.mark.parametrize("mode", list(ADAPTIVE))
def test_adaptive_blocks_commit_the_target_law_two_sample(
    tmp_path, worker, mode, target_only_sample
):
    # Tolerance declared before the run: for each of the 144 cells of the joint law
    # of the first two tokens, the two samples' frequencies may differ by at most six
    # standard deviations of their difference (pooled) plus one count of each: about
    # 2e-9 false alarm per cell. A block revoked after its draw (docs/adaptive.md §4)
    # moves a cell by a quarter of its mass, dozens of deviations at these sizes.
    n = 1000
    summary, records = spark(
        worker.address, tmp_path, *ADAPTIVE[mode], "--concurrency", "4", requests=n, max_tokens=2
    )
    assert summary["requests"] == n
    assert summary["fallbacks"] == 0, summary["fallbacks_by_reason"]
    drafts, rounds, depth = summary["draft_tokens"], summary["rounds"], summary["mean_step_depth"]
    if mode == "auto":  # the controller chose depths below the most it may
        assert drafts == round(depth * rounds)
        assert 1 <= depth < 5
    else:  # the rule bound: fewer drafts than the depth of every STEP asked for
        assert 0 < drafts < depth * rounds
    ours = Counter(tuple(r["tokens"][:2]) for r in records)
    theirs, m = target_only_sample
    for cell in set(ours) | set(theirs):
        a, b = ours.get(cell, 0), theirs.get(cell, 0)
        pooled = (a + b) / (n + m)
        sd = sqrt(pooled * (1 - pooled) * (1 / n + 1 / m))
        assert abs(a / n - b / m) <= 6 * sd + 1 / n + 1 / m, (mode, cell, a, b)


def test_depth_auto_depends_on_earlier_verified_rounds_and_the_flags_alone(worker, monkeypatch):
    # Non-anticipating and timing-free by construction (docs/runner.md section 4.1).
    # Recorded apart from the driver's own choice: the depth each STEP carries (where
    # the client sends it) and each round's verdict (where the driver applies it). A
    # fresh controller, fed each request's verified rounds before its STEP and the
    # load the flags imply (min(--concurrency, --requests) = 4), must give exactly the
    # depth that went on the wire; a driver that used the live load (2 requests run
    # alone after the first 4), the round being drafted, or another request's rounds
    # would not.
    import asyncio

    from pp1wire.aio.client import AsyncClient
    from pp1wire.apps import driver
    from pp1wire.apps import spark as spark_app
    from pp1wire.q.stoprules import AcceptanceHistory, DepthController
    from pp1wire.q.verify import Outcome

    from .groups import args_of

    events: list[tuple] = []
    new_request, apply, propose = (
        driver.RoundDriver._new_request, driver.RoundDriver._apply, AsyncClient.propose
    )

    def recording_new(self, index):
        events.append(("new", index))
        return new_request(self, index)

    def recording_apply(self, r, verdict):
        res = verdict.result
        if res is not None and r.proposal is not None:
            events.append(("verified", r.state.index, res.accepted, res.outcome))
        return apply(self, r, verdict)

    async def recording_propose(self, slot, *, depth, **kw):
        events.append(("step", slot, depth))
        return await propose(self, slot, depth=depth, **kw)

    monkeypatch.setattr(driver.RoundDriver, "_new_request", recording_new)
    monkeypatch.setattr(driver.RoundDriver, "_apply", recording_apply)
    monkeypatch.setattr(AsyncClient, "propose", recording_propose)
    args = args_of(
        "--worker", worker.address, "--vocab", str(VOCAB), "--depth", "auto",
        "--requests", "6", "--concurrency", "4", "--max-tokens", "16",
    )  # fmt: skip
    plan, _ = spark_app.check_settings(args)
    done = asyncio.run(spark_app.run_rank(args, plan, None))
    assert done.summary is not None
    assert done.summary["fallbacks"] == 0
    assert plan.controller is not None
    fresh = DepthController(plan.controller.policy)
    history: dict[int, AcceptanceHistory] = {}
    on_slot: dict[int, int] = {}
    steps = 0
    for event in events:
        if event[0] == "new":
            on_slot[event[1] % 4] = event[1]
            history[event[1]] = AcceptanceHistory()
        elif event[0] == "step":
            index = on_slot[event[1]]
            assert event[2] == fresh.choose(history[index], 4), (index, history[index])
            steps += 1
        else:
            _, index, accepted, outcome = event
            history[index] = fresh.record(
                history[index], accepted, outcome is Outcome.CORRECTION
            )
    assert steps == done.summary["rounds"] > 6
    assert len({e[2] for e in events if e[0] == "step"}) > 1  # the choice moved


def test_depth_auto_gives_the_same_tokens_when_one_request_is_slowed(worker, monkeypatch):
    # Two runs with the same flags; in the second, every proposal of the request on
    # slot 0 arrives 0.1 s late, so that request falls steps behind the others, the
    # straggler window decides its rounds in steps of their own, and the requests
    # finish in another order. A depth chosen from the live number of running
    # requests would change with that (the last requests would run alone, at load 1
    # instead of 4) and with it the blocks and the tokens; a load from the flags
    # cannot (docs/runner.md section 4.1).
    import asyncio

    from pp1wire.aio.client import AsyncClient
    from pp1wire.apps import spark as spark_app

    from .groups import args_of

    def run() -> tuple[list[list[int]], dict]:
        args = args_of(
            "--worker", worker.address, "--vocab", str(VOCAB), "--depth", "auto",
            "--requests", "6", "--concurrency", "4", "--max-tokens", "24", "--seed", "7",
        )  # fmt: skip
        plan, _ = spark_app.check_settings(args)
        done = asyncio.run(spark_app.run_rank(args, plan, None))
        assert done.records is not None
        assert done.summary is not None
        assert (done.summary["fallbacks"], done.summary["cuts"]) == (0, 0), done.summary
        return [r.tokens for r in done.records], done.summary

    quick, _ = run()
    propose = AsyncClient.propose

    async def slowed(self, slot, **kw):
        got = await propose(self, slot, **kw)
        if slot == 0:
            await asyncio.sleep(0.1)
        return got

    monkeypatch.setattr(AsyncClient, "propose", slowed)
    slow, summary = run()
    assert summary["rounds"] > 12
    assert slow == quick
