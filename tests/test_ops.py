"""Operations: settings precedence, JSON logs, metrics endpoint, health check, examples."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import urllib.request
from pathlib import Path

import pytest

from pp1wire.aio.client import BufferPool
from pp1wire.apps import metrics
from pp1wire.apps.launch import worker_process
from pp1wire.apps.settings import JsonFormatter, SettingsError, parse

from . import cli

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


def test_metrics_readback_and_endpoint():
    from prometheus_client import CollectorRegistry, Counter

    reg = CollectorRegistry()
    c = Counter("pp1_x", "X.", ["reason"], registry=reg)
    plain = Counter("pp1_y", "Y.", registry=reg)
    c.labels(reason="a").inc()
    c.labels(reason="b").inc(2)
    plain.inc(3)
    assert metrics.by_label(c) == {"a": 1.0, "b": 2.0}
    assert metrics.total(c) == 3.0
    assert metrics.total(plain) == 3.0

    async def scrape() -> tuple[str, str]:
        server = await metrics.serve(reg, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        out = []
        for path in (b"/metrics", b"/other"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            out.append((await reader.read()).decode())
            writer.close()
        server.close()
        return out[0], out[1]

    page, missing = asyncio.run(scrape())
    assert page.startswith("HTTP/1.1 200 OK")
    assert 'pp1_x_total{reason="b"} 2.0' in page
    assert "pp1_y_total 3.0" in page
    assert missing.startswith("HTTP/1.1 404")


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
    with worker_process("--metrics-port", "0", vocab=16) as running:
        address = running.address
        done = cli.module("pp1wire.apps.worker", "--check", address, "--vocab", "16")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("healthy")
        # The limits these settings give, which a Spark HELLO may not exceed.
        assert "max_frame          67,108,864 bytes (fixed)" in done.stdout
        assert "row_entries        exactly 16" in done.stdout
        wrong = cli.module("pp1wire.apps.worker", "--check", address, "--vocab", "17")
        assert wrong.returncode == 1
        with urllib.request.urlopen(f"http://{running.metrics}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "pp1_worker_connections_total 2.0" in text
        assert 'pp1_worker_refusals_total{code="vocab_size_mismatch"} 1.0' in text


def test_worker_help_states_its_limits_and_the_document_prints_them():
    from pathlib import Path

    from pp1wire.apps import worker
    from pp1wire.wire.messages import WIRE_VERSION

    shown = cli.module("pp1wire.apps.worker", "--help")
    assert shown.returncode == 0
    assert f"PP1 wire v{WIRE_VERSION}" in shown.stdout
    assert "max_frame          67,108,864 bytes (fixed)" in shown.stdout
    assert "max_prefix         1,048,576 tokens (--max-prefix)" in shown.stdout
    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    block = doc.split("<!-- worker-limits -->\n", 1)[1].split("\n<!-- /worker-limits -->")[0]
    assert block == worker.default_limits_markdown(), (
        "paste pp1wire.apps.worker.default_limits_markdown() into docs/protocol.md section 8"
    )
