"""Shared fixtures."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pp1wire.q import dyadic

# The test modules' bytecode (pytest's assertion-rewritten copies) is cached even
# where PYTHONDONTWRITEBYTECODE is set: otherwise each test process rewrites and
# compiles every test module again at collection, 3 to 4 s of CPU per process. A
# tree that cannot be written is no error (pytest then rewrites as before).
sys.dont_write_bytecode = False


@pytest.fixture(params=["compiled", "numpy"])
def dyadic_path(request, monkeypatch):
    """Run a test with the compiled fast path (when built) and with plain numpy."""
    if request.param == "numpy":
        monkeypatch.setattr(dyadic, "_fastq", None)
    elif dyadic._fastq is None:
        pytest.skip("compiled fast path not built")
    return request.param


@pytest.fixture(scope="session")
def forkserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The command that starts a forked ``pp1-spark`` (``tests/forkserver.py``); ``--pp1-worker``
    after it makes it ``pp1-worker``, ``--broken NAME`` a broken Spark side."""
    server_py = Path(__file__).resolve().parent / "forkserver.py"
    sock = tmp_path_factory.mktemp("fork") / "server.sock"
    server = subprocess.Popen(
        [sys.executable, str(server_py), str(sock)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=server_py.parent.parent,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready"
        quoted = " ".join(map(shlex.quote, (str(server_py), "--client", str(sock))))
        yield f"{shlex.quote(sys.executable)} -S {quoted}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        if server.stdout is not None:
            server.stdout.close()
