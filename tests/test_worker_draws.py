"""The worker's draw pool under hostile and failing load: fairness, failures, shutdown.

Each test gates its drafter on events, so what it checks is an order of
events, not a duration.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from pp1wire.aio.client import AsyncClient, ProposalUnavailableError
from pp1wire.aio.server import WorkerServer
from pp1wire.errors import ErrorCode
from pp1wire.wire.spark_core import SparkConfig
from pp1wire.wire.worker_core import WorkerConfig

from .waiting import GatedDrafter, eventually

VOCAB = 64
LEGIT = 8  # the last prompt token tells whose draw the drafter is making


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def worker_log():
    recorder = Recorder()
    logger = logging.getLogger("pp1wire.worker")
    logger.addHandler(recorder)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    yield recorder.records
    logger.removeHandler(recorder)
    logger.setLevel(level)


@pytest.mark.asyncio
@pytest.mark.parametrize("draw_threads", [1, 0], ids=["pool", "loop"])
async def test_a_failing_drafter_is_logged_with_its_traceback_and_counted(worker_log, draw_threads):
    def broken(_prefix):
        raise RuntimeError("the drafter plugin crashed")

    srv = WorkerServer(WorkerConfig(vocab_size=VOCAB), broken, draw_threads=draw_threads)
    port = await srv.start("127.0.0.1", 0)
    client = await AsyncClient.connect(
        "127.0.0.1", port, SparkConfig(vocab_size=VOCAB, max_depth=2)
    )
    try:
        await client.open(0, seed=1, prefix=[1, 2])
        for n in range(20):
            with pytest.raises(ProposalUnavailableError) as failed:
                await client.propose(0, round_id=client.next_round(0), depth=2)
            assert failed.value.code is ErrorCode.INTERNAL
            await client.commit(0, round_id=client.next_round(0), tokens=[3 + n], accepted=0)
        logged = [r for r in worker_log if r.getMessage().startswith("drafter failed")]
        # Once per distinct failure (then at most once a minute), with the traceback.
        assert len(logged) == 1, [r.getMessage() for r in worker_log]
        assert logged[0].levelno == logging.ERROR
        assert logged[0].exc_info is not None
        assert "the drafter plugin crashed" in str(logged[0].exc_info[1])
        assert logged[0].round == 0
        counted = srv.metrics.drafter_errors.labels(error="RuntimeError")._value.get()
        assert counted == 20
    finally:
        await client.close()
        await srv.stop(grace=1.0)


@pytest.mark.asyncio
async def test_stopping_delivers_the_proposal_being_drawn():
    # SIGTERM (WorkerServer.stop) during a draw: the frames already received are
    # answered, so the client gets its whole proposal, not a closed connection.
    drafter = GatedDrafter(VOCAB)
    srv = WorkerServer(WorkerConfig(vocab_size=VOCAB), drafter, draw_threads=1)
    port = await srv.start("127.0.0.1", 0)
    client = await AsyncClient.connect(
        "127.0.0.1", port, SparkConfig(vocab_size=VOCAB, max_depth=1)
    )
    try:
        await client.open(0, seed=1, prefix=[1, LEGIT])
        pending = asyncio.ensure_future(client.propose(0, round_id=client.next_round(0), depth=1))
        assert await asyncio.to_thread(drafter.started.wait, 10)
        stopping = asyncio.ensure_future(srv.stop(grace=10.0))
        await eventually(lambda: srv.stopping, what="the server is stopping")
        drafter.gate.set()
        proposal = await asyncio.wait_for(pending, 10)
        assert len(proposal.rows) == 1
        await stopping
        await eventually(lambda: client.closed, what="the worker closes the connection after")
    finally:
        drafter.gate.set()
        await client.close()
        if not srv.stopping:
            await srv.stop(grace=1.0)
