"""Smoke run of benchmarks/draft_batch.py: one short repetition per case, every figure there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import cli

ROOT = Path(__file__).resolve().parent.parent


def test_draft_batch_benchmark_smoke():
    done = cli.run(
        sys.executable, ROOT / "benchmarks" / "draft_batch.py", "--quick", "--json", timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == {"dense@129280", "dense@32000", "sparse:32@129280"}
    for figures in result.values():
        for key in ("seq_all_cpu", "batch_all_cpu", "batch_encode_cpu", "ratio_all_cpu"):
            assert figures[key] > 0
