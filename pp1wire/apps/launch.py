"""Start a ``pp1-worker`` process (or a sharded group) on loopback and wait until it serves,
for the demo, the benchmarks, the examples and the tests: the worker binds a free port and
reports the address it got, so nothing races for a port."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

LISTENING = "pp1-worker listening on "
METRICS = "pp1-worker metrics on "


class WorkerStartError(RuntimeError):
    """The worker process exited or printed something else before it listened."""


@dataclass
class RunningWorker:
    """A worker process that is listening."""

    address: str  # HOST:PORT of the protocol listener
    metrics: str | None  # HOST:PORT of /metrics, when started with --metrics-port
    process: subprocess.Popen[str]
    returncode: int | None = None  # set once the context has stopped the process

    @property
    def port(self) -> int:
        """The protocol port."""
        return int(self.address.rsplit(":", 1)[1])


def worker_command(*extra: str, vocab: int, seed: int = 0) -> list[str]:
    """The command line of a worker on any free loopback port, logging warnings."""
    cmd = [sys.executable, "-m", "pp1wire.apps.worker", "--host", "127.0.0.1", "--port", "0"]
    return [*cmd, "--vocab", str(vocab), "--seed", str(seed), "--log-level", "warning", *extra]


# The affinity is set before the interpreter starts, so every thread it starts inherits it.
_PIN = "import os, sys; os.sched_setaffinity(0, {%s}); os.execv(sys.argv[1], sys.argv[1:])"


def split_cores() -> tuple[list[int], list[int]] | None:
    """Two halves of this process's cores, a worker's and a Spark side's (pinned apart, as on
    two machines, neither steals the other's CPU); None with one core."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        return None
    half = len(mine) // 2
    return mine[:half], mine[half:]


def pinned(cmd: Sequence[str], on: Sequence[int] | None) -> list[str]:
    """``cmd`` run on the cores ``on`` (None: where it likes), every thread included (a core
    this machine lacks fails it with ``OSError`` on its stderr, before ``cmd`` starts)."""
    return list(cmd) if on is None else [sys.executable, "-c", _PIN % ", ".join(map(str, on)), *cmd]


def spark_command(address: str, *extra: str, vocab: int) -> list[str]:
    """The command line of ``pp1-spark`` against the worker at ``address``."""
    cmd = [sys.executable, "-m", "pp1wire.apps.spark", "--worker", address]
    return [*cmd, "--vocab", str(vocab), *extra]


@contextlib.contextmanager
def worker_process(
    *extra: str,
    vocab: int = 16,
    seed: int = 3,
    env: Mapping[str, str] | None = None,
    command: Sequence[str] | None = None,
) -> Iterator[RunningWorker]:
    """Run a worker (``command``, or :func:`worker_command` with ``extra``) until the block ends,
    then SIGTERM it (killed after 10 s), its exit code left in ``returncode``.

    Raises:
        WorkerStartError: if it exits or prints anything else before listening
            (its stderr is in the message).
    """
    cmd = list(command) if command is not None else worker_command(*extra, vocab=vocab, seed=seed)
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=None if env is None else dict(env),
        )
        running = None
        try:
            assert proc.stdout is not None
            metrics = None
            line = proc.stdout.readline()
            if line.startswith(METRICS):
                metrics = line[len(METRICS) :].strip()
                line = proc.stdout.readline()
            if not line.startswith(LISTENING):
                proc.kill()
                proc.wait()
                errors.seek(0)
                raise WorkerStartError(f"worker did not start: {line!r} {errors.read()}")
            running = RunningWorker(line[len(LISTENING) :].strip(), metrics, proc)
            yield running
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if running is not None:
                running.returncode = proc.returncode
            if proc.stdout is not None:
                proc.stdout.close()


#: Linux's range of ports the kernel hands out to sockets bound to port 0 (clients).
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: The lowest port chosen below that range.
_LOWEST = 10_000


def _below_ephemeral(count: int) -> range | None:
    """The bases P with P .. P + count - 1 below the kernel's ephemeral range (None: unknown)."""
    try:
        low = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    top = low - count
    return range(_LOWEST, top + 1) if top >= _LOWEST else None


def free_ports(count: int) -> int:
    """A port P with P .. P + count - 1 free on loopback (worker rank r listens on P + r),
    drawn below the kernel's ephemeral range where known: there no connection made
    meanwhile can take it as its source port before the worker binds it.

    Raises:
        RuntimeError: if no such run of ports is found.
    """
    bases = _below_ephemeral(count)
    for _ in range(200):
        if bases is not None:
            base = random.choice(bases)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = int(s.getsockname()[1])
        held: list[socket.socket] = []
        try:
            for r in range(count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", base + r))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return base
    raise RuntimeError(f"no {count} adjacent free ports")


def signal_ranks(port: int, sig: int) -> int:
    """Send ``sig`` (0: none) to every process started with ``--port port``; how many."""
    mark = f"--port\0{port}\0".encode()
    found = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if mark in (entry / "cmdline").read_bytes():
                found += 1
                if sig:
                    os.kill(int(entry.name), sig)
        except OSError:
            continue
    return found


@dataclass
class RunningGroup:
    """A sharded worker group that is listening: rank r at ``port + r``."""

    port: int
    metrics: list[str]  # each rank's /metrics HOST:PORT
    process: subprocess.Popen[str]

    @property
    def address(self) -> str:
        """Rank 0's HOST:PORT (the address ``pp1-spark --vocab-shards`` is given)."""
        return f"127.0.0.1:{self.port}"


@contextlib.contextmanager
def worker_group(
    *extra: str,
    vocab: int,
    seed: int = 0,
    ranks: int = 2,
    faults: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[RunningGroup]:
    """Run ``pp1-worker --tp ranks --vocab-shards ranks`` (metrics on) until the block ends
    (``faults``: under torchrun with :mod:`pp1wire.testing.shard_faults`); each rank is in a
    session of its own, so it is stopped by its command line (``--port``) too.

    Raises:
        WorkerStartError: if the group exits or does not listen within 60 s.
    """
    port = free_ports(ranks)
    flags = ["--tp", str(ranks), "--vocab-shards", str(ranks), "--port", str(port)]
    flags += ["--vocab", str(vocab), "--seed", str(seed), "--metrics-port", "0", *extra]
    if faults:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(ranks), "-m", "pp1wire.testing.shard_faults"]
        for fault in faults:
            cmd += ["--fault", fault]
        cmd += ["--", *flags]
    else:
        cmd = [sys.executable, "-m", "pp1wire.apps.worker", *flags]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        start_new_session=True,
    )
    lines: list[str] = []

    def pump(stream: Iterator[str]) -> None:
        for line in stream:
            lines.append(line)

    assert proc.stdout is not None
    assert proc.stderr is not None
    pumps = [
        threading.Thread(target=pump, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)
    ]
    for t in pumps:
        t.start()
    try:
        deadline = time.monotonic() + 60.0
        while True:
            metrics = ["" for _ in range(ranks)]
            for line in lines:
                if line.startswith(METRICS):
                    words = line.split()
                    rank = int(words[-1].rstrip(")")) if line.rstrip().endswith(")") else 0
                    metrics[rank] = words[3]
            if all(metrics) and sum(LISTENING in line for line in lines) == ranks:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise WorkerStartError(f"worker group did not start: {''.join(lines)[-3000:]}")
            time.sleep(0.05)
        yield RunningGroup(port, metrics, proc)
    finally:
        signal_ranks(port, signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        deadline = time.monotonic() + 15
        while signal_ranks(port, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        signal_ranks(port, signal.SIGKILL)
        for t in pumps:
            t.join(timeout=10)
        if not any(t.is_alive() for t in pumps):
            proc.stdout.close()
            proc.stderr.close()
