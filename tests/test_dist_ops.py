"""The sharded kernels across real gloo ranks equal single-process results at V = 129,280."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from . import cli

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent / "ranks" / "sharded_kernels.py"


@pytest.mark.parametrize("ranks", [2, 3])
def test_gloo_ranks_equal_single_process(ranks):
    done = cli.run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        SCRIPT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
