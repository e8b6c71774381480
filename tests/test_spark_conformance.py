"""Spark-side conformance: ``pp1-conformance --spark`` against ``pp1-spark`` and broken ones.

The suite must pass against ``pp1-spark`` and fail against each deliberate
breakage in ``tests/broken_spark.py`` on the cases that breakage touches; a
suite that passed a broken Spark side would prove nothing.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pp1wire.testing.conformance.spark_cases import SPARK_CASES
from pp1wire.testing.conformance.spark_side import DEFAULT_SPARK_CMD

ROOT = Path(__file__).resolve().parent.parent
PY = shlex.quote(sys.executable)


def conformance(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pp1wire.testing.conformance", "--spark", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def failed_ids(out: str) -> set[str]:
    return {line.split()[1] for line in out.splitlines() if line.startswith("FAIL ")}


def test_list_shows_at_least_forty_numbered_cases():
    res = conformance("--list")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith(f"{len(SPARK_CASES)} cases")
    assert len(SPARK_CASES) >= 40
    assert len({c.id for c in SPARK_CASES}) == len(SPARK_CASES)


def test_pp1_spark_passes_every_case():
    cmd = DEFAULT_SPARK_CMD.replace("pp1-spark", f"{PY} -m pp1wire.apps.spark", 1)
    res = conformance("--spark-cmd", cmd)
    assert res.returncode == 0, res.stdout + res.stderr
    n = len(SPARK_CASES)
    assert f"{n} Spark-side cases: {n} passed, 0 failed" in res.stdout


def test_a_fixed_listen_address_is_used_and_a_taken_one_is_a_clear_error():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = DEFAULT_SPARK_CMD.replace("pp1-spark", f"{PY} -m pp1wire.apps.spark", 1)
        res = conformance("--spark-cmd", cmd, "--listen", f"127.0.0.1:{port}", "--case", "S1.1")
        assert res.returncode == 2
        assert f"cannot listen on 127.0.0.1:{port}" in res.stderr
    res = conformance("--spark-cmd", cmd, "--listen", f"127.0.0.1:{port}", "--case", "S1.1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 Spark-side cases: 1 passed" in res.stdout


# breakage, the cases to run, the cases that must fail among them
BROKEN = [
    ("no-row-checks", ["S1.1", "S1.4", "S1.23", "S2.4"], {"S1.1", "S1.4", "S1.23"}),
    ("no-reply-checksum", ["S1.13", "S1.14", "S1.9"], {"S1.13", "S1.14"}),
    ("early-completion", ["S1.12", "S1.1"], {"S1.12"}),
    ("any-hello", ["S4", "S3.5"], {f"S4.{i}" for i in range(1, 9)}),
    ("trust-worker-proof", ["S5"], {"S5.2", "S5.3"}),
]


@pytest.mark.parametrize(("breakage", "cases", "must_fail"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_spark_fails_the_cases_it_breaks(breakage, cases, must_fail):
    broken = f"{PY} {shlex.quote(str(ROOT / 'tests' / 'broken_spark.py'))} {breakage}"
    cmd = DEFAULT_SPARK_CMD.replace("pp1-spark", broken, 1)
    res = conformance("--spark-cmd", cmd, "--case", *cases)
    assert res.returncode == 1, res.stdout + res.stderr
    assert failed_ids(res.stdout) == must_fail, res.stdout
