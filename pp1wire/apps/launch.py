"""Start a ``pp1-worker`` process on loopback and wait until it serves.

One helper for everything that needs a real worker process: the demo, the
benchmarks, the examples and the tests. The worker binds port 0 (any free
port) and reports the address it got on stdout, so nothing races another
process for a port.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

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


def worker_command(*extra: str, vocab: int, seed: int = 0, log_level: str = "warning") -> list[str]:
    """The command line of a worker on any free loopback port."""
    return [
        sys.executable,
        "-m",
        "pp1wire.apps.worker",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--vocab",
        str(vocab),
        "--seed",
        str(seed),
        "--log-level",
        log_level,
        *extra,
    ]


def spark_command(address: str, *extra: str, vocab: int) -> list[str]:
    """The command line of ``pp1-spark`` against the worker at ``address``."""
    return [
        sys.executable,
        "-m",
        "pp1wire.apps.spark",
        "--worker",
        address,
        "--vocab",
        str(vocab),
        *extra,
    ]


@contextlib.contextmanager
def worker_process(
    *extra: str,
    vocab: int = 16,
    seed: int = 3,
    log_level: str = "warning",
    env: Mapping[str, str] | None = None,
    command: Sequence[str] | None = None,
    stop_timeout: float = 10.0,
) -> Iterator[RunningWorker]:
    """Run a worker (``command``, or :func:`worker_command` with ``extra``) until the block ends.

    The process is stopped with SIGTERM (then killed after ``stop_timeout`` s);
    its exit code is left in :attr:`RunningWorker.returncode`.

    Raises:
        WorkerStartError: if it exits or prints anything else before listening
            (its stderr is in the message).
    """
    cmd = (
        list(command)
        if command is not None
        else worker_command(*extra, vocab=vocab, seed=seed, log_level=log_level)
    )
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
                    proc.wait(timeout=stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if running is not None:
                running.returncode = proc.returncode
            if proc.stdout is not None:
                proc.stdout.close()
