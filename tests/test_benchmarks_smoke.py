"""Smoke runs of the benchmark scripts: a few iterations, checking they still work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from . import cli

ROOT = Path(__file__).resolve().parent.parent

KEYS = {
    "dense_vs_raw",
    "dense_vs_zmq",
    "sparse_vs_raw",
    "sparse_vs_grpc",
    "sparse_loop_floor_vs_raw",
    "sparse_vs_loop",
    "validate_vs_max",
    "construct_vs_softmax",
    "overhead_dense",
    "overhead_sparse32",
    "rss_growth",
    "ping_during_draft_ms",
    "fresh_dense_vs_ideal",
    "e2e_vs_ideal",
    "e2e_vs_ideal_sparse32",
    "speedup_over_target_only",
}


def test_run_py_smoke():
    pytest.importorskip("zmq")
    pytest.importorskip("grpc")
    done = cli.run(sys.executable, ROOT / "benchmarks" / "run.py", "--smoke", "--json", timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) >= KEYS
    assert all(result[k] > 0 for k in KEYS)


def test_sizes_report_meets_the_size_goals():
    done = cli.run(sys.executable, ROOT / "benchmarks" / "sizes.py", "--json")
    assert done.returncode == 0, done.stderr
    table = json.loads(done.stdout)
    assert table["dense"]["overhead"] <= 0.001
    assert table["sparse32"]["encoded"] <= 1600


def test_integrity_cost_smoke():
    done = cli.run(
        sys.executable,
        ROOT / "benchmarks" / "integrity_cost.py",
        "--rounds",
        "1",
        "--reps",
        "1",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [
        f"{kind}_{what}"
        for kind in ("dense", "sparse")
        for what in ("ms_plain", "ms_keyed", "keyed_over_plain")
    ]


def test_speedup_smoke():
    done = cli.run(
        sys.executable,
        ROOT / "benchmarks" / "speedup.py",
        "--requests",
        "2",
        "--max-tokens",
        "4",
        "--json",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for key in ("dense", "sparse32"):
        assert result[f"e2e_vs_ideal_{key}"] > 0
        assert result[f"speedup_{key}"] > 0
    assert 0 < result["target_only_vs_ideal"] <= 1.05  # cannot beat its own fixed cost


def test_tp_benchmark_smoke():
    pytest.importorskip("torch")
    done = cli.run(
        sys.executable,
        ROOT / "benchmarks" / "tp.py",
        "--vocab", "128", "--reps", "1", "--requests", "4", "--json",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    for key in ("dense", "sparse32"):
        assert result[key]["tp2_vs_tp1"] > 0
        assert result[key]["fanout_bytes_per_batch_round"] > 0
    # Dense rows carry every vocabulary entry: 4 bytes each, plus 8 per row.
    assert (
        result["dense"]["fanout_bytes_per_batch_round"]
        > result["sparse32"]["fanout_bytes_per_batch_round"]
    )


def test_sharded_benchmark_smoke():
    pytest.importorskip("torch")
    done = cli.run(
        sys.executable,
        ROOT / "benchmarks" / "sharded.py",
        "--vocab", "128", "--reps", "1", "--json",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    for key in ("dense", "sparse32"):
        r = result[key]
        assert r["sharded_vs_unsharded"] > 0
        assert r["fallbacks"] == 0
        assert len(r["sharded_link_bytes_per_batch_round"]) == 2
    # Each dense link carries half the vocabulary's q: well under the one link's bytes.
    dense = result["dense"]
    assert (
        max(dense["sharded_link_bytes_per_batch_round"])
        < dense["unsharded_link_bytes_per_batch_round"]
    )
