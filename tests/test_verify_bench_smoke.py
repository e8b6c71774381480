"""Smoke runs of benchmarks/verify_batch.py, benchmarks/gpu_verify_check.py and
benchmarks/gpu_worker_check.py.

Tiny sizes; the checks are on what each figure is made of, never on a
wall-clock value: the scripts exit non-zero when the step and the per-request
path (or the device and the host path) commit different tokens, every ratio
must follow from the times measured in the same repetitions, and CPU per token
from the CPU per step and the step's tokens.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from . import cli

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def run_json(script: str, *args: str) -> dict[str, Any]:
    done = cli.run(sys.executable, BENCH / script, *args, "--json", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_verify_batch_benchmark_smoke():
    result = run_json("verify_batch.py", "--smoke")
    assert set(result["cases"]) >= {"verified_f32", "verified_f64", "target_only_f32"}
    for name, case in result["cases"].items():
        ways = [k[: -len("_wall_ms")] for k in case if k.endswith("_wall_ms")]
        assert ways[0] == "per_request"
        assert len(ways) >= 2, name
        tokens = case["tokens_per_step"]
        assert tokens >= 8  # at least one token per round
        for way in ways:
            for key in ("wall_ms", "cpu_ms", "cpu_ms_per_token"):
                figure = case[f"{way}_{key}"]
                assert all(math.isfinite(v) and v >= 0 for v in figure.values()), (name, key)
                assert figure["min"] <= figure["median"] <= figure["max"]
            # CPU per token is CPU per step over this step's tokens, repetition by repetition.
            per_token, per_step = case[f"{way}_cpu_ms_per_token"], case[f"{way}_cpu_ms"]
            assert per_token["median"] == pytest.approx(per_step["median"] / tokens)
        base = case["per_request_wall_ms"]
        for way in ways[1:]:
            # Each repetition's ratio lies between these bounds; a ratio taken from
            # anywhere else (another run, a constant) would not, except by chance.
            ratio, mine = case[f"{way}_ratio_wall"], case[f"{way}_wall_ms"]
            lo, hi = mine["min"] / base["max"], mine["max"] / base["min"]
            assert lo * (1 - 1e-9) <= ratio["min"] <= ratio["max"] <= hi * (1 + 1e-9)
        if "acceptance" in case:
            assert 0.0 < case["acceptance"] < 1.0


def test_gpu_verify_check_smoke():
    pytest.importorskip("torch")
    result = run_json("gpu_verify_check.py", "--vocab", "300", "--reps", "1")
    assert result["cases"]
    assert all(case["agree"] for case in result["cases"].values())
    # The refusals case fails three rounds, each with its own code.
    assert result["cases"]["refusals_f32"]["errors"] == [
        "TARGET_NEGATIVE",
        "TARGET_NON_FINITE",
        "TARGET_ZERO_MASS",
    ]


def test_gpu_worker_check_smoke():
    """Without CUDA the device path runs on CPU tensors: bit-equal to the host path,
    and the CUDA timing is skipped (said in one line, no figure made up)."""
    pytest.importorskip("torch")
    import torch

    result = run_json("gpu_worker_check.py", "--vocab", "300", "--steps", "1")
    assert result["jobs_bit_equal"] == "16/16"
    if not torch.cuda.is_available():
        assert "host_cpu_ms_per_row" not in result
        assert "dense_rows_pinned" not in result
