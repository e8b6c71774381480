"""Nothing hangs `pp1-spark`: a mute worker, a stop at any moment, a slot the worker refused.

- A worker that completes the handshake and then answers nothing: every OPEN,
  CLOSE, COMMIT and RESET is owed an answer within the reply timeout, so the
  connection ends (``answer_timeout``) and the run goes on target-only; and a
  SIGTERM while it waits ends the run at once with every result written.
- A refused COMMIT leaves the slot out of sync: the request's slot is closed
  and opened again (``AsyncClient.reopen_slot``), and its later rounds, and the
  next requests on that slot, have proposals again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import time

import pytest

from pp1wire.aio.client import AsyncClient
from pp1wire.aio.server import WorkerServer
from pp1wire.apps import spark as spark_app
from pp1wire.apps.driver import LocalStrategy, Plan, RoundDriver, SparkMetrics
from pp1wire.apps.launch import spark_command
from pp1wire.apps.link import Link
from pp1wire.apps.models import drafter_factory, target_factory
from pp1wire.errors import ErrorCode
from pp1wire.wire import framing
from pp1wire.wire.messages import MsgType
from pp1wire.wire.spark_core import SparkConfig
from pp1wire.wire.transitions import State
from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol

from .groups import args_of
from .waiting import eventually

VOCAB = 16


class MuteWorker(asyncio.Protocol):
    """Completes the handshake as a worker does, then reads everything and answers nothing."""

    opens = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        config, drafter = WorkerConfig(vocab_size=VOCAB), drafter_factory(VOCAB, 3)
        self.core = WorkerProtocol(config, drafter, session=1, now=time.monotonic())
        self.decoder = framing.FrameDecoder(1 << 24)

    def data_received(self, data: bytes) -> None:
        if self.core.state is State.READY:
            MuteWorker.opens += sum(f.type is MsgType.OPEN for f in self.decoder.feed(data))
            return  # mute from here on
        self.core.receive_data(data, time.monotonic())
        for chunk in self.core.data_to_send():
            self.transport.write(chunk)


async def mute_worker() -> tuple[asyncio.AbstractServer, int]:
    MuteWorker.opens = 0
    server = await asyncio.get_running_loop().create_server(MuteWorker, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def run_spark(port: int, tmp_path, *extra: str) -> asyncio.subprocess.Process:
    cmd = spark_command(
        f"127.0.0.1:{port}", "--requests", "2", "--max-tokens", "4", "--json",
        "--output", str(tmp_path / "out.jsonl"), *extra, vocab=VOCAB,
    )  # fmt: skip
    return await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )


@pytest.mark.asyncio
async def test_sigterm_ends_a_run_waiting_on_a_mute_worker_at_once_with_results_written(
    tmp_path,
):
    server, port = await mute_worker()
    try:
        proc = await run_spark(port, tmp_path, "--reply-timeout", "30")
        # pp1-spark is then waiting for OPENED, which never comes.
        await eventually(lambda: MuteWorker.opens > 0, 30, "pp1-spark sent OPEN")
        asked = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # Bound for a loaded machine; on a quiet one this is about a tenth of a second.
        out, err = await asyncio.wait_for(proc.communicate(), 5.0)
        took = time.monotonic() - asked
    finally:
        server.close()
    assert proc.returncode == 0, err.decode()
    assert took < 2.0, took
    summary = json.loads(out.decode().splitlines()[-1])
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(records) == summary["requests"] == 2
    assert not any(r["finished"] for r in records)  # stopped, not finished
    print(f"SIGTERM to exit: {took:.3f} s", file=sys.stderr)


@pytest.mark.asyncio
async def test_a_mute_worker_ends_its_connection_and_the_run_finishes_target_only(tmp_path):
    server, port = await mute_worker()
    try:
        proc = await run_spark(port, tmp_path, "--reply-timeout", "0.3", "--connect-timeout", "3")
        out, err = await asyncio.wait_for(proc.communicate(), 60.0)
    finally:
        server.close()
    assert proc.returncode == 0, err.decode()
    summary = json.loads(out.decode().splitlines()[-1])
    assert summary["finished"] == 2
    assert summary["draft_tokens"] == 0
    assert summary["tokens"] >= 8
    assert summary["reconnects"] >= 1  # each new connection was tried and ended again
    assert set(summary["fallbacks_by_reason"]) <= {"connection_lost", "answer_timeout"}


@pytest.mark.asyncio
async def test_a_refused_commit_reopens_the_slot_and_its_requests_draft_again(monkeypatch):
    refused: list[int] = []
    commit = WorkerProtocol._on_commit

    def refuse_one(self, msg, slot, decision):
        if not refused and msg.round == 1:  # the second round of the first request
            refused.append(msg.round)
            self._refuse_msg(ErrorCode.COMMIT_INVALID, MsgType.COMMIT, msg)
            return
        commit(self, msg, slot, decision)

    monkeypatch.setattr(WorkerProtocol, "_on_commit", refuse_one)
    server = WorkerServer(WorkerConfig(vocab_size=VOCAB), drafter_factory(VOCAB, 3))
    port = await server.start("127.0.0.1", 0)
    try:
        args = args_of(
            "--worker", f"127.0.0.1:{port}", "--vocab", str(VOCAB), "--depth", "3",
            "--requests", "3", "--concurrency", "1", "--max-tokens", "24",
        )  # fmt: skip
        plan, _ = spark_app.check_settings(args)
        done = await spark_app.run_rank(args, plan, None)
    finally:
        await server.stop(grace=1.0)
    assert refused == [1]
    assert done.records is not None
    summary = done.summary
    assert summary is not None
    # One round lost to the refusal (the slot's next STEP finds it out of sync), then
    # the slot is closed and reopened: every later round of every request drafts again.
    assert summary["fallbacks"] == 1, summary["fallbacks_by_reason"]
    assert all(r["draft_tokens"] > 0 for r in (rec.as_json() for rec in done.records))
    assert all(rec.finished for rec in done.records)


@contextlib.contextmanager
def unanswered_listener():
    """A loopback listener whose accept queue is full: a new connection's SYN goes
    unanswered, so connecting to it waits for as long as the caller lets it."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(3):  # a queue of backlog 0 holds one; the rest wait in SYN_SENT
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            fillers.append(sock)
        time.sleep(0.05)
        yield port
    finally:
        for sock in fillers:
            sock.close()
        listener.close()


@pytest.mark.asyncio
async def test_a_connect_ends_within_its_timeout_when_the_tcp_connection_is_never_made():
    # Before: the timeout bounded the HELLO alone; the TCP connection waited for the
    # kernel's retries (minutes), and Link.connect's attempts with it.
    with unanswered_listener() as port:
        config = SparkConfig(vocab_size=VOCAB)
        started = time.monotonic()
        with pytest.raises(TimeoutError):  # an OSError, as a failed TCP connection is
            await asyncio.wait_for(
                AsyncClient.connect("127.0.0.1", port, config, timeout=0.3), timeout=5.0
            )
        assert time.monotonic() - started < 2.0
        link = Link("127.0.0.1", port, config, SparkMetrics(1))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no connection"):  # the last attempt's failure
            await asyncio.wait_for(link.connect(0.5), timeout=5.0)
        assert time.monotonic() - started < 2.0


@pytest.mark.asyncio
async def test_a_stop_abandons_a_reconnect_in_progress():
    # request_stop's promise: a connect in progress is abandoned. Before: the step's
    # reconnect (Link.live) ran to its own end, the stop waiting behind it.
    plan = Plan(
        requests=1, concurrency=1, max_tokens=4, depth=3, support=0, temperature=1.0,
        seed=0, eos=None, audit=False, vocab_size=VOCAB, prompts=[[1, 2]],
    )  # fmt: skip
    target = target_factory(VOCAB, 0)
    server = WorkerServer(WorkerConfig(vocab_size=VOCAB), drafter_factory(VOCAB, 3))
    worker_port = await server.start("127.0.0.1", 0)
    link = Link("127.0.0.1", worker_port, SparkConfig(vocab_size=VOCAB), SparkMetrics(1))
    try:
        await link.connect(2.0)
        lost = link.client
        assert lost is not None
        await lost.close()  # the connection is lost; the next step reconnects
    finally:
        await server.stop(grace=1.0)
    with unanswered_listener() as port:
        link.port = port  # the worker is back at an address that does not answer
        driver = RoundDriver(plan, LocalStrategy(target.batch), target, link, SparkMetrics(1))
        try:
            st = driver._new_request(0)
            preparing = asyncio.ensure_future(driver._prepare(st))
            await asyncio.sleep(0.2)
            assert not preparing.done()  # reconnecting
            started = time.monotonic()
            driver.request_stop()
            code = await asyncio.wait_for(preparing, timeout=5.0)
            assert time.monotonic() - started < 0.5
            assert code == ErrorCode.CANCELLED
            assert not link._lock.locked()  # the next step may try again
            # The lost connection's bytes were counted once, and are not counted again.
            assert link.client is None
            assert link.bytes_received == lost.core.decoder.bytes_received > 0
        finally:
            driver._thread.shutdown(wait=False)


class BusyWorker(asyncio.Protocol):
    """Refuses its first ``refusals`` handshakes with ``code`` (a fatal ERROR), as a
    full or stopping worker does, then completes the handshake as a worker does."""

    refusals = 0
    code = ErrorCode.CONNECTION_LIMIT

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        config, drafter = WorkerConfig(vocab_size=VOCAB), drafter_factory(VOCAB, 3)
        self.core = WorkerProtocol(config, drafter, session=1, now=time.monotonic())

    def data_received(self, data: bytes) -> None:
        if BusyWorker.refusals:
            BusyWorker.refusals -= 1
            self.core.close_with(BusyWorker.code)
        else:
            self.core.receive_data(data, time.monotonic())
        for chunk in self.core.data_to_send():
            self.transport.write(chunk)
        if self.core.closed:
            self.transport.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("code", [ErrorCode.CONNECTION_LIMIT, ErrorCode.SHUTTING_DOWN])
async def test_a_first_connect_retries_a_full_or_stopping_worker(code):
    # docs/runner.md §3: a later attempt may be admitted, so these refusals are retried
    # until --connect-timeout (any other refusal ends the run at once: test_e2e).
    BusyWorker.refusals, BusyWorker.code = 2, code
    server = await asyncio.get_running_loop().create_server(BusyWorker, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    link = Link("127.0.0.1", port, SparkConfig(vocab_size=VOCAB), SparkMetrics(1))
    try:
        await asyncio.wait_for(link.connect(5.0), timeout=10.0)
        assert BusyWorker.refusals == 0  # both refused, then admitted
        assert link.current() is not None  # connected, and up
    finally:
        await link.close()
        server.close()
        await server.wait_closed()
