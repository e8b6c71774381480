"""What benchmarks/tp.py and benchmarks/sharded.py share: one pp1-spark run's summary,
and their command line. Not a benchmark itself."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from pp1wire.apps.launch import spark_command


def summary(address: str, vocab: int, *flags: str, what: str) -> dict[str, Any]:
    """One ``pp1-spark --json`` run against ``address``: its summary (exits on failure)."""
    cmd = spark_command(address, *flags, "--json", vocab=vocab)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        sys.exit(f"pp1-spark ({what}) failed:\n{done.stderr[-2000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
    out: dict[str, Any] = json.loads(line)
    return out


def parser(doc: str | None) -> argparse.ArgumentParser:
    """``--vocab``, ``--reps``, ``--support`` (repeatable) and ``--json``; every process
    the benchmark starts runs with one OpenMP thread (what a rank gets)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every worker and pp1-spark
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--support",
        action="append",
        choices=["dense", "sparse:32"],
        help="measure only this support (repeatable; default: dense and sparse:32)",
    )
    p.add_argument("--json", action="store_true")
    return p


def table(
    out: dict[str, Any], args: argparse.Namespace, supports: list[str]
) -> list[tuple[str, dict[str, Any]]]:
    """With ``--json``, print ``out`` as JSON and return no rows; else print the table's
    title and return each support's (name, figures) to print."""
    if args.json:
        print(json.dumps(out))
        return []
    print(f"vocab {args.vocab}, 4 slots x depth 5, {args.reps} runs each (median)")
    return [(key, out[key]) for key in (s.replace(":", "") for s in supports)]


def ratio(name: str, base: list[float], other: list[float]) -> dict[str, Any]:
    """``name``: the median of ``other`` over the median of ``base``, and ``name_min_max``:
    the range the runs allow (the fastest of one over the slowest of the other)."""
    return {
        name: statistics.median(other) / statistics.median(base),
        f"{name}_min_max": [min(other) / max(base), max(other) / min(base)],
    }
