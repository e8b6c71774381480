"""Spark-side conformance: ``pp1-conformance --spark`` against ``pp1-spark`` and broken ones.

The suite must pass against ``pp1-spark`` — with one request or two on the
slot, at depth 3 or 2 — and fail against each deliberate breakage in
``tests/broken_spark.py`` on the cases that breakage touches; a suite that
passed a broken Spark side would prove nothing.

Every case starts its Spark command afresh. Here that command is a client of
``tests/forkserver.py``, which forks a ``pp1-spark`` that has already
imported its modules (the same code and arguments as a fresh process), and up
to four cases run at once (``--jobs``; the timing cases alone): the suite's
checks are the same, the imports are paid once.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pp1wire.testing.conformance.spark_cases import SPARK_CASES
from pp1wire.testing.conformance.spark_side import (
    DEFAULT_SPARK_CMD,
    TEMPLATE_CONTRACT,
    Expect,
    Timing,
)

ROOT = Path(__file__).resolve().parent.parent
PY = shlex.quote(sys.executable)
# The reply timeout every command here gets ({reply_timeout}); the timing cases pace against it.
REPLY_TIMEOUT = "1"


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


@pytest.fixture(scope="module")
def spark(forkserver: str) -> str:
    """The command that starts a forked ``pp1-spark`` (``--broken NAME`` may follow it)."""
    return forkserver


def template(command: str, **flags: str) -> str:
    """``DEFAULT_SPARK_CMD`` started by ``command``, with some flags changed."""
    cmd = DEFAULT_SPARK_CMD.replace("pp1-spark", f"{command} --", 1)
    for flag, value in flags.items():
        name = "--" + flag.replace("_", "-")
        words = cmd.split()
        words[words.index(name) + 1] = value
        cmd = " ".join(words)
    return cmd


def test_list_shows_at_least_forty_numbered_cases():
    res = conformance("--list")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith(f"{len(SPARK_CASES)} cases")
    assert len(SPARK_CASES) >= 40
    assert len({c.id for c in SPARK_CASES}) == len(SPARK_CASES)


def test_the_timing_cases_claim_their_gaps():
    timed = {c.id: c.timing for c in SPARK_CASES if c.timing is not None}
    assert timed == {"S3.4": Timing.PAST, "S3.6": Timing.WITHIN, "S3.11": Timing.PAST}
    by_id = {c.id: c for c in SPARK_CASES}
    # Rows missing at the reply timeout end the block; the rows in by then are used.
    assert by_id["S3.4"].expect is Expect.CUT
    assert by_id["S3.11"].expect is Expect.CUT
    assert by_id["S3.6"].expect is Expect.USE


@pytest.mark.parametrize(
    ("requests", "depth", "cases"),
    [("1", "3", []), ("2", "3", []), ("1", "2", ["S1", "S2.4"])],
    ids=["one-request", "two-requests-one-slot", "depth-2"],
)
def test_pp1_spark_passes_every_case(spark, requests, depth, cases):
    # Two requests on slot 0 run under generations 0 and 1: a round number of the
    # second is no proof about the first. At depth 2 every reply the cases build
    # (S1, and the duplicated COMPLETION of S2.4) has 2 rows.
    cmd = template(spark, requests=requests, depth=depth)
    selected = ["--case", *cases] if cases else []
    res = conformance(
        "--spark-cmd", cmd, "--jobs", "4", "--reply-timeout", REPLY_TIMEOUT, *selected
    )
    assert res.returncode == 0, res.stdout + res.stderr
    n = len([c for c in SPARK_CASES if not cases or any(c.id.startswith(x) for x in cases)])
    assert f"{n} Spark-side cases: {n} passed, 0 failed" in res.stdout


def test_a_fixed_listen_address_is_used_and_a_taken_one_is_a_clear_error(spark):
    import socket

    cmd = template(spark)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = conformance("--spark-cmd", cmd, "--listen", f"127.0.0.1:{port}", "--case", "S1.1")
        assert res.returncode == 2
        assert f"cannot listen on 127.0.0.1:{port}" in res.stderr
    res = conformance("--spark-cmd", cmd, "--listen", f"127.0.0.1:{port}", "--case", "S1.1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 Spark-side cases: 1 passed" in res.stdout
    res = conformance("--spark-cmd", cmd, "--listen", f"127.0.0.1:{port}", "--jobs", "2")
    assert res.returncode == 2
    assert "--jobs" in res.stderr


def test_a_missing_command_is_one_line_not_every_case_failing(tmp_path):
    missing = tmp_path / "no-such-spark"
    res = conformance("--spark-cmd", f"{missing} --worker {{worker}}")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "exited with status 127 without connecting" in lines[0]
    assert str(missing) in lines[0]
    assert "FAIL" not in res.stdout


def test_a_command_that_fails_at_once_is_named(spark):
    res = conformance("--spark-cmd", template(spark, depth="9"))
    assert res.returncode == 2
    assert "exited with status 2 without connecting" in res.stderr
    assert "--depth must be in 0..5" in res.stderr


def test_an_unknown_placeholder_is_a_clear_error(spark):
    res = conformance("--spark-cmd", template(spark) + " {nonsense}")
    assert res.returncode == 2
    assert "unknown placeholder 'nonsense'" in res.stderr


def test_the_template_contract_is_in_help_and_the_operators_guide():
    res = subprocess.run(
        [sys.executable, "-m", "pp1wire.testing.conformance", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    readme = (ROOT / "docs" / "operators.md").read_text()
    assert TEMPLATE_CONTRACT in readme, "docs/operators.md's copy of the template contract is stale"
    placeholders = ("{worker}", "{vocab}", "{support}", "{q}", "{reply_timeout}", "{psk_args}")
    for placeholder in (*placeholders, "{stop_args}"):
        assert placeholder in res.stdout
        assert placeholder in readme
    for duty in ("fixed depth from 2 to 5", "must exit 0", "fallbacks_by_reason"):
        assert duty in " ".join(res.stdout.split())
        assert duty in " ".join(readme.split())


# breakage, the cases to run, the cases that must fail among them
BROKEN = [
    ("no-row-checks", ["S1.1", "S1.4", "S1.23", "S2.4"], {"S1.1", "S1.4", "S1.23"}),
    ("no-reply-checksum", ["S1.13", "S1.14", "S1.9"], {"S1.13", "S1.14"}),
    ("early-completion", ["S1.12", "S1.1"], {"S1.12"}),
    # S4.9 is a frame before HELLO, refused by the transition table, not the HELLO rules.
    ("any-hello", ["S4", "S3.5"], {f"S4.{i}" for i in (*range(1, 9), 10)}),
    ("trust-worker-proof", ["S5"], {"S5.2", "S5.3"}),
    # The COMPLETION's stopped flag is still checked against the rows (S6.5, S6.7).
    ("no-stop-audit", ["S6"], {"S6.2", "S6.3", "S6.4", "S6.9"}),
    # The old rule: the valid rows before a fault are thrown away with the rest.
    ("discard-on-fault", ["S1.1", "S1.26", "S1.28", "S3.8"], {"S1.26", "S1.28", "S3.8"}),
]


@pytest.mark.parametrize(("breakage", "cases", "must_fail"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_spark_fails_the_cases_it_breaks(spark, breakage, cases, must_fail):
    cmd = template(f"{spark} --broken {breakage}")
    res = conformance("--spark-cmd", cmd, "--case", *cases, "--jobs", "4")
    assert res.returncode == 1, res.stdout + res.stderr
    assert failed_ids(res.stdout) == must_fail, res.stdout
