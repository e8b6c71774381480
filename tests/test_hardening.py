"""Hardening: TLS, pre-shared keys, connection limits, slow and idle peers, the fuzz harness."""

from __future__ import annotations

import shutil
import socket
import ssl
import sys
import time
from pathlib import Path

import pytest

from pp1wire.aio.client import AsyncClient, ConnectionLostError
from pp1wire.apps.launch import worker_command, worker_process
from pp1wire.errors import ErrorCode
from pp1wire.wire import framing
from pp1wire.wire.messages import Error, Ping
from pp1wire.wire.spark_core import SparkConfig

from . import cli
from .certs import self_signed
from .waiting import eventually, wait_until

ROOT = Path(__file__).resolve().parent.parent


def _read_frames(sock: socket.socket, timeout: float) -> tuple[list, bool]:
    sock.settimeout(timeout)
    decoder = framing.FrameDecoder(1 << 20)
    frames, eof = [], False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            eof = True
            break
        frames += decoder.feed(data)
    return frames, eof


def _ping(sock: socket.socket, nonce: int) -> bool:
    """True if a PING on ``sock`` is answered with its PONG (PING is allowed before HELLO)."""
    sock.sendall(framing.encode_frame(Ping(nonce=nonce)))
    sock.settimeout(3.0)
    decoder = framing.FrameDecoder(1 << 20)
    while True:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return False
        if not data:
            return False
        for frame in decoder.feed(data):
            return getattr(frame.message, "nonce", None) == nonce


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_tls_end_to_end(tmp_path):
    cert, key = self_signed(tmp_path)
    with worker_process("--tls-cert", str(cert), "--tls-key", str(key), vocab=16) as running:
        addr = running.address
        done = cli.spark(
            addr, 16, "--requests", "4", "--max-tokens", "8", "--json", "--tls-ca", cert
        )
        assert done.returncode == 0, done.stderr
        assert '"fallbacks": 0' in done.stdout
        # A plaintext peer cannot talk to a TLS worker, and is told so at once
        # (not after 30 s of retries).
        started = time.monotonic()
        plain = cli.spark(addr, 16, "--requests", "1", "--connect-timeout", "30")
        assert plain.returncode == 1
        assert "TLS_REQUIRED" in plain.stderr
        assert time.monotonic() - started < 10
        health = cli.module(
            "pp1wire.apps.worker", "--check", addr, "--vocab", "16", "--tls-cert", cert
        )
        assert health.returncode == 0, health.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_tls_against_a_plain_worker_fails_at_once_not_after_the_connect_timeout(tmp_path):
    cert, _ = self_signed(tmp_path)
    with worker_process(vocab=16) as running:
        started = time.monotonic()
        done = cli.spark(
            running.address, 16, "--requests", "1", "--connect-timeout", "30", "--tls-ca", cert
        )
        elapsed = time.monotonic() - started
    assert done.returncode == 1
    assert "cannot reach the worker" in done.stderr
    # 30 s of retries would be the old behaviour; a process start is about 1 s here.
    assert elapsed < 10, elapsed


def test_psk_enforced_by_the_daemons(tmp_path):
    key = tmp_path / "k"
    key.write_text("correct horse battery staple\n")
    wrong = tmp_path / "w"
    wrong.write_text("incorrect horse battery staple\n")
    with worker_process("--psk-file", str(key), vocab=16) as running:
        addr = running.address
        ok = cli.spark(
            addr, 16, "--requests", "2", "--max-tokens", "4", "--json", "--psk-file", key
        )
        assert ok.returncode == 0, ok.stderr
        for extra in (["--psk-file", str(wrong)], []):
            bad = cli.spark(addr, 16, "--requests", "1", "--connect-timeout", "1", *extra)
            assert bad.returncode == 1
            assert "AUTH" in bad.stderr


def test_short_psk_is_refused(tmp_path):
    key = tmp_path / "k"
    key.write_text("short\n")
    done = cli.module("pp1wire.apps.worker", "--psk-file", key)
    assert done.returncode == 2
    assert "16 bytes" in done.stderr


@pytest.mark.asyncio
async def test_connection_limit_refuses_a_newcomer_when_every_peer_drew_lately():
    with worker_process("--max-connections", "2", vocab=16) as running:
        host, port = running.address.rsplit(":", 1)
        held = []
        for i in range(2):
            client = await AsyncClient.connect(host, int(port), SparkConfig(vocab_size=16))
            await client.open(0, seed=i, prefix=[1])
            # A fresh draw is the work that protects a connection (docs/protocol.md §2).
            (await client.propose(0, round_id=0, depth=1)).release()
            held.append(client)
        extra = socket.create_connection((host, int(port)))
        frames, eof = _read_frames(extra, 3.0)
        assert eof
        assert frames
        assert frames[0].message.code == ErrorCode.CONNECTION_LIMIT
        assert not any(c.closed for c in held)  # nobody with work was evicted
        extra.close()
        for c in held:
            await c.close()

        def served() -> bool:
            # Freed slots come back once the worker has seen the closes.
            with socket.create_connection((host, int(port))) as again:
                return _ping(again, 7)

        wait_until(served, what="a connection is served after the others closed")


def test_a_newcomer_evicts_the_oldest_peer_that_has_not_completed_the_handshake():
    with worker_process("--max-connections", "2", vocab=16) as running:
        host, port = running.address.rsplit(":", 1)
        held = [socket.create_connection((host, int(port))) for _ in range(2)]
        for s in held:  # a PONG proves the worker has taken the connection
            assert _ping(s, 1)
        extra = socket.create_connection((host, int(port)))
        assert _ping(extra, 2)
        frames, eof = _read_frames(held[0], 3.0)
        assert eof
        assert frames[-1].message.code == ErrorCode.CONNECTION_LIMIT
        assert _ping(held[1], 3)  # only the oldest went
        for s in [*held, extra]:
            s.close()


def test_slow_loris_is_dropped_at_the_handshake_timeout():
    with worker_process("--handshake-timeout", "0.5", vocab=16) as running:
        addr = running.address
        host, port = addr.rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        hello_start = b"PW\x04\x01"
        started = time.monotonic()
        for b in hello_start:  # one byte at a time, never finishing a frame
            s.sendall(bytes([b]))
            time.sleep(0.1)
        frames, eof = _read_frames(s, 3.0)
        assert eof
        assert isinstance(frames[0].message, Error)
        assert frames[0].message.code == ErrorCode.HANDSHAKE_TIMEOUT
        assert time.monotonic() - started < 3.0
        s.close()


@pytest.mark.asyncio
async def test_idle_connection_is_closed():
    with worker_process("--idle-timeout", "0.5", vocab=16) as running:
        addr = running.address
        host, port = addr.rsplit(":", 1)
        client = await AsyncClient.connect(host, int(port), SparkConfig(vocab_size=16))
        started = time.monotonic()
        await eventually(lambda: client.closed, what="the idle connection is closed")
        assert time.monotonic() - started >= 0.4
        assert client.failed is ErrorCode.IDLE_TIMEOUT
        with pytest.raises(ConnectionLostError):
            await client.open(0, seed=1, prefix=[1])


def test_fuzz_harness_smoke():
    done = cli.run(sys.executable, ROOT / "fuzz" / "run.py", "--seconds", "2")
    assert done.returncode == 0, done.stderr
    assert '"executions"' in done.stdout


LIMITED_FDS = (
    "import resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
    "from pp1wire.apps.worker import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
@pytest.mark.asyncio
async def test_silent_connections_cannot_exhaust_a_tls_workers_descriptors(tmp_path):
    cert, key = self_signed(tmp_path)
    timeout = 2.0
    args = worker_command(
        "--tls-cert", str(cert), "--tls-key", str(key), "--max-connections", "4",
        "--handshake-timeout", str(timeout), vocab=16,
    )[3:]  # fmt: skip
    with worker_process(command=[sys.executable, "-c", LIMITED_FDS, *args]) as running:
        host, port = running.address.rsplit(":", 1)
        started = time.monotonic()
        # 300 silent TCP connections against a worker allowed 64 descriptors.
        silent = [socket.create_connection((host, int(port))) for _ in range(300)]
        ctx = ssl.create_default_context(cafile=str(cert))
        client = await AsyncClient.connect(host, int(port), SparkConfig(vocab_size=16), ssl=ctx)
        await client.open(0, seed=1, prefix=[1])
        proposal = await client.propose(0, round_id=client.next_round(0), depth=2)
        client.release(proposal)
        await client.close()
        # Every silent connection is closed by the worker within the handshake
        # timeout (most at once, to make room); 3 s of slack for a loaded machine.
        deadline = started + timeout + 3.0
        open_ = 0
        for s in silent:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                open_ += bool(s.recv(1))
            except TimeoutError:
                open_ += 1
            except OSError:
                pass  # reset: closed
            s.close()
        assert open_ == 0
