"""Starting the installed daemons from an example (imported by the examples beside it).

Not an example of its own: ``plugins.py`` and ``scrape_metrics.py`` both start a
``pp1-worker`` on a free loopback port and run ``pp1-spark`` against it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def command(name: str) -> str:
    """The installed console script ``name``: next to this Python (a virtual
    environment's ``bin``), else on ``PATH``."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else name


@contextlib.contextmanager
def running_worker(*flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``pp1-worker`` on a free loopback port until the block ends; yields its HOST:PORT.

    Raises:
        RuntimeError: if the worker exits or prints anything else before it listens.
    """
    worker = subprocess.Popen(
        [command("pp1-worker"), "--host", "127.0.0.1", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()  # "pp1-worker listening on HOST:PORT"
        if "listening on" not in line:
            raise RuntimeError(f"pp1-worker did not start: {line!r}")
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        worker.terminate()
        worker.wait()
