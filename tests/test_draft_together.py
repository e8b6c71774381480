"""The worker's engine step: STEPs drafted together get exactly the replies they got alone.

:class:`~pp1wire.wire.draws.DraftTogether` (the default batch runner of an
unsharded worker) is qualified against :meth:`DrawJob.run`, the per-job path:
for hypothesis batches of STEPs (dense and sparse, greedy and other
temperatures, every depth, an ``eos`` that occurs, padded rows, drafters that
fail, raise or shape rows wrongly), each job's reply bytes, status, drafted
tokens and logged failure are the same. Then, over sockets, a worker that
drafts together answers every STEP of a step with the bytes a worker drafting
each STEP alone sends, in one drafter call per position.
"""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.aio.client import AsyncClient
from pp1wire.aio.server import WorkerServer
from pp1wire.apps.models import drafter_factory
from pp1wire.wire.draws import MAX_DRAW_BATCH, DraftTogether, default_runner, run_each
from pp1wire.wire.messages import Step
from pp1wire.wire.replies import ReplyEncoder
from pp1wire.wire.spark_core import SparkConfig
from pp1wire.wire.worker_core import WorkerConfig
from pp1wire.wire.worker_events import DrawJob, DrawResult

from .test_propose_batch import make_drafter


@dataclass
class Slot:
    seed: int
    prefix: array[int]
    eos: int | None


def job_for(slot: Slot, step: Step, drafter, entries: int, vocab: int | None = None) -> DrawJob:
    return DrawJob(
        slot,
        step,
        drafter=drafter,
        proposer=None,
        encoder=ReplyEncoder(7, step, entries),
        vocab_size=vocab,
    )


def wire(result: DrawResult) -> bytes:
    return b"".join(bytes(p) for parts in result.reply for p in parts)


def assert_same_answer(got: DrawResult, want: DrawResult) -> None:
    assert wire(got) == wire(want)
    assert got.status == want.status
    assert [r.token for r in got.rows] == [r.token for r in want.rows]
    if want.failure is None:
        assert got.failure is None
    else:  # the exception the shell logs: the same kind, from the same plugin call
        assert type(got.failure) is type(want.failure)
        assert str(got.failure) == str(want.failure)


class Raising:
    """A drafter that raises for prefixes ending in ``bad`` (a plugin bug)."""

    def __init__(self, inner, bad: int) -> None:
        self.inner = inner
        self.bad = bad

    def __call__(self, prefix):
        if len(prefix) and prefix[-1] == self.bad:
            raise RuntimeError(f"drafter crashed after {self.bad}")
        return self.inner(prefix)


class Misshapen:
    """A drafter whose rows after ``bad`` are one entry short."""

    def __init__(self, inner, bad: int) -> None:
        self.inner = inner
        self.bad = bad

    def __call__(self, prefix):
        row = self.inner(prefix)
        return row[:-1] if len(prefix) and prefix[-1] == self.bad else row


@st.composite
def steps(draw):
    vocab = draw(st.sampled_from([2, 7, 64, 300]))
    padding = draw(st.sampled_from([0, 0, 5]))
    style = draw(st.integers(0, 2**16))
    kind = draw(st.sampled_from(["plain", "plain", "nonfinite", "raises", "misshapen"]))
    jobs = []
    for slot_index in range(draw(st.integers(1, 8))):
        prefix = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5))
        step = Step(
            session=7,
            slot=slot_index,
            generation=draw(st.integers(0, 2**32 - 1)),
            round=draw(st.integers(0, 2**32 - 1)),
            position=len(prefix),
            digest=0,
            depth=draw(st.integers(1, 5)),
            temperature=draw(st.sampled_from([1.0, 1.0, 0.0, 0.5, 1.7, 1e-3, 40.0])),
            support=draw(st.sampled_from([0, 0, 0, 1, 3, 32, vocab])),
            context=0,
        )
        eos = draw(st.sampled_from([None, None, 0, 1]))
        seed = draw(st.integers(0, 2**64 - 1))
        jobs.append((Slot(seed, array("i", prefix), eos), step))
    bad = draw(st.integers(0, vocab - 1))
    return vocab, padding, style, kind, bad, jobs


def drafter_of(vocab: int, style: int, kind: str, bad: int):
    inner = make_drafter(vocab, style, kind == "nonfinite")
    if kind == "raises":
        return Raising(inner, bad)
    if kind == "misshapen":
        return Misshapen(inner, bad)
    return inner


@pytest.mark.usefixtures("dyadic_path")
@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps(), st.sampled_from([1, 2]))
def test_each_step_drafted_together_gets_the_reply_it_gets_alone(case, threads):
    vocab, padding, style, kind, bad, specs = case
    drafter = drafter_of(vocab, style, kind, bad)
    entries = vocab + padding
    runner = DraftTogether(vocab, entries, threads=threads)
    together = runner([job_for(slot, step, drafter, entries, vocab) for slot, step in specs])
    alone = [job_for(slot, step, drafter, entries, vocab).run() for slot, step in specs]
    assert len(together) == len(alone)
    for got, want in zip(together, alone, strict=True):
        assert_same_answer(got, want)


def test_a_batch_is_one_drafter_call_per_position():
    vocab = 300
    model = drafter_factory(vocab, 1)
    calls: list[int] = []

    class Counting:
        def __call__(self, prefix):
            raise AssertionError("the batched form must be used")

        def batch(self, prefixes):
            calls.append(len(prefixes))
            return model.batch(prefixes)

    specs = [
        (Slot(s, array("i", [s, 2]), None), step_for(s, depth=5, support=32 * (s % 2)))
        for s in range(6)
    ]
    got = DraftTogether(vocab, vocab)([job_for(sl, st_, Counting(), vocab) for sl, st_ in specs])
    want = [job_for(sl, st_, model, vocab).run() for sl, st_ in specs]
    for g, w in zip(got, want, strict=True):
        assert_same_answer(g, w)
    # Distinct Counting instances are distinct drafters: one group each.
    assert calls == [1] * 5 * len(specs)
    calls.clear()
    shared = Counting()
    got = DraftTogether(vocab, vocab)([job_for(sl, st_, shared, vocab) for sl, st_ in specs])
    for g, w in zip(got, want, strict=True):
        assert_same_answer(g, w)
    assert calls == [len(specs)] * 5


def step_for(slot: int, *, depth: int, support: int = 0, round_id: int = 0) -> Step:
    return Step(
        session=7, slot=slot, generation=0, round=round_id, position=2, digest=0,
        depth=depth, temperature=1.0, support=support, context=0,
    )  # fmt: skip


def test_a_proposer_job_is_left_to_its_proposer():
    vocab = 64
    model = drafter_factory(vocab, 0)
    seen = []

    def proposer(seed, prefix, step, eos):
        seen.append(step.slot)
        return ()

    slot = Slot(1, array("i", [1, 2]), None)
    job = DrawJob(
        slot,
        step_for(3, depth=2),
        drafter=model,
        proposer=proposer,
        encoder=ReplyEncoder(7, step_for(3, depth=2), vocab),
    )
    local = job_for(slot, step_for(4, depth=2), model, vocab)
    got = DraftTogether(vocab, vocab)([job, local])
    assert seen == [3]
    assert got[0].rows == ()
    assert_same_answer(got[1], job_for(slot, step_for(4, depth=2), model, vocab).run())


def test_an_unsharded_worker_drafts_together_and_a_sharded_one_alone():
    runner, batch = default_runner(64, 80, local=True, batch=None)
    assert isinstance(runner, DraftTogether)
    assert (runner.vocab_size, runner.row_entries, batch) == (64, 80, MAX_DRAW_BATCH)
    assert default_runner(64, 80, local=True, batch=3)[1] == 3
    assert default_runner(64, 80, local=False, batch=None) == (run_each, 1)


def test_bad_runner_settings_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        DraftTogether(0, None)
    with pytest.raises(ValueError, match="at least 1"):
        DraftTogether(4, None, threads=0)
    with pytest.raises(ValueError, match="below the vocabulary"):
        DraftTogether(4, 3)


# -- over sockets ---------------------------------------------------------------------------


class BatchLog:
    """The toy drafter, recording how many prefixes each batched call drafted."""

    def __init__(self, vocab: int) -> None:
        self.model = drafter_factory(vocab, 0)
        self.calls: list[int] = []

    def __call__(self, prefix):
        return self.model(prefix)

    def batch(self, prefixes):
        self.calls.append(len(prefixes))
        return self.model.batch(prefixes)


async def one_step(client: AsyncClient, slots: int, support: int) -> list[bytes]:
    """Every slot's STEP at once; each proposal's tokens and q bytes; COMMIT its first draft."""
    proposals = await asyncio.gather(
        *(
            client.propose(s, round_id=client.next_round(s), depth=5, support=support)
            for s in range(slots)
        )
    )
    out = []
    for s, p in enumerate(proposals):
        q = b"".join(
            bytes(np.asarray(r.q32).tobytes()) + (b"" if r.ids is None else r.ids.tobytes())
            for r in p.rows
        )
        out.append(bytes(array("i", p.tokens)) + q)
        first = p.tokens[0]
        client.commit(s, round_id=p.round_id, tokens=[first, 0], accepted=1)
        client.release(p)
    return out


@pytest.mark.asyncio
async def test_a_worker_drafts_a_steps_steps_together_with_the_bytes_of_each_alone():
    vocab, slots = 512, 8
    answers = {}
    for together in (True, False):
        drafter = BatchLog(vocab)
        srv = WorkerServer(
            WorkerConfig(vocab_size=vocab, max_slots=slots),
            drafter,
            draw_threads=2,
            run_batch=None if together else run_each,
            # Long enough that only the last announced STEP ends the wait, never the clock.
            draw_gather=60.0,
        )
        port = await srv.start("127.0.0.1", 0)
        client = await AsyncClient.connect(
            "127.0.0.1", port, SparkConfig(vocab_size=vocab, max_slots=slots, max_support=32)
        )
        try:
            for s in range(slots):
                await client.open(s, seed=100 + s, prefix=[1, 2, s])
            got = []
            for support in (0, 32, 0):
                got += await one_step(client, slots, support)
            answers[together] = got
            if together:
                # Three steps: each one drafter call per position over all eight slots.
                assert drafter.calls == [slots] * 5 * 3
            else:
                assert drafter.calls == []  # each STEP alone: the per-prefix form
        finally:
            await client.close()
            await srv.stop(grace=1.0)
    assert answers[True] == answers[False]
