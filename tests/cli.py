"""Running this package's command lines (and other programs) from tests, and reading the
process table (``/proc``) for what they started."""

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


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/pid/stat`` after the command name (state first, then the
    parent's pid). Raises OSError if the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int(_stat_fields(int(entry.name))[1])
            except OSError:
                continue  # it ended while we looked
            if parent == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has finished: its status waits for its parent)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False
