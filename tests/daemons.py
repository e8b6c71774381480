"""Start real daemons (subprocesses) on loopback for end-to-end tests."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def worker_process(
    *extra: str, vocab: int = 16, seed: int = 3
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A running ``pp1-worker`` on a free loopback port: yields (HOST:PORT, process)."""
    cmd = [
        sys.executable,
        "-m",
        "pp1wire.worker",
        "--port",
        "0",
        "--vocab",
        str(vocab),
        "--seed",
        str(seed),
        "--log-level",
        "warning",
        *extra,
    ]
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("pp1-worker listening on "):
                proc.wait(timeout=10)
                errors.seek(0)
                raise AssertionError(f"worker did not start: {line!r} {errors.read()}")
            yield line.rsplit(" ", 1)[1].strip(), proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
