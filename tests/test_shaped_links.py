"""The shaped-link benchmark (``benchmarks/shaped.py``): its namespaces come and go with it.

Creating namespaces, shaping a link and a small transfer through it, then
deleting them; refusing with one line and exit status 77 when namespaces cannot
be made; and deleting everything it made when stopped midway: SIGTERM (SIGINT and
SIGHUP in the opt-in ``bench`` run), a worker it
started killed (SIGKILL) under it, and — where nothing of its own can run — SIGKILL
of the benchmark itself, after which ``--cleanup`` deletes what it left. Every
case but the refusal needs root and iproute2, and skips with the reason when they
are missing. Each benchmark here runs a vocabulary of 256 at tiny sizes, so it
reaches its runs in a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .cli import alive
from .waiting import wait_until

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    import shaped  # the benchmark itself (it imports its sibling speedup.py)
finally:
    sys.path.remove(str(BENCH))

WHY = shaped.unavailable()
needs_netns = pytest.mark.skipif(
    WHY is not None, reason=f"network namespaces unavailable here: {WHY}"
)
# A run that stays in its timed runs long enough to be stopped there: one link, the
# one-rank worker only (no torch to import), many repetitions of a 4-token run.
LONG_RUN = (
    "--configs", "dense", "--vocab", "256", "--requests", "2", "--max-tokens", "4",
    "--target-ms", "1", "--reps", "10000", "--rates", "1gbit", "--transfer-mb", "0",
    "--no-pin",
)  # fmt: skip


def ip_json(*args: str) -> object:
    """``ip -j args`` in this process's namespace, parsed."""
    return json.loads(subprocess.run(["ip", "-j", *args], capture_output=True, text=True,
                                     check=True, timeout=30).stdout)  # fmt: skip


def host_view() -> list[object]:
    """The links, addresses, routes and rules of the namespace the tests run in."""
    return [ip_json(*a) for a in (["link", "show"], ["addr", "show"], ["route", "show"],
                                  ["rule", "show"])]  # fmt: skip


def pids_in(ns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                          timeout=30, check=False)  # fmt: skip
    return [int(p) for p in done.stdout.split()]


class Running:
    """``benchmarks/shaped.py`` started in the background, its stderr read on a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH / "shaped.py"), *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def until(self, prefix: str, timeout: float = 60.0) -> str:
        """Wait for a stderr line starting with ``prefix`` (deadline ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            if not self.reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no line {prefix!r} within {timeout} s: {self.lines}")

    def namespaces(self) -> list[str]:
        """The two namespaces it named on stderr (waits for that line)."""
        return self.until("shaped: namespaces ").split()[2:4]

    def wait(self, timeout: float = 30.0) -> int:
        """Its exit status, once it and its stderr ended."""
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def close(self) -> None:
        """Kill it if it still runs; close its stderr."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.reader.join(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def running() -> Iterator[list[Running]]:
    """Runs started by a test; whatever happens, each is killed and its namespaces deleted."""
    started: list[Running] = []
    yield started
    for run in started:
        run.close()
        for ns in shaped.namespaces():
            if ns.startswith(f"{shaped.PREFIX}{run.proc.pid}-"):
                shaped.delete_namespace(ns)


def long_run(running: list[Running]) -> tuple[Running, str, str]:
    """A :data:`LONG_RUN` (the ``running`` fixture's to clean up) that has reached its
    timed runs; it and its worker's and Spark side's namespaces, which both exist."""
    run = Running(*LONG_RUN)
    running.append(run)
    worker_ns, spark_ns = run.namespaces()
    run.until("shaped: run ")
    assert {worker_ns, spark_ns} <= set(shaped.namespaces())
    return run, worker_ns, spark_ns


def assert_deleted(*names: str) -> None:
    """None of the namespaces ``names`` exists any more."""
    left = shaped.namespaces()
    assert not [ns for ns in names if ns in left], left


def test_refuses_without_namespaces() -> None:
    """No ``ip``: one line, exit status 77, nothing created (as any missing requisite)."""
    before = shaped.namespaces() if WHY is None else []
    done = subprocess.run(
        [sys.executable, str(BENCH / "shaped.py"), "--ip", "/nonexistent/ip", "--smoke"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == shaped.UNAVAILABLE == 77, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("shaped.py: network namespaces unavailable (")
    assert ("/nonexistent/ip" in done.stderr) or ("not root" in done.stderr)
    if WHY is None:
        assert shaped.namespaces() == before


def test_unavailable_names_the_reason() -> None:
    for tool in ("ip", "tc"):
        missing = f"/nonexistent/{tool}"
        why = shaped.unavailable(**{tool: missing})
        assert why in ("not root", f"no {missing!r} (iproute2)")


@needs_netns
def test_links_come_shaped_and_go() -> None:
    """Two namespaces and two links; a transfer through link 1 shaped to 200 Mb/s goes
    at that rate and through that link only; afterwards nothing is left, and the
    namespace the tests run in never changed."""
    host = host_view()
    with shaped.Links(2) as links:
        names = shaped.namespaces()
        assert links.worker in names
        assert links.spark in names
        assert host_view() == host  # no link, address, route or rule out here
        for r in range(2):
            links.route(shaped.TRANSFER_PORT + r, r)
        links.shape("200mbit")
        size = 2 << 20
        got = shaped.transfer(links, 1, size)
        # Up to one bucket (128 KiB) goes through at the veth's own speed, and the
        # receiver times the bytes after its first read, which may hold less than
        # that bucket: it may see up to size / (size - bucket) of the rate (1.07x).
        # 1.25x leaves room for the clock; an unshaped veth here goes at 1-8 Gb/s (5x
        # and more). Below, 0.5x allows a receiver slowed by a busy machine.
        assert 0.5 * 0.2 <= got["gbit_per_s"] <= 1.25 * 0.2, got
        assert got["link_bytes"] >= size
        links.shape(None)
        sent = links.sent()
        assert sent[0][0] < size // 100  # link 0 carried nothing of it
        assert pids_in(links.worker) == pids_in(links.spark) == []
    assert_deleted(links.worker, links.spark)
    assert host_view() == host


@needs_netns
@pytest.mark.parametrize(
    "sig",
    [
        pytest.param(signal.SIGTERM, id="SIGTERM"),
        # The same handler as SIGTERM's, installed in the same loop: in the opt-in run.
        pytest.param(signal.SIGINT, marks=pytest.mark.bench, id="SIGINT"),
        pytest.param(signal.SIGHUP, marks=pytest.mark.bench, id="SIGHUP"),
    ],
)
def test_a_signal_midway_deletes_everything(running: list[Running], sig: int) -> None:
    run, worker_ns, spark_ns = long_run(running)
    inside = pids_in(worker_ns)
    assert inside  # the worker runs there
    run.proc.send_signal(sig)
    assert run.wait() == 128 + sig, run.lines
    assert "shaped.py: stopped by a signal; namespaces deleted" in run.lines
    assert_deleted(worker_ns, spark_ns)
    assert not any(alive(p) for p in inside)


@needs_netns
def test_a_killed_worker_ends_the_run_and_its_namespaces(running: list[Running]) -> None:
    run, worker_ns, spark_ns = long_run(running)
    inside = pids_in(worker_ns)
    for pid in inside:
        os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=60) == 1, run.lines
    assert any("pp1-worker exited" in line for line in run.lines), run.lines
    assert_deleted(worker_ns, spark_ns)


@needs_netns
def test_sigkill_leaves_what_cleanup_deletes(running: list[Running]) -> None:
    """SIGKILL runs no cleanup: its namespaces (named with its pid) and its worker stay,
    and ``--cleanup`` deletes them and stops what runs in them."""
    run, worker_ns, spark_ns = long_run(running)
    assert worker_ns.startswith(f"{shaped.PREFIX}{run.proc.pid}-")
    run.proc.kill()
    run.wait()
    left = shaped.namespaces()
    assert worker_ns in left
    assert spark_ns in left
    inside = pids_in(worker_ns)
    assert inside
    assert all(alive(p) for p in inside)
    done = subprocess.run(
        [sys.executable, str(BENCH / "shaped.py"), "--cleanup"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"deleted {worker_ns}" in done.stdout.splitlines()
    assert f"deleted {spark_ns}" in done.stdout.splitlines()
    assert_deleted(worker_ns, spark_ns)
    wait_until(lambda: not any(alive(p) for p in inside), 10, "the ranks inside ended")


@needs_netns
@pytest.mark.bench
def test_smoke_figures_are_made_of_this_run() -> None:
    """``--smoke --json`` (a minute or more: the sharded groups import torch): every
    ratio follows from this run's tokens/s, repetition by repetition; each sharded
    link carries about half of what the one unsharded link carries per step."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "shaped.py"), "--smoke", "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert {(t["rate"], t["link"]) for t in result["transfers"]} == {
        (rate, link) for rate in ("none", "1gbit") for link in (0, 1)
    }
    by = {(r["rep"], r["rate"], r["config"]): r for r in result["runs"]}
    for c in result["cells"]:
        (run,) = [r for r in result["runs"] if (r["rate"], r["config"]) == (c["rate"], c["config"])]
        tps = run["tokens_per_second"]
        assert c["vs_unshaped"]["median"] == tps / by[0, "none", c["config"]]["tokens_per_second"]
        assert c["vs_dense"]["median"] == tps / by[0, c["rate"], "dense"]["tokens_per_second"]
        if c["config"] == "sharded-dense":
            dense = by[0, c["rate"], "dense"]["link_bytes_per_step"][0]
            for per_link in run["link_bytes_per_step"]:
                # Half the q bytes, plus headers that do not halve: 0.4-0.65 of one link's.
                assert 0.4 * dense <= per_link <= 0.65 * dense, (per_link, dense)
    made = result["setup"]["namespaces"]
    assert len(made) == 2
    assert not set(made) & set(shaped.namespaces())
