"""Running this package's command lines (and other programs) from tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from pp1wire.apps.launch import spark_command


def run(
    *cmd: str | Path,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion, capturing its text output (never raises on exit code)."""
    return subprocess.run(
        [str(c) for c in cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=None if env is None else dict(env),
        cwd=cwd,
    )


def module(name: str, *args: str | Path, **kw: object) -> subprocess.CompletedProcess[str]:
    """``python -m name args...`` with this interpreter."""
    return run(sys.executable, "-m", name, *args, **kw)  # type: ignore[arg-type]


def spark_args(address: str, vocab: int, *args: str | Path) -> list[str]:
    """The command line of ``pp1-spark`` against ``address``."""
    return spark_command(address, *map(str, args), vocab=vocab)


def spark(
    address: str, vocab: int, *args: str | Path, **kw: object
) -> subprocess.CompletedProcess[str]:
    """Run ``pp1-spark`` against ``address`` to completion."""
    return run(*spark_args(address, vocab, *args), **kw)  # type: ignore[arg-type]
