"""The vocabulary-sharded TP2 pipeline: 2 worker ranks, 2 Spark ranks, one link per pair.

Main acceptance: for the same seeds, prompts and requests, the sharded pipeline
emits exactly the tokens of the unsharded TP1 pipeline (here and in
``tests/test_same_tokens.py``, at 129,280 too). Faults are injected on worker
rank 1 through the testing entry point ``pp1wire.testing.shard_faults`` under
torchrun; each must make every Spark rank fall back for that round (counted by
reason), the workers must see exactly the target-only COMMITs and tokens the
Spark side reports (no partial commit), and the rounds after it must use
proposals again. The Spark ranks run as threads of the test process
(``tests/groups.py``), the worker ranks as real processes; one run starts the
Spark ranks as processes too.
"""

from __future__ import annotations

import json
import os

import pytest

from pp1wire.apps.launch import RunningGroup, worker_group, worker_process

from . import cli, groups
from .groups import lead, output_tokens, run_group, run_one, summary_of, tokens, workload
from .waiting import scrape, scrape_page

pytest.importorskip("torch")

VOCAB = 32
SEED = 5


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


def sharded_workers(
    *faults: str, vocab: int = VOCAB, env: dict[str, str] | None = None, extra: tuple = ()
):
    return worker_group(
        "--log-level", "warning", *extra, vocab=vocab, seed=SEED, faults=faults, env=env
    )


def faulted(*faults: str, flags: list[str], env: dict[str, str] | None = None, scrape: bool = True):
    """A sharded Spark group's run (``--requests``, ``--concurrency``, ``--max-tokens``
    then ``--reply-timeout`` from ``flags``) against a worker group with ``faults``;
    the run, and what each worker rank committed by then (with ``scrape``)."""
    requests, slots, tokens_, reply = flags
    extra = ["--requests", requests, "--concurrency", slots, "--max-tokens", tokens_]
    with sharded_workers(*faults, env=env) as workers:
        done = sharded(workers.address, *extra, "--reply-timeout", reply)
        return done, committed(workers) if scrape else []


MATCH_TIMEOUT = 1.0  # the shared group's: its unmatched STEPs are answered this soon


@pytest.fixture(scope="module")
def group():
    # Its tests open tens of links at once after others hung up mid-draw: no new
    # lineage waits for its turn (docs/protocol.md §4.4).
    extra = ("--match-timeout", str(MATCH_TIMEOUT), "--max-connections", "32")
    extra += ("--lineage-burst", "64")
    with sharded_workers(extra=extra) as running:
        yield running


@pytest.fixture(scope="module")
def tp1_worker():
    with worker_process(vocab=VOCAB, seed=SEED) as running:
        yield running


def spark_flags(address: str, *extra: str) -> list[str]:
    return workload(address, *extra, vocab=VOCAB, seed=SEED, requests=3, tokens=20, slots=3)


def sharded(address: str, *extra: str, timeout: float = 10.0):
    """Rank 0's result of a sharded TP2 Spark group (threads of this process)."""
    return lead(run_group(2, *spark_flags(address, *extra), sharded=True, timeout=timeout))


@pytest.mark.parametrize("support", ["dense", "sparse:6"])
def test_sharded_tp2_emits_the_tokens_of_unsharded_tp1(group, tp1_worker, support):
    ref = run_one(*spark_flags(tp1_worker.address, "--support", support))
    assert ref.code == 0
    before = committed(group)
    done = sharded(group.address, "--support", support)
    summary = summary_of(done)
    assert summary["fallbacks"] == 0, summary
    assert summary["draft_tokens"] > 0
    assert summary["shard_ranges"] == [[0, 16], [16, 32]]
    assert tokens(done) == tokens(ref)
    # Both worker ranks committed exactly the tokens the Spark side emitted.
    emitted = sum(len(t) for t in tokens(done))
    after = committed(group)
    assert [a[0] - b[0] for a, b in zip(after, before, strict=True)] == [emitted, emitted]


ADAPTIVE = [
    ("--stop", "confidence:0.3"),
    ("--stop", "joint:0.1", "--support", "sparse:6"),
    ("--depth", "auto"),
    ("--depth", "auto", "--stop", "joint:0.2"),
]


@pytest.mark.parametrize("flags", ADAPTIVE, ids=[" ".join(f) for f in ADAPTIVE])
def test_sharded_tp2_with_a_stop_rule_or_auto_depth_emits_the_tokens_of_unsharded_tp1(
    group, tp1_worker, flags
):
    # Every rank of the worker group stops each block where one worker stops it (the
    # count at each token travels with the token); every Spark rank audits it from
    # the counts the group gathers, and --depth auto chooses the same depths on every
    # rank as on one: the same rounds, drafts, acceptances and tokens. (Which rounds
    # share a step follows the straggler window, so the timing; it changes no token.)
    ref = summary_of(unsharded := run_one(*spark_flags(tp1_worker.address, *flags)))
    done = sharded(group.address, *flags)
    summary = summary_of(done)
    assert (summary["fallbacks"], summary["cuts"]) == (0, 0), summary
    assert tokens(done) == tokens(unsharded)
    same = ("rounds", "draft_tokens", "accepted_tokens", "mean_step_depth")
    assert {k: summary[k] for k in same} == {k: ref[k] for k in same}
    if "--stop" in flags:  # no terminal token: only the rule ended blocks early
        assert summary["stop_rule"] == flags[flags.index("--stop") + 1]
        assert summary["draft_tokens"] < summary["mean_step_depth"] * summary["rounds"]
    else:
        assert summary["mean_step_depth"] < 5


def test_sharded_spark_rank_processes(group, tp1_worker, tmp_path):
    out = tmp_path / "o.jsonl"
    argv = spark_flags(group.address, "--output", str(out), "--json", "--group-timeout", "10")
    argv += ["--connect-timeout", "5"]  # below the group timeout (the settings refuse others)
    done = cli.module("pp1wire.spark", *argv, "--tp", "2", "--vocab-shards", "2", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert output_tokens(out) == tokens(run_one(*spark_flags(tp1_worker.address)))
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["vocab_shards"] == 2
    assert summary["link_bytes_rank0"] > 0


def test_each_fault_on_one_link_falls_back_on_every_rank_then_rounds_resume(tmp_path):
    # One request on one slot: the group's draw k is the request's round k.
    faults = ("mass:1:2", "missing:1:4", "corrupt:1:6", "late:1:8")
    done, seen = faulted(*faults, flags=["1", "1", "60", "1"], env={"PP1_SHARD_LATE_S": "1.5"})
    summary = summary_of(done)
    reasons = summary["fallbacks_by_reason"]
    # The shard with the wrong total passed its own checks: the group refused it.
    assert reasons.get("group_mass_mismatch") == 1, reasons
    assert reasons.get("internal") == 1, reasons  # the missing shard's COMPLETION status
    assert reasons.get("negative") == 1, reasons  # refused by rank 1's own shard checks
    # The late shard misses the reply timeout; the round right after it may time
    # out too while rank 1 catches up.
    assert 1 <= reasons.get("reply_timeout", 0) <= 2, reasons
    assert set(reasons) == {"group_mass_mismatch", "internal", "negative", "reply_timeout"}
    emitted = sum(len(t) for t in tokens(done))
    fallbacks = summary["fallbacks"]
    # Every rank's worker saw exactly the target-only COMMITs and the tokens the
    # Spark side emitted: no round was committed on one link and not the other.
    assert seen == [(emitted, fallbacks), (emitted, fallbacks)]
    # Rounds after the faults used proposals again.
    assert done.records is not None
    (record,) = done.records
    assert record.rounds > fallbacks + 4
    assert record.draft_tokens >= 5 * (record.rounds - fallbacks)


def test_a_shard_from_a_stale_generation_is_dropped_and_the_round_falls_back():
    # Two requests on one slot: the second reopens it at generation 1, and rank 1's
    # first shard there names generation 0. Spark rank 1 drops those frames (counted
    # on its link), its shard never completes, and every rank falls back once.
    done, seen = faulted("stale:1:*", flags=["2", "1", "10", "0.5"])
    summary = summary_of(done)
    assert summary["fallbacks_by_reason"] == {"reply_timeout": 1}, summary
    emitted = sum(len(t) for t in tokens(done))
    assert seen == [(emitted, 1), (emitted, 1)]
    assert done.records is not None
    first, second = done.records
    assert first.fallbacks == 0
    assert second.fallbacks == 1
    assert second.draft_tokens > 0  # the rounds after it used proposals


def test_rows_drawn_before_a_slow_one_arrive_in_time_and_are_verified_as_a_cut_block():
    # The drafter takes SLOW s on a context of 4 tokens: the second row of each
    # request's first block (the prompt is [1, 2, 3]); both requests' first blocks
    # are drawn together, so one slow call. Each rank sends a block's first row as
    # soon as the group drew it, so at the reply timeout every link holds it and the
    # Spark group verifies it as a block cut there (docs/adaptive.md, section 7).
    # Before, a rank answered only when the block was done: at the reply timeout its
    # link had no row and the proposal was discarded whole (a fallback, no cut).
    # A reply timeout of 1 s (0.5 s before): every other row has that long to come
    # (a loaded machine once kept a request's every row past 0.5 s, so it drew
    # nothing); the slow row, 2 s, still misses it.
    slow, reply = 2.0, 1.0
    env = {"PP1_TEST_AT_LENGTH": "4", "PP1_TEST_SLOW_S": str(slow)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    drafter = ("--drafter", "tests.fault_plugins:slow_drafter_factory")
    with sharded_workers(env=env, extra=drafter) as workers:
        extra = ["--requests", "2", "--concurrency", "2", "--max-tokens", "8", "--depth", "3"]
        done = sharded(workers.address, *extra, "--reply-timeout", str(reply), timeout=30)
    summary = summary_of(done)
    assert summary["finished"] == 2
    assert summary["cuts_by_reason"].get("reply_timeout", 0) >= 1, summary
    assert done.records is not None
    assert all(record.draft_tokens > 0 for record in done.records)


def test_a_dead_worker_rank_leaves_the_spark_group_decoding_target_only():
    done, _ = faulted("die:1:3", flags=["2", "2", "12", "1"], scrape=False)  # rank 1 is dead
    summary = summary_of(done)
    assert summary["fallbacks"] >= 1
    assert summary["finished"] == 2
    assert all(len(t) >= 12 for t in tokens(done))


def test_a_spark_side_with_another_layout_is_refused_at_hello(group, capsys):
    assert run_one(*spark_flags(group.address)).code == 1
    assert "SHARD_LAYOUT_MISMATCH" in capsys.readouterr().err


def test_every_round_refused_by_the_group_still_samples_the_target_law():
    # Rank 1's shard carries a wrong total in every reply, so the group discards
    # every proposal and every first token is the target-only fallback: its law
    # must be p(. | prompt). Tolerance declared before the run: Pearson
    # chi-square at the 1 - 1e-6 quantile (tests/test_verify.py), 200 requests.
    n = 200
    extra = ["--requests", str(n), "--max-tokens", "1", "--concurrency", "4", "--depth", "1"]
    with sharded_workers("mass:1:*") as workers:
        done = sharded(workers.address, *extra, timeout=30)
    groups.assert_all_fell_back(done, "group_mass_mismatch", n, VOCAB, SEED)


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
        "--match-wait",
        str(MATCH_TIMEOUT + 2),
        "--json",
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    results = {
        r["id"]: r["grade"]
        for r in map(json.loads, (ln for ln in done.stdout.splitlines() if ln.startswith("{")))
    }
    assert {i: g for i, g in results.items() if i.startswith("6.7")} == {
        f"6.7.{n}": "pass" for n in range(1, 11)
    }
    assert all(g in ("pass", "informational") for g in results.values()), results


def test_a_sharded_group_honours_tls_and_metrics_like_one_rank(tmp_path, capsys):
    # Before: the sharded mode connected in plaintext whatever --tls-ca said (the TLS
    # worker refused every link) and served no metrics.
    from .certs import self_signed

    cert, key = self_signed(tmp_path)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    with worker_group(*tls, "--log-level", "warning", vocab=VOCAB, seed=SEED) as workers:
        argv = [*spark_flags(workers.address, "--tls-ca", str(cert)), "--metrics-port", "0"]
        done = lead(run_group(2, *argv, sharded=True))
        assert done.code == 0
        assert done.summary is not None
        assert done.summary["fallbacks"] == 0
        assert done.summary["draft_tokens"] > 0
        assert "pp1-spark metrics on 127.0.0.1:" in capsys.readouterr().err
        # Without the CA the links are refused as on one rank: one line, exit 1.
        refused = lead(run_group(2, *spark_flags(workers.address), sharded=True))
        assert refused.code == 1


async def _collide(address: str, seed: int) -> tuple[bool, bool]:
    """One collide attempt: a foreign link to rank 1 sends a group session's exact STEP
    (slot 0, generation 0, round 0, the prompt's digest: all predictable) just before
    the session does. Returns (the foreign link got a proposal, the session got its own
    on both links, the same tokens)."""
    import asyncio
    import dataclasses

    from pp1wire.testing.conformance.core import Peer, Settings

    host, port = address.rsplit(":", 1)
    # A Settings of its own is a group session of its own (a fresh group nonce).
    victim = Settings(host=host, port=int(port), vocab=VOCAB, shards=2, timeout=MATCH_TIMEOUT + 3)
    foreign = Settings(host=host, port=int(port) + 1, vocab=VOCAB, shards=2, shard=1)
    foreign.timeout = victim.timeout
    links = [Peer(dataclasses.replace(victim, port=int(port) + r, shard=r)) for r in (0, 1)]
    thief = Peer(foreign)
    try:
        for peer, s in ((thief, seed + 1), (links[0], seed), (links[1], seed)):
            await peer.connect()
            await peer.handshake()
            await peer.open_slot(seed=s)
        thief.send_msg(thief.step_msg(depth=3))
        await asyncio.sleep(0)
        for peer in links:
            peer.send_msg(peer.step_msg(depth=3))

        async def answer(peer: Peer) -> tuple[int, tuple[int, ...]]:
            tokens: list[int] = []
            while True:
                frame = await peer.next()
                if frame is None or frame.type.name == "ERROR":
                    return -1, ()
                if frame.type.name == "REPLY":
                    tokens.append(frame.message.token)
                if frame.type.name == "COMPLETION":
                    return frame.message.status, tuple(tokens)

        got = await asyncio.gather(answer(thief), *(answer(p) for p in links))
    finally:
        for peer in (thief, *links):
            peer.close()
    (stolen, _), (a, ta), (b, tb) = got
    return stolen == 0, a == 0 and b == 0 and ta == tb


def test_no_step_is_matched_across_group_sessions_in_20_collide_attempts(group):
    # Before: the match key named no session, so the foreign STEP was drawn with the
    # session's rank-0 STEP (the proposal from the session's seed handed to the
    # foreign peer) and the session's own rank-1 STEP was never answered.
    import asyncio

    async def waves() -> list[tuple[bool, bool]]:
        out: list[tuple[bool, bool]] = []
        # 10 attempts at once: 20 links on rank 1, within the group's --max-connections.
        for wave in range(2):
            out += await asyncio.gather(
                *(_collide(group.address, 100 + 10 * wave + i) for i in range(10))
            )
        return out

    results = asyncio.run(waves())
    assert len(results) == 20
    assert sum(stolen for stolen, _ in results) == 0, results
    assert all(served for _, served in results), results


def test_a_second_link_of_one_group_session_on_a_rank_is_refused(group):
    # One live link per group nonce and rank: its STEPs are matched unambiguously. Once
    # the first link closes, the nonce stays closed while its session could still be
    # matched (tests/test_worker_group_sessions.py), then it is free again: here no
    # other rank has a link of it, so after the match timeout.
    import asyncio
    import dataclasses
    import time

    from pp1wire.errors import ErrorCode
    from pp1wire.testing.conformance.core import CaseFailed, Peer, Settings

    host, port = group.address.rsplit(":", 1)
    s = Settings(host=host, port=int(port) + 1, vocab=VOCAB, shards=2, shard=1)

    async def link() -> Peer:
        peer = await Peer(dataclasses.replace(s)).connect()
        await peer.handshake()
        return peer

    async def scenario() -> int:
        first = await link()
        second = await link()  # the worker's HELLO, then the refusal
        try:
            await second.expect_error(ErrorCode.GROUP_IN_USE, fatal=True)
        finally:
            second.close()
        first.close()
        deadline = time.monotonic() + MATCH_TIMEOUT + 10
        attempt = 0
        while time.monotonic() < deadline:
            third = await link()
            try:
                await third.open_slot()
                return attempt
            except CaseFailed:
                attempt += 1
                await asyncio.sleep(0.1)
            finally:
                third.close()
        raise AssertionError("the group nonce stayed in use after its session ended")

    asyncio.run(scenario())
