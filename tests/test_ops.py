"""Operations: settings precedence, JSON logs, metrics endpoint, health check, examples."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from pp1wire import metrics
from pp1wire.client import BufferPool
from pp1wire.settings import JsonFormatter, SettingsError, parse

from .daemons import worker_process

ROOT = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=1)
    p.add_argument("--host", default="default-host")
    p.add_argument("--json", action="store_true")
    p.add_argument("--config", default=None)
    return p


def test_precedence_flags_env_file_defaults(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('port = 3\nhost = "file-host"\njson = true\n')
    args = parse(_parser(), ["--config", str(cfg)], environ={})
    assert (args.port, args.host, args.json) == (3, "file-host", True)
    args = parse(_parser(), ["--config", str(cfg)], environ={"PP1_PORT": "4"})
    assert (args.port, args.host) == (4, "file-host")
    args = parse(_parser(), ["--config", str(cfg), "--port", "5"], environ={"PP1_PORT": "4"})
    assert args.port == 5
    args = parse(_parser(), [], environ={})
    assert (args.port, args.host, args.json) == (1, "default-host", False)


@pytest.mark.parametrize(
    ("content", "env"),
    [
        ("port = [1]\n", {}),
        ("nope = 1\n", {}),
        ("port = \n", {}),
        ("", {"PP1_PORT": "x"}),
        ("", {"PP1_JSON": "maybe"}),
    ],
)
def test_bad_settings_are_specific_errors(tmp_path, content, env):
    cfg = tmp_path / "c.toml"
    cfg.write_text(content)
    with pytest.raises(SettingsError):
        parse(_parser(), ["--config", str(cfg)], environ=env)


def test_json_log_lines():
    record = logging.LogRecord("pp1wire.x", logging.INFO, "f", 1, "hello %s", ("there",), None)
    record.peer = "127.0.0.1:5"
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "hello there"
    assert line["level"] == "info"
    assert line["peer"] == "127.0.0.1:5"


def test_metrics_rendering():
    reg = metrics.Registry()
    c = reg.add(metrics.Counter("pp1_x_total", "X.", ["reason"]))
    h = reg.add(metrics.Histogram("pp1_rtt_seconds", "RTT.", [0.1, 1.0]))
    c.inc(reason='a"b')
    h.observe(0.05)
    h.observe(5.0)
    text = reg.render()
    assert "# TYPE pp1_x_total counter" in text
    assert 'pp1_x_total{reason="a\\"b"} 1' in text
    assert 'pp1_rtt_seconds_bucket{le="0.1"} 1' in text
    assert 'pp1_rtt_seconds_bucket{le="+Inf"} 2' in text
    assert "pp1_rtt_seconds_count 2" in text
    with pytest.raises(ValueError, match="only go up"):
        c.inc(-1, reason="a")
    with pytest.raises(ValueError, match="duplicate"):
        reg.add(metrics.Counter("pp1_x_total", "again"))


def test_buffer_pool_recycles_and_never_blocks():
    pool = BufferPool(64, 2)
    a, b = pool.acquire(10), pool.acquire(64)
    c = pool.acquire(10)  # pool empty: a fresh buffer, counted
    assert pool.misses == 1
    pool.release(a)
    pool.release(a)  # double release is harmless
    pool.release(c)  # not owned: ignored
    assert pool.free == 1
    assert pool.acquire(100).nbytes == 100
    assert pool.misses == 2
    del b


def test_worker_metrics_endpoint_and_health_check(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mport = s.getsockname()[1]
    with worker_process("--metrics-port", str(mport), vocab=16) as (address, _):
        done = subprocess.run(
            [sys.executable, "-m", "pp1wire.worker", "--check", address, "--vocab", "16"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("healthy")
        wrong = subprocess.run(
            [sys.executable, "-m", "pp1wire.worker", "--check", address, "--vocab", "17"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert wrong.returncode == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "pp1_worker_connections_total 2" in text
        assert 'pp1_worker_refusals_total{code="vocab_size_mismatch"} 1' in text
