"""Command lines that must refuse, up front, in one line: exit 2, no traceback, nothing run.

Each case is a flag, an environment value, a TOML value or a file that used to
trace back, be silently changed (70000 → 4464, 2.7 → 2) or run with every
round falling back. The check runs before any connection: every case points
``pp1-spark`` at a closed port and ``pp1-worker`` at no listener at all, so a
refusal that came later would show as a connection error instead.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys

import pytest

from pp1wire.apps.spark import refused_by_configuration
from pp1wire.errors import ErrorCode
from pp1wire.testing.conformance.spark_side import Expect, HostileWorker, SparkCase
from pp1wire.wire.messages import Error, MsgType, Scope

from . import cli

CLOSED = "127.0.0.1:1"


def _files(tmp_path):
    (tmp_path / "latin1.toml").write_bytes(b"\xff\xfe = 1\n")
    (tmp_path / "float.toml").write_text("max_slots = 2.7\n")
    (tmp_path / "latin1.jsonl").write_bytes(b"[1, 2, \xff]\n")
    (tmp_path / "huge.jsonl").write_text("[" + "9" * 5000 + "]\n")
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (tmp_path / "long.jsonl").write_text("[1, 2, 3, 4, 5, 6]\n")
    (tmp_path / "garbage.pem").write_text("not a certificate\n")
    (tmp_path / "empty_prompt.jsonl").write_text("[1, 2]\n[]\n")


# program, arguments (``{tmp}`` is the test's directory), what the one line must say
CASES = [
    ("pp1-worker", ["--port", "70000"], "--port: 70000 is not a port"),
    ("pp1-worker", ["--metrics-port", "-1"], "--metrics-port: -1 is not a port"),
    ("pp1-worker", ["--max-connections", "0"], "--max-connections: 0 is not a number of conn"),
    ("pp1-worker", ["--handshake-timeout", "-1"], "--handshake-timeout: -1.0 is not a duration"),
    ("pp1-worker", ["--idle-timeout", "nan"], "--idle-timeout: 'nan' is not a finite number"),
    ("pp1-worker", ["--config", "{tmp}/latin1.toml"], "latin1.toml: 'utf-8' codec"),
    ("pp1-worker", ["--config", "{tmp}/float.toml"], "max_slots: 2.7 is not an integer"),
    ("pp1-worker", ["--tls-cert", "{tmp}/missing.pem"], "--tls-cert/--tls-key"),
    ("pp1-worker", ["--tls-cert", "{tmp}/garbage.pem"], "--tls-cert/--tls-key"),
    ("pp1-spark", ["--prompts", "{tmp}/latin1.jsonl"], "latin1.jsonl: 'utf-8' codec"),
    ("pp1-spark", ["--prompts", "{tmp}/huge.jsonl"], "huge.jsonl:1: Exceeds the limit"),
    ("pp1-spark", ["--prompts", "{tmp}/deep.jsonl"], "deep.jsonl:1: maximum recursion"),
    ("pp1-spark", ["--prompts", "{tmp}/long.jsonl", "--max-prefix", "4"], "longer than"),
    # Before: an empty prompt reached the connect step (and every OPEN was refused).
    ("pp1-spark", ["--prompts", "{tmp}/empty_prompt.jsonl"], "empty_prompt.jsonl:2: an empty"),
    # Before: rank 1 tried port 65536.
    (
        "pp1-spark",
        ["--worker", "127.0.0.1:65535", "--tp", "2", "--vocab-shards", "2"],
        "--worker 127.0.0.1:65535 with --vocab-shards 2: rank 1 would connect to port 65536",
    ),
    # Before: protected mode did not cover the metrics endpoint.
    (
        "pp1-spark",
        ["--metrics-host", "0.0.0.0", "--metrics-port", "0"],
        "--metrics-host 0.0.0.0 without --metrics-token-file",
    ),
    ("pp1-spark", ["--metrics-host", "[::1"], "'[::1' is not a listen address"),
    # Before: accepted, and the followers' collectives gave up while rank 0 waited.
    ("pp1-spark", ["--tp", "2", "--reply-timeout", "30"], "--reply-timeout 30 is not below"),
    ("pp1-spark", ["--max-prefix", "0"], "--max-prefix: 0 is not an integer >= 1"),
    ("pp1-spark", ["--eos", "999999999"], "--eos 999999999 is not a token ID"),
    ("pp1-spark", ["--temperature", "nan"], "--temperature: 'nan' is not a finite number"),
    ("pp1-spark", ["--temperature", "-1"], "--temperature: -1.0 is not a temperature (finite"),
    ("pp1-spark", ["--tls-ca", "{tmp}/missing.pem"], "--tls-ca"),
    ("pp1-spark", ["--tls-ca", "{tmp}/garbage.pem"], "--tls-ca"),
    ("pp1-spark", ["--output", "{tmp}/no/such/dir/out.jsonl"], "--output"),
    # Before: checked on rank 0 after the group had started (the others timed out).
    (
        "pp1-spark",
        ["--tp", "2", "--vocab-shards", "2", "--output", "{tmp}/no/such/dir/out.jsonl"],
        "--output",
    ),
    ("pp1-spark", ["--output", "{tmp}"], "--output"),
    ("pp1-spark", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("pp1-spark", ["--support", "bogus"], "--support 'bogus': use dense or sparse:K"),
    # Before: a digit that is not ASCII passed the check and int() traced back.
    (
        "pp1-spark",
        ["--support", "sparse:\u00b2"],
        "--support 'sparse:\u00b2': use dense or sparse:K",
    ),
    # Before: parsed by the sharded runner after the group had started (a traceback).
    (
        "pp1-spark",
        ["--tp", "2", "--vocab-shards", "2", "--support", "sparse:x"],
        "--support 'sparse:x': use dense or sparse:K",
    ),
    # Before: the factory's own failure (abs() takes no keywords) was a traceback.
    ("pp1-spark", ["--target", "builtins:abs", "--depth", "0"], "plugin 'builtins:abs': the"),
    # Before: 100000 ranks were started (76 processes, 4.7 GB within 20 s).
    ("pp1-spark", ["--tp", "100000"], "--tp: 100000 is not a number of ranks in 1..16"),
    ("pp1-spark", ["--concurrency", "70000"], "--concurrency must be in 1..65535"),
    ("pp1-spark", ["--vocab-shards", "2"], "--vocab-shards 2 needs --tp 2"),
    ("pp1-spark", ["--stop", "soon"], "--stop: unknown stop rule 'soon'"),
    ("pp1-spark", ["--stop", "joint:1.5"], "--stop: threshold '1.5' outside [0, 1]"),
    ("pp1-spark", ["--depth", "0", "--stop", "confidence:0.5"], "needs proposals: --depth above"),
    ("pp1-spark", ["--depth", "soon"], "--depth: 'soon' is not a depth (0..5) or auto"),
    # The sharded path refuses what no rank can do alone, in one line naming the mode.
    (
        "pp1-spark",
        ["--tp", "2", "--vocab-shards", "2", "--audit"],
        "--audit is not available with --vocab-shards",
    ),
]


@pytest.mark.parametrize(("prog", "args", "says"), CASES, ids=[" ".join(c[1]) for c in CASES])
def test_a_bad_command_line_is_one_line_and_exit_2(tmp_path, forkserver, prog, args, says):
    # Each command runs as a process forked from one that imported the programs
    # (tests/forkserver.py): the code, arguments and exit are a fresh process's.
    _files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if prog == "pp1-spark":
        argv = ["--worker", CLOSED, "--connect-timeout", "0.2", *argv]
    else:
        argv = ["--pp1-worker", "--", *argv]
    done = cli.run(*shlex.split(forkserver), *argv, timeout=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert lines[0].startswith(f"{prog}: "), lines[0]
    assert says in lines[0], lines[0]
    assert done.stdout == ""


def test_an_environment_value_is_range_checked_too(tmp_path):
    done = cli.module(
        "pp1wire.apps.worker", timeout=30, env={"PP1_PORT": "65536", "PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 2
    assert "PP1_PORT: 65536 is not a port" in done.stderr


def test_a_run_refused_by_the_worker_for_its_settings_exits_non_zero(capsys):
    every_round_refused = {"draft_tokens": 0, "fallbacks_by_reason": {"bad_temperature": 3.0}}
    assert refused_by_configuration(every_round_refused, depth=3) == 1
    assert "the worker refused: bad_temperature" in capsys.readouterr().err
    lost = {"draft_tokens": 0, "fallbacks_by_reason": {"connection_lost": 3.0}}
    assert refused_by_configuration(lost, depth=3) == 0  # transient: the run itself worked
    some_used = {"draft_tokens": 4, "fallbacks_by_reason": {"bad_temperature": 1.0}}
    assert refused_by_configuration(some_used, depth=3) == 0
    assert refused_by_configuration(every_round_refused, depth=0) == 0


@pytest.mark.asyncio
async def test_an_open_refusal_is_reported_under_its_code_and_the_run_fails():
    # A worker that answers every OPEN with TOKEN_OUT_OF_RANGE: each round falls
    # back under that code (not "connection_lost") and the run exits 1.
    def refuse(opened):
        return Error(
            code=int(ErrorCode.TOKEN_OUT_OF_RANGE),
            answers=int(MsgType.OPEN),
            scope=int(Scope.MESSAGE),
            slot=opened.slot,
            generation=opened.generation,
        )

    case = SparkCase("x", "", "", Expect.USE, None, edits={MsgType.OPENED: refuse})
    worker = HostileWorker(case)
    port = await worker.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pp1wire.apps.spark",
            *("--worker", f"127.0.0.1:{port}", "--vocab", "8", "--requests", "1"),
            *("--concurrency", "1", "--max-tokens", "3", "--json"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await worker.stop()
    summary = json.loads(out.decode().splitlines()[-1])
    assert summary["fallbacks_by_reason"].get("token_out_of_range", 0) >= 1, summary
    assert "connection_lost" not in summary["fallbacks_by_reason"], summary
    assert proc.returncode == 1
    assert "the worker refused: token_out_of_range" in err.decode()


def test_a_bad_flag_leaves_an_existing_output_byte_for_byte(tmp_path):
    # Before: --output was opened for writing (truncated) before --support was parsed.
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"request": 0, "tokens": [1, 2]}\n')
    before = out.read_bytes()
    done = cli.module(
        "pp1wire.apps.spark", "--worker", CLOSED, "--output", str(out), "--support", "bogus"
    )
    assert done.returncode == 2, done.stderr
    assert out.read_bytes() == before
    # A run that cannot reach its worker leaves it too: results replace it only at the end.
    done = cli.module(
        "pp1wire.apps.spark", "--worker", CLOSED, "--connect-timeout", "0.2", "--output", str(out)
    )
    assert done.returncode == 1, done.stderr
    assert out.read_bytes() == before


def test_a_refused_run_creates_no_output(tmp_path):
    # --output is checked with the other settings, before the target is made: the
    # check itself must not leave an empty file behind.
    out = tmp_path / "out.jsonl"
    done = cli.module(
        "pp1wire.apps.spark", "--depth", "0", "--target", "builtins:abs", "--output", str(out)
    )
    assert done.returncode == 2, done.stderr
    assert not out.exists()
