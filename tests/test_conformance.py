"""pp1-conformance: passes against a fresh pp1-worker, and fails a broken one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys

import pytest

from pp1wire.apps.launch import worker_process
from pp1wire.testing import conformance
from pp1wire.wire import fencing
from pp1wire.wire.worker_core import WorkerProtocol

from .certs import self_signed
from .hostile import FaultyWorker


def test_at_least_100_numbered_cases_with_rules():
    assert len(conformance.CASES) >= 100
    ids = [c.id for c in conformance.CASES]
    assert len(set(ids)) == len(ids)
    categories = {c.category for c in conformance.CASES}
    assert {
        "framing",
        "handshake",
        "session and STEP",
        "COMMIT and RESET",
        "liveness and close",
    } <= categories
    assert all(c.rule for c in conformance.CASES)


def _suite(address: str, *args: str) -> list[str]:
    """The command line of pp1-conformance against a vocabulary-64 worker at ``address``."""
    return [
        sys.executable,
        "-m",
        "pp1wire.testing.conformance",
        "--worker",
        address,
        "--vocab",
        "64",
        *args,
    ]


NEEDS_KEY = {"5.8", "5.9", "5.10", "5.14"} | {f"5.1.{n}" for n in range(1, 8)}
NEEDS_TLS = {"2.4", "2.5"}
NEEDS_GROUP = {f"6.7.{n}" for n in range(3, 11)}  # tests/test_sharded.py
#: The cases a TLS run repeats (the rest are the plain run's, over TLS).
TLS_CASES = ["2.4", "2.5", "4.4.1", "5.1.8", "8.2", "8.3"]


MODES = ("plain", "psk", "tls")


@pytest.fixture(scope="module")
def suite_runs(tmp_path_factory):
    """The suite against a fresh worker in each mode, the three runs at once.

    Most of a run is waiting for the worker's handshake and idle timeouts
    (cases 5.12, 2.3), so running the modes side by side costs little more than
    the longest of them; each mode has its own worker, key, certificate and report.
    """
    runs = {}
    with contextlib.ExitStack() as stack:
        started = {}
        for mode in MODES:
            tmp = tmp_path_factory.mktemp(mode)
            extra = ["--handshake-timeout", "1", "--idle-timeout", "2"]
            suite = ["--handshake-wait", "3", "--idle-wait", "5"]
            key = tmp / "psk"
            if mode != "psk":
                # Without a key each case's connection is a new lineage, and the cases
                # hang up with draws in flight on purpose: this worker does not pace the
                # address's new lineages (docs/protocol.md §4.4).
                extra += ["--lineage-rate", "1000", "--lineage-burst", "65535"]
            if mode == "psk":
                key.write_text("a-test-key-of-enough-bytes\n")
                # Under one key every case is one principal, and the cases hang up with
                # draws in flight on purpose, which a worker charges (docs/protocol.md
                # §4.4): this worker's abandon budget lets them.
                extra += ["--psk-file", str(key), "--abandon-rate", "1000"]
                suite += ["--psk-file", str(key)]
            if mode == "tls":
                cert, pem = self_signed(tmp)
                extra += ["--tls-cert", str(cert), "--tls-key", str(pem)]
                suite += ["--tls-ca", str(cert), "--case", *TLS_CASES]
            running = stack.enter_context(worker_process(*extra, vocab=64))
            cmd = _suite(running.address, *suite, "--junit", str(tmp / "j.xml"), "--json")
            out = stack.enter_context((tmp / "stdout").open("w+"))
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
            started[mode] = (proc, out, tmp)
        for mode, (proc, out, tmp) in started.items():
            proc.wait(timeout=300)
            out.seek(0)
            runs[mode] = (proc.returncode, out.read(), tmp)
    return runs


@pytest.mark.parametrize("mode", MODES)
def test_suite_passes_against_a_fresh_worker(suite_runs, mode):
    returncode, stdout, tmp = suite_runs[mode]
    cases = list(conformance.CASES)
    if mode == "tls":
        cases = [c for c in cases if c.id in TLS_CASES]
    expected_skips = {
        "plain": NEEDS_KEY | NEEDS_TLS | NEEDS_GROUP,
        "psk": {"5.1.8"} | NEEDS_TLS | NEEDS_GROUP,
        "tls": set(),
    }[mode]
    assert returncode == 0, stdout[-3000:]
    results = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [r["id"] for r in results] == [c.id for c in cases]
    informational = {c.id for c in cases if c.informational}
    skipped = {r["id"] for r in results if r["detail"].startswith("skipped:")}
    assert skipped == expected_skips
    for r in results:
        if r["id"] in informational or r["id"] in skipped:
            assert r["grade"] == "informational", r
        else:
            assert r["grade"] == "pass", r  # not non-strict, not failed
    assert (tmp / "j.xml").read_text().count("<testcase") == len(cases)


def test_list_and_case_selection():
    out = subprocess.run(
        [sys.executable, "-m", "pp1wire.testing.conformance", "--list", "--case", "4.4"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "depth 0" in out
    assert "bad magic" not in out


@pytest.mark.asyncio
async def test_suite_detects_a_worker_that_skips_step_checks(monkeypatch):
    monkeypatch.setattr(WorkerProtocol, "_check_step", lambda self, slot, step: None)
    worker = FaultyWorker(64)
    port = await worker.start()
    settings = conformance.Settings(host="127.0.0.1", port=port, vocab=64, timeout=1.0)
    picked = [c for c in conformance.CASES if c.title in ("depth 0", "wrong prefix digest")]
    results = await conformance.run_all(picked, settings)
    await worker.stop()
    assert [o.grade for _, o, _ in results] == [conformance.Grade.FAIL] * 2


@pytest.mark.asyncio
async def test_suite_detects_a_worker_that_redraws_retries(monkeypatch):
    original = fencing.worker_step

    def forgetful(fence, step):
        fence.last_step_round = -1  # forget the replay cache: every retry is redrawn
        return original(fence, step)

    monkeypatch.setattr(fencing, "worker_step", forgetful)
    worker = FaultyWorker(64)
    port = await worker.start()
    settings = conformance.Settings(host="127.0.0.1", port=port, vocab=64, timeout=1.0)
    picked = [c for c in conformance.CASES if c.title == "reused round with other content"]
    (result,) = await conformance.run_all(picked, settings)
    await worker.stop()
    assert result[1].grade is conformance.Grade.FAIL
    await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_suite_detects_a_worker_that_ignores_its_stop_rule(monkeypatch):
    # A worker that drafts every block to its depth whatever the STEP's rule (and
    # still says it stopped when it did not): the rule cases must fail where the
    # rule binds; confidence:0 never stops and must still pass.
    from pp1wire.q import proposal

    monkeypatch.setattr(
        proposal, "admits_next", lambda _rule, depth, counts, tokens, eos: len(counts) < depth
    )
    worker = FaultyWorker(64)
    port = await worker.start()
    settings = conformance.Settings(host="127.0.0.1", port=port, vocab=64, timeout=1.0)
    picked = [c for c in conformance.CASES if c.id in ("6.4.2", "6.4.4", "6.4.6")]
    results = await conformance.run_all(picked, settings)
    await worker.stop()
    grades = {case.id: outcome.grade for case, outcome, _ in results}
    assert grades == {
        "6.4.2": conformance.Grade.PASS,
        "6.4.4": conformance.Grade.FAIL,
        "6.4.6": conformance.Grade.FAIL,
    }


@pytest.mark.parametrize(
    ("worker_args", "suite_args", "says"),
    [
        (
            (),
            ("--vocab", "65"),
            "VOCAB_SIZE_MISMATCH: pass the worker's vocabulary size with --vocab",
        ),
        (
            ("--target-identity", "other"),
            (),
            "IDENTITY_MISMATCH: pass the worker's target identity",
        ),
        (("--psk-file", "KEY"), (), "the worker wants a key: pass --psk-file"),
    ],
)
def test_a_mismatched_worker_gets_one_clear_line(tmp_path, worker_args, suite_args, says):
    key = tmp_path / "psk"
    key.write_text("a-test-key-of-enough-bytes")
    worker_args = tuple(str(key) if a == "KEY" else a for a in worker_args)
    with worker_process(*worker_args, vocab=64) as running:
        done = subprocess.run(
            _suite(running.address, *suite_args),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert says in lines[0]
