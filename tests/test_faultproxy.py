"""Fault-injection scenarios through the TCP proxy, and a statistical run under chaos."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from math import sqrt
from pathlib import Path

import pytest

from pp1wire.aio.client import AsyncClient, ProposalUnavailableError
from pp1wire.apps.launch import worker_process
from pp1wire.apps.models import ToyLM
from pp1wire.errors import ErrorCode
from pp1wire.q.verify import RequestVerifier
from pp1wire.wire.spark_core import SparkConfig

from .faultproxy import FaultProxy, Faults
from .hostile import FaultyWorker
from .waiting import eventually

VOCAB = 32


class Rig:
    """A worker, a proxy in front of it, and a client with one open slot."""

    def __init__(self, faults: Faults, reply_timeout: float = 1.0) -> None:
        self.faults = faults
        self.reply_timeout = reply_timeout
        self.generation = 0
        self.cuts = 0

    async def __aenter__(self) -> Rig:
        self.worker = FaultyWorker(VOCAB)
        wport = await self.worker.start()
        self.proxy = FaultProxy("127.0.0.1", wport, self.faults)
        self.port = await self.proxy.start()
        self.verifier = RequestVerifier(
            session=0, seed=5, vocab_size=VOCAB, prefix=[1, 2, 3], target=ToyLM(VOCAB, 3).probs
        )
        await self.connect()
        return self

    async def connect(self) -> None:
        self.client = await AsyncClient.connect(
            "127.0.0.1",
            self.port,
            # Answers (OPENED, COMMITTED) ride the same delayed stream as replies: they
            # get a deadline of their own, so only the replies are late here.
            SparkConfig(vocab_size=VOCAB, reply_timeout=self.reply_timeout, answer_timeout=5.0),
        )
        self.verifier.rebuild(self.verifier.committed, self.generation)
        self.verifier.session = self.client.session
        await self.client.open(
            0, seed=5, prefix=self.verifier.committed, generation=self.generation
        )

    async def reconnect(self) -> None:
        self.client.abort()
        self.generation += 1
        await self.connect()

    async def round(self) -> None:
        """One verified round, committed; the worker's prefix must equal the verifier's."""
        proposal = await self.client.propose(0, round_id=self.client.next_round(0), depth=3)
        res = self.verifier.verify(proposal)
        self.client.release(proposal)
        await self.client.commit(0, round_id=res.round_id, tokens=res.tokens, accepted=res.accepted)
        assert self.worker.slot_prefix() == self.verifier.committed

    async def unavailable(self, code: ErrorCode) -> None:
        """The next proposal fails with ``code`` (the fault under test hit it)."""
        with pytest.raises(ProposalUnavailableError) as info:
            await self.client.propose(0, round_id=self.client.next_round(0), depth=3)
        assert info.value.code is code

    async def cut(self, code: ErrorCode) -> None:
        """The next proposal is cut by ``code`` (the fault hit it after some rows): its
        rows are verified here and committed locally (the connection may be gone)."""
        proposal = await self.client.propose(0, round_id=self.client.next_round(0), depth=3)
        assert proposal.cut is code
        assert 1 <= len(proposal.rows) < 3
        self.verifier.verify(proposal)
        self.client.release(proposal)
        self.cuts += 1

    async def fallback(self) -> None:
        round_id = self.client.next_round(0)
        res = self.verifier.decode_target_only(round_id)
        await self.client.commit(0, round_id=round_id, tokens=res.tokens, accepted=0)
        assert self.worker.slot_prefix() == self.verifier.committed

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.proxy.stop()
        await self.worker.stop()


@pytest.mark.asyncio
async def test_latency():
    async with Rig(Faults(latency=0.02)) as rig:
        started = time.perf_counter()
        await rig.round()
        assert time.perf_counter() - started >= 0.04


@pytest.mark.asyncio
async def test_bandwidth_limit():
    # The proxy forwards at most 20,000 B/s, so a round can take no less than
    # the bytes it delivered divided by that rate.
    rate = 20_000
    async with Rig(Faults(bandwidth=rate)) as rig:
        await rig.round()
        decoder = rig.client.core.decoder
        before = decoder.bytes_received
        started = time.perf_counter()
        await rig.round()
        elapsed = time.perf_counter() - started
        delivered = decoder.bytes_received - before
        assert delivered > 500
        assert elapsed >= delivered / rate


@pytest.mark.asyncio
async def test_one_byte_writes():
    async with Rig(Faults(one_byte_writes=True)) as rig:
        await rig.round()
        await rig.round()


@pytest.mark.asyncio
async def test_reset_after_n_bytes():
    # The reset lands inside the first reply, after its first row (the handshake and
    # OPENED are ~240 bytes, a dense row of 32 entries ~180).
    async with Rig(Faults(reset_after=450)) as rig:
        # The first row arrived whole before the reset: the block is cut there.
        await rig.cut(ErrorCode.CONNECTION_LOST)
        await rig.reconnect()  # reopened with the committed prefix, the cut round included
        assert rig.worker.slot_prefix() == rig.verifier.committed
        await rig.round()


@pytest.mark.asyncio
async def test_blackhole():
    async with Rig(Faults(blackhole_after=450), reply_timeout=0.3) as rig:
        # The rows that got through by the reply timeout are the block.
        await rig.cut(ErrorCode.REPLY_TIMEOUT)
        await rig.reconnect()
        await rig.round()


@pytest.mark.asyncio
async def test_slow_close():
    async with Rig(Faults(slow_close=0.3)) as rig:
        await rig.round()
        swallowed = []
        # The worker never answers this STEP...
        rig.worker.mutate = lambda conn, data: swallowed.append(data)
        pending = asyncio.ensure_future(
            rig.client.propose(0, round_id=rig.client.next_round(0), depth=3)
        )
        await eventually(lambda: swallowed, what="the STEP reached the worker")
        started = time.perf_counter()
        for conn in rig.worker.conns:
            conn.transport.close()  # ...and then goes away; the proxy holds the close
        with pytest.raises(ProposalUnavailableError) as info:
            await pending
        assert info.value.code is ErrorCode.CONNECTION_LOST
        assert time.perf_counter() - started >= 0.25


@pytest.mark.asyncio
async def test_duplicated_reply_is_dropped():
    async with Rig(Faults(duplicate_reply=True)) as rig:
        await rig.round()
        # 3 rows + completion, each duplicated by the proxy
        await eventually(lambda: rig.client.dropped["completion_duplicate"] == 4)
        await rig.round()


@pytest.mark.asyncio
async def test_delayed_reply_times_out_and_is_dropped():
    async with Rig(Faults(delay_reply=0.4), reply_timeout=0.2) as rig:
        await rig.unavailable(ErrorCode.REPLY_TIMEOUT)
        await rig.fallback()
        await eventually(lambda: rig.client.dropped["late_frame"] == 4)


def test_chaos_run_keeps_the_output_law(tmp_path):
    # About 10 % of replies get a random fault (dropped COMPLETION, corrupted row,
    # delay past the timeout, connection reset). Tolerance declared before the run:
    # each cell of the 12 x 12 joint law of the first two tokens within six binomial
    # standard deviations plus one count. Zero partial commits: the worker never
    # refuses a COMMIT.
    #
    # Most of the run is waiting out reply timeouts (a dropped COMPLETION or a
    # delayed reply costs its slot one timeout): eight slots and a 0.1 s timeout
    # wait a quarter as long as four and 0.2 s. A reply that misses the shorter
    # timeout for want of CPU is one more target-only round, which keeps the law.
    vocab, seed, n = 12, 3, 2000
    # The proxy hangs up on the honest client mid-draw; the worker charges those
    # abandons (tests/test_draws.py tests that). This test is about the law, so
    # the abandon budget is made large enough never to refuse a round.
    with worker_process(
        "--metrics-port", "0", "--max-slots", "8", "--abandon-burst", "65535",
        vocab=vocab, seed=seed,
    ) as running:
        address = running.address
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.faultproxy",
                "--target",
                address,
                "--chaos",
                "0.1",
                "--chaos-delay",
                "0.4",
                "--seed",
                "1",
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        try:
            line = proxy.stdout.readline()
            paddr = line.rsplit(" ", 1)[1].strip()
            out = tmp_path / "o.jsonl"
            prompts = tmp_path / "p.jsonl"
            prompts.write_text("[1, 2]\n")
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pp1wire.apps.spark",
                    "--worker",
                    paddr,
                    "--vocab",
                    str(vocab),
                    "--seed",
                    str(seed),
                    "--requests",
                    str(n),
                    "--max-tokens",
                    "2",
                    "--depth",
                    "3",
                    "--prompts",
                    str(prompts),
                    "--output",
                    str(out),
                    "--json",
                    "--concurrency",
                    "8",
                    "--reply-timeout",
                    "0.1",
                ],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        finally:
            proxy.send_signal(signal.SIGTERM)
            counts_line = proxy.communicate(timeout=30)[0].strip().splitlines()[-1]
        with urllib.request.urlopen(f"http://{running.metrics}/metrics", timeout=5) as r:
            metrics_text = r.read().decode()
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    faults = json.loads(counts_line)["faults"]
    assert sum(faults.values()) >= 50, faults
    assert summary["fallbacks"] >= 50
    assert summary["requests"] == n
    for code in ("commit_invalid", "wrong_position", "prefix_digest_mismatch", "round_reused"):
        assert f'pp1_worker_refusals_total{{code="{code}"}}' not in metrics_text
    records = [json.loads(x) for x in out.read_text().splitlines()]
    target = ToyLM(vocab, seed)
    p1 = target.probs([1, 2])
    counts = Counter(tuple(r["tokens"][:2]) for r in records)
    for a in range(vocab):
        p2 = target.probs([1, 2, a])
        for b in range(vocab):
            pr = float(p1[a] * p2[b])
            assert abs(counts.get((a, b), 0) - n * pr) <= 6 * sqrt(n * pr * (1 - pr)) + 1
