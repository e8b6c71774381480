"""Links of a stated speed: the worker and the Spark side in network namespaces of their
own, joined by one veth pair per link shaped with ``tc`` (tbf) to a stated rate.

Run from the repository root, as root: ``python benchmarks/shaped.py [--rates 40gbit
10gbit] [--reps 3] [--json]``; ``--smoke`` checks the harness in seconds;
``--cleanup`` removes what earlier runs that were killed (SIGKILL) left behind. It
needs root and iproute2 (``ip``, ``tc``); without them it prints one line and exits
77 (nothing created).

The run creates two namespaces, ``pp1shaped-<pid>-<hex>-w`` (the worker ranks) and
``pp1shaped-<pid>-<hex>-s`` (the Spark ranks), and link r as a veth pair ``l<r>``
between them, 10.77.r.1/30 on the worker's end and 10.77.r.2/30 on the Spark
side's. The worker listens on 10.77.255.1 (on its namespace's loopback); a Spark
rank reaches it at port P + r (``pp1-spark --worker HOST:P``, rank r adds r), and a
rule in the Spark namespace sends each port through its own link (``ip rule
dport``), so every rank pair's TCP connection has a veth pair to itself and the
worker's replies go back the way the connection came. Both ends of every link
carry a tbf qdisc at the stated rate (full duplex, as a link is). Nothing is
created, addressed or routed outside those two namespaces; the groups' own
rendezvous (gloo) stays on each namespace's loopback.

Whatever ends the run — its end, an exception, SIGINT, SIGTERM or SIGHUP — it
stops every process it started in the namespaces (SIGTERM, then SIGKILL; then
whatever ``ip netns pids`` still finds there) and deletes both namespaces, which
deletes their veth ends. Only SIGKILL of the benchmark itself leaves them behind:
``--cleanup`` then finds them by the name prefix and deletes those whose run (the
pid in the name) is gone.

Before the table, a raw TCP transfer (``--transfer-mb``, Python sockets, one
connection) through each link at each rate says what the shaping gives: the rate
the receiver saw from its first read to its last, against the rate set, and the
same transfer unshaped (the namespaces' ceiling on this machine).

The table: at V = 129,280 with the fixed-cost plugins of
:mod:`pp1wire.apps.paced` (target 20 ms per call, drafter 0.5 ms; as
``benchmarks/speedup.py``), 8 requests x 64 tokens at concurrency 8, depth 5,
each configuration at each rate (``none``: the same links unshaped), interleaved
(each repetition runs every cell once, in a rotated order):

* ``dense``, ``sparse32``: one ``pp1-worker``, one ``pp1-spark`` (one link);
* ``sharded-dense`` (and ``sharded-sparse32``, ``tp2-dense`` on request):
  ``pp1-worker --tp 2 --vocab-shards 2`` and ``pp1-spark --tp 2 --vocab-shards 2``
  (two links, one per rank pair; ``tp2``: ``pp1-spark --tp 2`` replicated, one link).

Per cell, median (min-max) over the repetitions: tokens/s; the ratio to the same
configuration unshaped, and to ``dense`` at the same rate, each taken repetition
by repetition; the step time (seconds / target calls) and ``fill`` (the rounds
each target call decided over the slots running: below 1 when a call went ahead
without the proposals still on the link); the bytes each link carried per step
(worker to Spark, counted on the veth: frames with their TCP/IP headers). The
worker runs on the first half of this process's cores and the Spark side on the
second, as in ``benchmarks/speedup.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from extras import require
from speedup import PAIRS, _cell_text, cores, pinned, summarize

from pp1wire.apps.launch import LISTENING, spark_command, worker_command
from pp1wire.apps.paced import DRAFTER_MS_ENV, TARGET_MS_ENV

ROOT = Path(__file__).resolve().parent.parent
UNAVAILABLE = 77  # exit status: no namespaces here (the "skipped" of test harnesses)
PREFIX = "pp1shaped-"
WORKER_HOST = "10.77.255.1"  # on the worker namespace's loopback: every link reaches it
RATES = ("40gbit", "10gbit")
CONFIGS = ("dense", "sparse32", "sharded-dense")
KNOWN_CONFIGS = ("dense", "sparse32", "sharded-dense", "sharded-sparse32", "tp2-dense")
VOCAB = 129_280
TARGET_MS = 20.0
DRAFTER_MS = 0.5
DEPTH = 5
# Ports inside the worker namespace, which nothing else uses: the one-rank worker, the
# worker group (rank r at + r) and the raw transfers (link r at + r).
SINGLE_PORT, GROUP_PORT, TRANSFER_PORT = 7000, 7100, 7200
# tbf: the bucket must hold what the link carries between two runs of the qdisc's
# watchdog on a busy machine, or the rate set is never reached (with 1,500-byte frames
# on the development VM, 200 us reached 0.88 of 2 Gb/s and 1 ms 0.95, the most those
# frames' headers leave).
# The link idles between steps long enough to fill it, so each step's first BURST_S
# of bytes pass at the veth's own speed: a step's transfer takes at most BURST_S less
# than at the exact rate. A queue of LATENCY beyond the bucket lets a burst wait
# rather than be dropped.
BURST_S = 1e-3
LATENCY = "20ms"
MTU = 9000  # jumbo frames, as links of these speeds run

_TRANSFER_SERVER = """
import socket, sys
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_server((host, port))
print("ready", flush=True)
c, _ = s.accept()
c.sendall(bytes(size))
c.close()
"""
_TRANSFER_CLIENT = """
import json, socket, sys, time
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = bytearray(1 << 20)
c = socket.create_connection((host, port), timeout=30)
first_chunk = n = got = c.recv_into(buf)
first = time.perf_counter()
while got:
    got = c.recv_into(buf)
    n += got
seconds = time.perf_counter() - first
print(json.dumps({"bytes": n, "timed": n - first_chunk, "seconds": seconds}))
"""


class Interrupted(SystemExit):
    """A signal ended the run (its exit status is 128 + the signal's number)."""


def rate_bits(rate: str) -> int:
    """``40gbit`` / ``500mbit`` / ``10000kbit`` / ``1e9``: bits per second.

    Raises:
        ValueError: anything else, or a rate not above zero.
    """
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit):
            value = float(text[: -len(unit)]) * scale
            break
    else:
        value = float(text)
    if not value > 0:
        raise ValueError(f"rate {rate!r}: not above zero")
    return int(value)


def tbf_args(rate: str) -> list[str]:
    """The tbf qdisc for ``rate``: ``rate R burst B latency L``.

    The bucket is :data:`BURST_S` of the rate (at least 128 KiB: two GSO frames of 64
    KiB must fit, or tbf splits every one)."""
    burst = max(128 * 1024, int(rate_bits(rate) / 8 * BURST_S))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", LATENCY]


def _run(cmd: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def unavailable(ip: str = "ip", tc: str = "tc") -> str | None:
    """Why network namespaces cannot be made here, or None when they can (a probe
    namespace is made and deleted)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "not root"
    for tool in (ip, tc):
        if shutil.which(tool) is None:
            return f"no {tool!r} (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        done = _run([ip, "netns", "add", probe], check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{ip} netns add: {exc}"
    if done.returncode != 0:
        return f"{ip} netns add failed: {done.stderr.strip() or done.returncode}"
    _run([ip, "netns", "del", probe], check=False)
    return None


def owner_alive(name: str) -> bool:
    """Whether the run that made namespace ``name`` (the pid after the prefix) still runs."""
    try:
        pid = int(name[len(PREFIX) :].split("-", 1)[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (ValueError, OSError):
        return False
    return b"shaped" in cmdline


def namespaces(ip: str = "ip") -> list[str]:
    """The names of this benchmark's namespaces that exist now (any run's)."""
    out = _run([ip, "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def kill_inside(ns: str, ip: str = "ip") -> int:
    """SIGKILL every process in namespace ``ns``; how many."""
    done = _run([ip, "netns", "pids", ns], check=False)
    pids = [int(p) for p in done.stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def delete_namespace(ns: str, ip: str = "ip") -> None:
    """Kill what runs in ``ns`` and delete it (its veth ends go with it); a missing one
    is no error. Processes that were still starting get a second chance to be seen."""
    for _ in range(3):
        if not kill_inside(ns, ip):
            break
        time.sleep(0.05)
    _run([ip, "netns", "del", ns], check=False)


def cleanup(ip: str = "ip") -> list[str]:
    """Delete the namespaces of earlier runs that are gone (``--cleanup``); their names."""
    gone = [ns for ns in namespaces(ip) if not owner_alive(ns)]
    for ns in gone:
        delete_namespace(ns, ip)
    return gone


class Links:
    """The run's two namespaces and ``count`` shaped links between them (a context manager).

    Processes started with :meth:`start` run inside a namespace and are stopped when
    the block ends, before the namespaces are deleted."""

    def __init__(self, count: int, *, ip: str = "ip", tc: str = "tc") -> None:
        """Name the namespaces (``-w``: worker, ``-s``: Spark); nothing is created yet."""
        self.count, self.ip, self.tc = count, ip, tc
        self.run = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.worker, self.spark = f"{self.run}-w", f"{self.run}-s"
        self.created: list[str] = []
        self.processes: list[subprocess.Popen[Any]] = []
        self.pumps: dict[int, list[threading.Thread]] = {}  # pid: threads reading its output
        self.rate: str | None = None

    def __enter__(self) -> Links:
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, ns: str, *args: str) -> None:
        _run([self.ip, "-n", ns, *args])

    def _up(self) -> None:
        for ns in (self.worker, self.spark):
            self.created.append(ns)  # before it exists: a signal now still deletes it
            _run([self.ip, "netns", "add", ns])
            self._ns(ns, "link", "set", "lo", "up")
            # Each link's replies come back on the link they belong to, not on the
            # route back to the worker's address: no reverse-path filter here.
            off = ["net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"]
            _run([self.ip, "netns", "exec", ns, "sysctl", "-qw", *off])
        self._ns(self.worker, "addr", "add", f"{WORKER_HOST}/32", "dev", "lo")
        for r in range(self.count):
            dev = f"l{r}"
            # Made directly inside the namespaces: the name never exists outside them.
            _run([self.ip, "link", "add", dev, "netns", self.worker, "type", "veth",
                  "peer", "name", dev, "netns", self.spark])  # fmt: skip
            self._ns(self.worker, "addr", "add", f"10.77.{r}.1/30", "dev", dev)
            self._ns(self.spark, "addr", "add", f"10.77.{r}.2/30", "dev", dev)
            for ns in (self.worker, self.spark):
                self._ns(ns, "link", "set", dev, "mtu", str(MTU), "up")
            self._ns(self.spark, "route", "add", f"{WORKER_HOST}/32", "via", f"10.77.{r}.1",
                     "dev", dev, "src", f"10.77.{r}.2", "table", str(100 + r))  # fmt: skip

    def route(self, port: int, link: int) -> None:
        """Connections from the Spark side to the worker's ``port`` go through ``link``."""
        self._ns(self.spark, "rule", "add", "dport", str(port), "table", str(100 + link))

    def shape(self, rate: str | None) -> None:
        """Every link, both ways, at ``rate`` (tc's syntax: ``10gbit``); None: unshaped."""
        for r in range(self.count):
            for ns in (self.worker, self.spark):
                if rate is None:
                    if self.rate is not None:
                        _run([self.tc, "-n", ns, "qdisc", "del", "dev", f"l{r}", "root"])
                else:
                    _run([self.tc, "-n", ns, "qdisc", "replace", "dev", f"l{r}", "root",
                          *tbf_args(rate)])  # fmt: skip
        self.rate = rate

    def sent(self) -> list[tuple[int, int]]:
        """Each link's (bytes worker to Spark, bytes Spark to worker) so far."""
        out = json.loads(_run([self.ip, "-n", self.worker, "-s", "-j", "link", "show"]).stdout)
        by_name = {x["ifname"]: x["stats64"] for x in out}
        return [
            (by_name[f"l{r}"]["tx"]["bytes"], by_name[f"l{r}"]["rx"]["bytes"])
            for r in range(self.count)
        ]

    def start(self, ns: str, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """``cmd`` inside ``ns``, in a session of its own (stopped by :meth:`close`)."""
        with deferred_signals():  # never a process started and not yet recorded
            proc: subprocess.Popen[Any] = subprocess.Popen(
                [self.ip, "netns", "exec", ns, *cmd], start_new_session=True, **kw
            )
            self.processes.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
        """SIGTERM ``proc``'s process group, SIGKILL after ``grace`` seconds; reap it."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # ranks it started, even if it exited
        proc.wait()
        for t in self.pumps.pop(proc.pid, []):
            t.join(timeout=5)  # its output ends with its process group
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        with contextlib.suppress(ValueError):
            self.processes.remove(proc)

    def pump(self, proc: subprocess.Popen[str]) -> list[str]:
        """Read ``proc``'s stdout and stderr on threads into the list returned (its lines)."""
        lines: list[str] = []

        def read(stream: Any) -> None:
            for line in stream:
                lines.append(line)

        threads = [
            threading.Thread(target=read, args=(s,), daemon=True)
            for s in (proc.stdout, proc.stderr)
            if s is not None
        ]
        self.pumps[proc.pid] = threads
        for t in threads:
            t.start()
        return lines

    def close(self) -> None:
        """Stop every process started here, then delete the namespaces (a signal that
        arrives meanwhile takes effect once this is done)."""
        with deferred_signals():
            for proc in list(self.processes):
                self.stop(proc, grace=2.0)
            for ns in reversed(self.created):
                delete_namespace(ns, self.ip)
            self.created.clear()


HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait until the block ends, then take effect (main thread;
    elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old = {sig: signal.signal(sig, lambda n, _f: pending.append(n)) for sig in HELD}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in pending:
            signal.raise_signal(signum)


def interrupt(signum: int, _frame: FrameType | None) -> None:
    """SIGINT / SIGTERM / SIGHUP handler: end the run as an exception does (the cleanup runs).

    Raises:
        Interrupted: always, with the exit status 128 + ``signum``.
    """
    raise Interrupted(128 + signum)


def transfer(links: Links, link: int, size: int) -> dict[str, Any]:
    """``size`` bytes from the worker namespace to the Spark one through ``link``, over
    one TCP connection: the receiver's rate (the bytes after its first read, over the
    time from that read to the last) and what the link counted."""
    port = TRANSFER_PORT + link
    server = links.start(
        links.worker,
        [sys.executable, "-c", _TRANSFER_SERVER, WORKER_HOST, str(port), str(size)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the transfer's server did not start")
        before = links.sent()
        client = links.start(
            links.spark,
            [sys.executable, "-c", _TRANSFER_CLIENT, WORKER_HOST, str(port), str(size)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            out, err = client.communicate(timeout=60)
        finally:
            links.stop(client, grace=1.0)
        if client.returncode != 0:
            raise RuntimeError(f"the transfer's client exited {client.returncode}: {err}")
        after = links.sent()
        got = json.loads(out)
    finally:
        links.stop(server, grace=1.0)
    if got["bytes"] != size:
        raise RuntimeError(f"transfer: {got['bytes']} bytes of {size}")
    carried = after[link][0] - before[link][0]
    return {
        "bytes": size,
        "seconds": got["seconds"],
        "gbit_per_s": got["timed"] * 8 / got["seconds"] / 1e9,
        "link_bytes": carried,
    }


def wait_listening(
    links: Links, proc: subprocess.Popen[str], ranks: int, timeout: float
) -> list[str]:
    """Read ``proc``'s output until ``ranks`` "listening" lines came; its lines (and more).

    Raises:
        RuntimeError: if it exits or does not listen within ``timeout`` seconds.
    """
    lines = links.pump(proc)
    deadline = time.monotonic() + timeout
    while sum(LISTENING in line for line in lines) < ranks:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not start: {''.join(lines)[-3000:]}")
        time.sleep(0.05)
    return lines


def start_worker(
    links: Links, *, sharded: bool, setup: dict[str, Any]
) -> subprocess.Popen[str]:
    """``pp1-worker`` (sharded: ``--tp 2 --vocab-shards 2``) in the worker namespace, on
    the worker's cores, listening on :data:`WORKER_HOST`; waits until every rank listens.

    Raises:
        RuntimeError: if it does not start.
    """
    port = GROUP_PORT if sharded else SINGLE_PORT
    extra = ["--tp", "2", "--vocab-shards", "2"] if sharded else []
    cmd = worker_command(
        "--drafter", PAIRS["toy"][0]["logits"], "--max-slots", str(setup["requests"]),
        "--host", WORKER_HOST, "--port", str(port), "--insecure", *extra,
        vocab=setup["vocab"], seed=0,
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", DRAFTER_MS_ENV: repr(DRAFTER_MS)}
    proc = links.start(
        links.worker, pinned(cmd, setup["worker_cores"]) if setup["pin"] else cmd,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    wait_listening(links, proc, 2 if sharded else 1, timeout=120)
    return proc


def spark_flags(config: str) -> tuple[int, list[str]]:
    """A configuration's worker port and ``pp1-spark`` flags (beyond the common ones)."""
    support = "sparse:32" if config.endswith("sparse32") else "dense"
    if config.startswith("sharded-"):
        return GROUP_PORT, ["--support", support, "--tp", "2", "--vocab-shards", "2"]
    if config.startswith("tp2-"):
        return SINGLE_PORT, ["--support", support, "--tp", "2"]
    return SINGLE_PORT, ["--support", support]


def spark_run(
    links: Links,
    config: str,
    setup: dict[str, Any],
    *,
    workers: Sequence[subprocess.Popen[str]] = (),
    tokens: int | None = None,
) -> dict[str, Any]:
    """One ``pp1-spark`` run of ``config`` in the Spark namespace: its summary, with the
    bytes each link carried during it (``link_bytes``: worker to Spark, Spark to worker).

    Raises:
        RuntimeError: if it fails, runs past 15 minutes, or one of ``workers`` exits
            meanwhile (the run is stopped then: it would measure something else).
    """
    port, flags = spark_flags(config)
    requests = str(setup["requests"])
    cmd = spark_command(
        f"{WORKER_HOST}:{port}", "--target", PAIRS["toy"][1],
        "--requests", requests, "--concurrency", requests,
        "--max-tokens", str(tokens or setup["tokens"]), "--depth", str(DEPTH), "--json", *flags,
        vocab=setup["vocab"],
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", TARGET_MS_ENV: repr(setup["target_ms"])}
    before = links.sent()
    proc = links.start(
        links.spark, pinned(cmd, setup["spark_cores"]) if setup["pin"] else cmd,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    deadline = time.monotonic() + 900
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pp1-spark ({config}) ran past 15 minutes") from None
            for w in workers:
                if w.poll() is not None:
                    raise RuntimeError(f"pp1-worker exited {w.returncode} during a {config} run")
    finally:
        links.stop(proc, grace=1.0)
    if proc.returncode != 0:
        raise RuntimeError(f"pp1-spark ({config}) exited {proc.returncode}: {err[-2000:]}")
    after = links.sent()
    summary: dict[str, Any] = json.loads(next(x for x in out.splitlines() if x.startswith("{")))
    summary["link_bytes"] = [
        (a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)
    ]
    return summary


def links_of(config: str) -> int:
    """How many links a configuration uses (one per rank pair; one unsharded)."""
    return 2 if config.startswith("sharded-") else 1


def figures(run: dict[str, Any], config: str) -> dict[str, Any]:
    """One run's figures: tokens/s, step time, bytes per link and step (its links only)."""
    steps = max(1, run["steps"])
    used = run["link_bytes"][: links_of(config)]
    return {
        "tokens_per_second": run["tokens_per_second"],
        "step_ms": 1e3 * run["seconds"] / steps,
        "steps": run["steps"],
        "seconds": run["seconds"],
        "tokens": run["tokens"],
        "mean_accepted_length": run["mean_accepted_length"],
        "fill": run["step_fill"],
        "fallbacks": run["fallbacks"],
        "link_bytes_per_step": [down / steps for down, _ in used],
        "link_bytes_up_per_step": [up / steps for _, up in used],
    }


def progress(text: str) -> None:
    """One line on stderr (what the run is doing; a test waits on these)."""
    print(f"shaped: {text}", file=sys.stderr, flush=True)


def measure(
    links: Links,
    *,
    rates: Sequence[str],
    configs: Sequence[str],
    setup: dict[str, Any],
    reps: int,
    transfer_bytes: int,
    warm_up: bool,
) -> dict[str, Any]:
    """The raw transfers, then the table (see the module docstring), in ``links``."""
    all_rates: list[str | None] = [None, *rates]
    transfers = []
    for rate in all_rates if transfer_bytes else ():
        links.shape(rate)
        for link in range(links.count):
            got = transfer(links, link, transfer_bytes)
            got.update(rate=rate or "none", link=link)
            if rate is not None:
                got["vs_rate"] = got["gbit_per_s"] * 1e9 / rate_bits(rate)
            progress(f"transfer {rate or 'none'} link {link}: {got['gbit_per_s']:.2f} Gb/s")
            transfers.append(got)
    links.shape(None)
    workers = []
    if any(c.startswith("tp2-") or not c.startswith("sharded-") for c in configs):
        workers.append(start_worker(links, sharded=False, setup=setup))
    if any(c.startswith("sharded-") for c in configs):
        workers.append(start_worker(links, sharded=True, setup=setup))

    def run(config: str, tokens: int | None = None) -> dict[str, Any]:
        return spark_run(links, config, setup, workers=workers, tokens=tokens)

    if warm_up:
        for config in configs:
            run(config, tokens=8)
    cells = [(rate, config) for rate in all_rates for config in configs]
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        turn = cells[rep % len(cells) :] + cells[: rep % len(cells)]
        for rate, config in turn:
            if links.rate != rate:
                links.shape(rate)
            progress(f"run {rep + 1}/{reps} {rate or 'none'} {config}")
            got = figures(run(config), config)
            runs.append({"rep": rep, "rate": rate or "none", "config": config, **got})
    links.shape(None)
    return {"transfers": transfers, "runs": runs, "cells": cell_figures(runs, configs)}


def cell_figures(runs: list[dict[str, Any]], configs: Sequence[str]) -> list[dict[str, Any]]:
    """Each (rate, configuration): median (min-max) over the repetitions, and its ratios
    to the same configuration unshaped and to ``dense`` at the same rate, each taken
    repetition by repetition (a repetition ran every cell once)."""
    by = {(r["rep"], r["rate"], r["config"]): r for r in runs}
    reps = sorted({r["rep"] for r in runs})
    cells = []
    for rate in dict.fromkeys(r["rate"] for r in runs):
        for config in configs:
            mine = [by[rep, rate, config] for rep in reps]
            cell: dict[str, Any] = {"rate": rate, "config": config}
            for name in ("tokens_per_second", "step_ms", "fill", "mean_accepted_length",
                         "fallbacks"):  # fmt: skip
                cell[name] = summarize([r[name] for r in mine])
            for name in ("link_bytes_per_step", "link_bytes_up_per_step"):
                cell[name] = [
                    summarize([r[name][i] for r in mine]) for i in range(links_of(config))
                ]
            tps = [r["tokens_per_second"] for r in mine]
            unshaped = [by[rep, "none", config]["tokens_per_second"] for rep in reps]
            cell["vs_unshaped"] = summarize([a / b for a, b in zip(tps, unshaped, strict=True)])
            if "dense" in configs:
                dense = [by[rep, rate, "dense"]["tokens_per_second"] for rep in reps]
                cell["vs_dense"] = summarize([a / b for a, b in zip(tps, dense, strict=True)])
            cells.append(cell)
    return cells


def report(result: dict[str, Any]) -> str:
    """The transfers and the table, as text and markdown."""
    s = result["setup"]
    lines = []
    if result["transfers"]:
        lines.append(
            f"raw TCP transfers of {s['transfer_bytes'] / 2**20:g} MiB worker -> Spark, one "
            f"connection per link (MTU {MTU}, tbf burst {BURST_S * 1e3:g} ms of the rate):"
        )
    for t in result["transfers"]:
        vs = f" = {t['vs_rate']:.2f} of the rate" if "vs_rate" in t else " (unshaped)"
        lines.append(
            f"  {t['rate']:>8} link {t['link']}: {t['gbit_per_s']:6.2f} Gb/s{vs}; "
            f"{t['link_bytes']:,} bytes counted on the link"
        )
    lines += [
        "",
        f"V = {s['vocab']:,}, target {s['target_ms']:g} ms per call, drafter {DRAFTER_MS} ms, "
        f"{s['requests']} requests x {s['tokens']} tokens at concurrency {s['requests']}, "
        f"depth {DEPTH}; worker on cores {s['worker_cores']}, Spark on {s['spark_cores']}; "
        f"median (min-max) of {s['reps']} interleaved repetitions",
        "",
        "| link | configuration | tokens/s | vs unshaped | vs dense | step ms | fill | "
        "MB per link per step (worker -> Spark) | fallbacks |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        per_link = " / ".join(f"{b['median'] / 1e6:.2f}" for b in c["link_bytes_per_step"])
        vs_dense = _cell_text(c["vs_dense"]) if "vs_dense" in c else ""
        lines.append(
            f"| {c['rate']} | {c['config']} | {_cell_text(c['tokens_per_second'], 0)} "
            f"| {_cell_text(c['vs_unshaped'])} | {vs_dense} | {_cell_text(c['step_ms'], 1)} "
            f"| {c['fill']['median']:.2f} | {per_link} | {c['fallbacks']['max']:g} |"
        )
    goal = [
        f"{c['rate']}: sharded-dense / dense tokens/s = {_cell_text(c['vs_dense'])}"
        for c in result["cells"]
        if c["config"] == "sharded-dense" and "vs_dense" in c
    ]
    if goal:
        lines += ["", "(goal: at least 1.5 at 10gbit)", *goal]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print (see the module docstring); returns the exit status."""
    require("torch")
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rates", nargs="+", default=list(RATES), metavar="RATE",
                   help="link rates in tc's syntax (default: 40gbit 10gbit); unshaped is "
                   "always measured too")  # fmt: skip
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=KNOWN_CONFIGS)
    p.add_argument("--vocab", type=int, default=VOCAB, metavar="V")
    p.add_argument("--target-ms", type=float, default=TARGET_MS, metavar="MS")
    p.add_argument("--requests", type=int, default=8, metavar="N")
    p.add_argument("--max-tokens", type=int, default=64, metavar="TOKENS")
    p.add_argument("--reps", type=int, default=3, metavar="N", help="interleaved repetitions")
    p.add_argument("--transfer-mb", type=float, default=64.0, metavar="MIB",
                   help="size of each raw transfer (default 64 MiB; 0: none)")  # fmt: skip
    p.add_argument("--no-pin", action="store_true", help="leave the processes unpinned")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny run (V = 1,024, 2 requests x 4 tokens, 2 ms target, one "
                   "repetition at 1gbit): checks that the harness works")  # fmt: skip
    p.add_argument("--cleanup", action="store_true",
                   help="delete what killed runs left (namespaces named pp1shaped-*, whose "
                   "run is gone) and exit")  # fmt: skip
    p.add_argument("--ip", default="ip", metavar="PATH", help="iproute2's ip (default: ip)")
    p.add_argument("--tc", default="tc", metavar="PATH", help="iproute2's tc (default: tc)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    for rate in args.rates:
        try:
            rate_bits(rate)
        except ValueError as exc:
            p.error(str(exc))
    if args.smoke:
        args.vocab, args.requests, args.max_tokens, args.target_ms = 1024, 2, 4, 2.0
        args.reps, args.rates, args.transfer_mb = 1, ["1gbit"], 4.0
    why = unavailable(args.ip, args.tc)
    if why is not None:
        print(f"shaped.py: network namespaces unavailable ({why}); nothing started",
              file=sys.stderr)  # fmt: skip
        return UNAVAILABLE
    if args.cleanup:
        for ns in cleanup(args.ip):
            print(f"deleted {ns}")
        return 0
    left = [ns for ns in namespaces(args.ip) if not owner_alive(ns)]
    if left:
        progress(f"{len(left)} namespaces of earlier runs are left: --cleanup deletes them")
    for sig in HELD:  # SIGINT too: a run started in the background ignores it otherwise
        signal.signal(sig, interrupt)
    worker_cores, spark_cores = cores()
    setup = {
        "vocab": args.vocab, "target_ms": args.target_ms, "requests": args.requests,
        "tokens": args.max_tokens, "reps": args.reps, "rates": args.rates,
        "configs": args.configs, "worker_cores": worker_cores, "spark_cores": spark_cores,
        "pin": not args.no_pin, "transfer_bytes": int(args.transfer_mb * 2**20),
        "mtu": MTU, "burst_s": BURST_S, "latency": LATENCY,
    }  # fmt: skip
    try:
        with Links(2 if any(c.startswith("sharded-") for c in args.configs) else 1,
                   ip=args.ip, tc=args.tc) as links:  # fmt: skip
            for port, link in [(SINGLE_PORT, 0), (GROUP_PORT, 0), (GROUP_PORT + 1, 1)]:
                if link < links.count:
                    links.route(port, link)
            for link in range(links.count):
                links.route(TRANSFER_PORT + link, link)
            setup["namespaces"] = [links.worker, links.spark]
            progress(f"namespaces {links.worker} {links.spark} ({links.count} links)")
            result = measure(
                links, rates=args.rates, configs=args.configs, setup=setup, reps=args.reps,
                transfer_bytes=setup["transfer_bytes"], warm_up=not args.smoke,
            )  # fmt: skip
    except Interrupted as exc:
        print("shaped.py: stopped by a signal; namespaces deleted", file=sys.stderr)
        return int(exc.code or 1)
    except RuntimeError as exc:
        print(f"shaped.py: {exc}; namespaces deleted", file=sys.stderr)
        return 1
    result["setup"] = setup
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
