"""Drafters that hand over probabilities (``kind = "probs"``, ``docs/protocol.md`` §6.1).

A probabilities drafter's rows are the weights of §6.1 as FP32, with no
exponential: drafting a batch of STEPs together (``propose_batch``, the
worker's engine step, on the compiled path, on plain numpy and on torch CPU
tensors built where they live) gives every job exactly what ``propose`` gives
it alone; the temperature must be 1 (or 0, greedy); the built-in toy and paced
drafters offer both kinds; a worker drafting together sends the bytes of each
STEP drafted alone.
"""

from __future__ import annotations

import math
import zlib
from array import array

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.apps import models, paced
from pp1wire.errors import ErrorCode, Pp1Error
from pp1wire.q import dyadic
from pp1wire.q.batch import propose_batch
from pp1wire.q.proposal import (
    DraftJob,
    batched_drafter,
    build_row,
    drafter_kind,
)
from pp1wire.wire.draws import DraftTogether
from pp1wire.wire.messages import Step

from .test_draft_together import Slot, assert_same_answer, job_for
from .test_propose_batch import assert_same, reference

# -- a probabilities drafter whose rows depend only on the prefix ------------------------


def _probs(vocab: int, style: int, fail: bool, prefix) -> np.ndarray:
    key = zlib.crc32(np.asarray(list(prefix), dtype=np.int64).tobytes())
    gen = np.random.default_rng([style, key, vocab])
    kind = int(gen.integers(0, 10))
    x = gen.random(vocab) ** float(gen.choice([1.0, 8.0, 40.0]))
    if kind == 0:
        x[gen.random(vocab) < 0.4] = 0.0  # masked entries
    elif kind == 1:
        x = np.round(x * 4)  # many exact ties
    elif kind == 2:
        x = np.full(vocab, 0.25)  # flat
    elif kind == 3:
        x[:] = 0.0
        x[int(gen.integers(vocab))] = 1.0  # a single nonzero weight
    elif kind == 4:
        x = x * 2.0**-140  # subnormal FP32 values
    elif kind == 5 and fail:
        x[int(gen.integers(vocab))] = np.nan
    elif kind == 6 and fail:
        x[:] = 0.0  # zero mass
    elif kind == 7 and fail:
        x[int(gen.integers(vocab))] = -0.5
    return x.astype(np.float32)


class ProbsDrafter:
    """A per-prefix probabilities drafter (FP32 rows), with ``batch``."""

    kind = "probs"

    def __init__(self, vocab: int, style: int, fail: bool, *, tensor: bool = False) -> None:
        self.vocab, self.style, self.fail, self.tensor = vocab, style, fail, tensor

    def __call__(self, prefix):
        return _probs(self.vocab, self.style, self.fail, prefix)

    def batch(self, prefixes):
        rows = np.stack([self(p) for p in prefixes]) if prefixes else np.zeros((0, self.vocab))
        if self.tensor:
            torch = pytest.importorskip("torch")
            return torch.from_numpy(rows.astype(np.float32))
        return rows.astype(np.float32)


@st.composite
def batches(draw):
    vocab = draw(st.sampled_from([1, 2, 7, 64, 300]))
    jobs = [
        DraftJob(
            seed=draw(st.integers(0, 2**64 - 1)),
            generation=draw(st.integers(0, 5)),
            round_id=draw(st.integers(0, 9)),
            prefix=draw(st.lists(st.integers(0, vocab - 1), max_size=5)),
            depth=draw(st.sampled_from([1, 2, 3, 5, 5, 0])),
            temperature=draw(st.sampled_from([1.0, 1.0, 1.0, 0.0, 0.5, math.nan])),
            support=draw(st.sampled_from([0, 0, 0, 1, 3, 32, vocab + 5, -1])),
            eos=draw(st.sampled_from([None, None, 0])),
        )
        for _ in range(draw(st.integers(1, 6)))
    ]
    return vocab, jobs, draw(st.integers(0, 2**16)), draw(st.booleans())


@pytest.mark.usefixtures("dyadic_path")
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches(), st.sampled_from([1, 2]), st.sampled_from([None, 0, 3]), st.booleans())
def test_each_job_of_a_probabilities_batch_is_drafted_as_alone(batch, threads, padding, tensor):
    vocab, jobs, style, fail = batch
    drafter = ProbsDrafter(vocab, style, fail, tensor=tensor)
    want = [reference(j, drafter) for j in jobs]
    entries = None if padding is None else vocab + padding
    got = propose_batch(
        drafter.batch, jobs, vocab, threads=threads, row_entries=entries, kind="probs"
    )
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, entries)


@pytest.mark.parametrize(("path", "tensor"), [("compiled", False), ("numpy", False),
                                             ("compiled", True)])  # fmt: skip
def test_full_vocabulary_probabilities_batch(path, tensor, monkeypatch):
    if path == "numpy":
        monkeypatch.setattr(dyadic, "_fastq", None)
    vocab = 129_280
    drafter = ProbsDrafter(vocab, 3, False, tensor=tensor)
    jobs = [
        DraftJob(seed=s, generation=1, round_id=s, prefix=[s, 9], depth=2,
                 temperature=[1.0, 1.0, 0.0, 1.0][s], support=[0, 32, 0, 0][s])
        for s in range(4)
    ]  # fmt: skip
    want = [reference(j, drafter) for j in jobs]
    got = propose_batch(drafter.batch, jobs, vocab, row_entries=vocab + 128, kind="probs")
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, vocab + 128)
    assert all(isinstance(w, tuple) for w in want)


def test_a_probabilities_row_is_the_weights_without_an_exponential():
    w = np.array([1.0, 3.0, 0.0, 4.0], dtype=np.float32)
    counts, ids = build_row(w, 1.0, None, kind="probs")
    assert ids is None
    assert counts.tolist() == [2**24 // 8 * 1, 2**24 // 8 * 3, 0, 2**24 // 8 * 4]
    # Values that are not FP32 are rounded to FP32 first (to nearest even).
    near = np.array([1.0, 1.0 + 2.0**-30])  # rounds to 1.0: two equal weights
    assert build_row(near, 1.0, None, kind="probs")[0].tolist() == [2**23, 2**23]
    # Beyond the FP32 range: infinite, refused.
    with pytest.raises(Pp1Error) as err:
        build_row(np.array([1.0, 1e39]), 1.0, None, kind="probs")
    assert err.value.code is ErrorCode.WEIGHT_NON_FINITE
    # Greedy: the point mass at the first maximal weight.
    counts, ids = build_row(np.array([0.5, 4.0, 4.0], np.float32), 0.0, 2, kind="probs")
    assert (ids.tolist(), counts.tolist()) == ([1], [2**24])


@pytest.mark.parametrize("temperature", [0.5, 1.5, 1e-3, 40.0])
def test_a_probabilities_drafter_refuses_a_temperature_other_than_0_and_1(temperature):
    w = np.ones(4, dtype=np.float32)
    with pytest.raises(Pp1Error) as err:
        build_row(w, temperature, None, kind="probs")
    assert err.value.code is ErrorCode.BAD_TEMPERATURE
    assert "temperature 1" in str(err.value)
    job = DraftJob(seed=1, generation=0, round_id=0, prefix=[1], depth=2, temperature=temperature)
    (got,) = propose_batch(lambda ps: np.ones((len(ps), 4), np.float32), [job], 4, kind="probs")
    assert isinstance(got, Pp1Error)
    assert got.code is ErrorCode.BAD_TEMPERATURE


def test_the_kind_attribute():
    assert drafter_kind(lambda prefix: np.zeros(3)) == "logits"  # plugins of today
    assert drafter_kind(models.drafter_factory(10)) == "logits"
    assert drafter_kind(models.probs_drafter_factory(10)) == "probs"

    class Odd:
        kind = "softmax"

    with pytest.raises(ValueError, match="'logits' or 'probs'"):
        drafter_kind(Odd())
    with pytest.raises(ValueError, match="'logits' or 'probs'"):
        models.ModelFn(np.zeros, np.zeros, kind="softmax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'logits' or 'probs'"):
        propose_batch(lambda ps: np.zeros((len(ps), 3)), [], 3, kind="softmax")  # type: ignore[arg-type]


def test_the_toy_drafter_hands_over_its_own_probabilities_as_fp32():
    vocab, prefixes = 300, [[1, 2], [4], []]
    drafter = models.probs_drafter_factory(vocab, 2)
    model = models.toy_drafter(vocab, 2)
    rows = drafter.batch(prefixes)
    assert rows.dtype == np.float32
    assert rows.shape == (3, vocab)
    for row, p in zip(rows, prefixes, strict=True):
        assert row.tobytes() == drafter(p).tobytes()
        assert row.tobytes() == model.probs(p).astype(np.float32).tobytes()
    assert batched_drafter(drafter) == drafter.batch


def test_the_paced_drafter_offers_both_kinds(monkeypatch):
    monkeypatch.setenv(paced.DRAFTER_MS_ENV, "0")
    logits = paced.drafter_factory(50, 2)
    probs = paced.probs_drafter_factory(50, 2)
    assert (drafter_kind(logits), drafter_kind(probs)) == ("logits", "probs")
    row = probs([7])
    assert row.dtype == np.float32
    want = models.toy_drafter(50, 2).probs([7]).astype(np.float32)
    assert row.tobytes() == want.tobytes()
    assert [r.tobytes() for r in probs.batch([[7], [3]])] == [want.tobytes(), probs([3]).tobytes()]
    with pytest.raises(ValueError, match="'logits' or 'probs'"):
        paced.drafter_factory(50, 2, kind="both")  # type: ignore[arg-type]


# -- the worker's engine step ------------------------------------------------------------


def test_a_probabilities_step_drafted_together_gets_the_replies_it_gets_alone():
    vocab = 300
    drafter = models.probs_drafter_factory(vocab, 4)
    jobs = []
    for slot in range(6):
        step = Step(session=7, slot=slot, generation=1, round=3, position=2, digest=0,
                    depth=4, temperature=[1.0, 1.0, 0.0, 0.5, 1.0, 1.0][slot],
                    support=[0, 32, 0, 0, 0, 3][slot], context=0)  # fmt: skip
        jobs.append(job_for(Slot(slot * 11 + 1, array("i", [slot, 5]), None), step, drafter, vocab))
    together = DraftTogether(vocab, vocab, threads=2)(jobs)
    for got, job in zip(together, jobs, strict=True):
        assert_same_answer(got, job.run())
    assert together[3].status == int(ErrorCode.BAD_TEMPERATURE)
    assert all(r.status == 0 for i, r in enumerate(together) if i != 3)


def test_a_drafter_of_an_unknown_kind_fails_each_step_alone():
    class Odd:
        kind = "softmax"

        def __call__(self, prefix):
            return np.zeros(4)

    step = Step(session=7, slot=0, generation=1, round=1, position=1, digest=0, depth=2,
                temperature=1.0, support=0, context=0)  # fmt: skip
    job = job_for(Slot(1, array("i", [1]), None), step, Odd(), 4)
    (got,) = DraftTogether(4, 4)([job])
    assert got.status == int(ErrorCode.INTERNAL)
    assert isinstance(got.failure, ValueError)


def test_a_logits_tensor_is_read_on_the_host():
    torch = pytest.importorskip("torch")
    vocab = 50
    table = np.random.default_rng(0).standard_normal((4, vocab))
    jobs = [DraftJob(seed=s, generation=0, round_id=1, prefix=[s], depth=3) for s in range(4)]

    def as_tensor(prefixes):
        return torch.from_numpy(table[[p[-1] % 4 for p in prefixes]])

    def as_array(prefixes):
        return table[[p[-1] % 4 for p in prefixes]]

    got = propose_batch(as_tensor, jobs, vocab, row_entries=vocab)
    want = propose_batch(as_array, jobs, vocab, row_entries=vocab)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, tuple)
        assert [r.token for r in g] == [r.token for r in w]  # type: ignore[union-attr]


def test_probabilities_rows_keep_their_buffers_until_released():
    """A row written as it travels views a recycled buffer: a later step never
    overwrites a reply still referred to (the worker caches it until COMMIT)."""
    vocab = 64
    drafter = ProbsDrafter(vocab, 1, False)
    jobs = [DraftJob(seed=s, generation=0, round_id=1, prefix=[s], depth=2) for s in range(3)]
    first = propose_batch(drafter.batch, jobs, vocab, row_entries=vocab, kind="probs")
    kept = [r.q32.copy() for rows in first for r in rows]  # type: ignore[union-attr]
    for r in range(2, 6):
        later = [DraftJob(seed=s, generation=0, round_id=r, prefix=[s + r], depth=2)
                 for s in range(3)]  # fmt: skip
        propose_batch(drafter.batch, later, vocab, row_entries=vocab, kind="probs")
    now = [r.q32 for rows in first for r in rows]  # type: ignore[union-attr]
    assert all(np.array_equal(a, b) for a, b in zip(now, kept, strict=True))


def test_per_request_and_batch_agree_for_the_toy_probabilities_drafter():
    vocab = 4097
    drafter = models.probs_drafter_factory(vocab, 1)
    jobs = [DraftJob(seed=s, generation=2, round_id=1, prefix=[s], depth=5, support=[0, 8][s % 2])
            for s in range(4)]  # fmt: skip
    want = [reference(j, drafter) for j in jobs]
    got = propose_batch(batched_drafter(drafter), jobs, vocab, row_entries=vocab, kind="probs")
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, vocab)


def test_make_plugin_builds_the_probabilities_factories():
    from pp1wire.apps import settings as app_settings

    for spec in ("pp1wire.apps.models:probs_drafter_factory",
                 "pp1wire.apps.paced:probs_drafter_factory"):  # fmt: skip
        made = app_settings.make_plugin(spec, vocab_size=20, seed=1)
        assert drafter_kind(made) == "probs"
        assert np.asarray(made([1])).dtype == np.float32




def test_a_worker_sends_each_row_from_its_own_buffer_and_the_spark_side_takes_it():
    """The reply's chunks go to the transport as they are: each dense row is the
    buffer it was written into (no concatenation), and the Spark side validates the
    rows the probabilities drafter's q was built into."""
    from pp1wire.wire.spark_core import SparkConfig, SparkProtocol
    from pp1wire.wire.spark_events import ProposalReady
    from pp1wire.wire.worker_core import WorkerConfig, WorkerProtocol
    from pp1wire.wire.worker_events import DrawRequested

    vocab = 512
    drafter = models.probs_drafter_factory(vocab, 1)
    worker = WorkerProtocol(
        WorkerConfig(vocab_size=vocab), drafter, session=7, now=0.0, defer_draws=True
    )
    spark = SparkProtocol(SparkConfig(vocab_size=vocab), now=0.0)
    spark.start(0.0)

    def pump() -> list:
        events: list = []
        for _ in range(10):
            for chunk in spark.data_to_send():
                events += worker.receive_data(chunk, 0.0)
            sent = worker.data_to_send()
            for chunk in sent:
                events += spark.receive_data(chunk, 0.0)
            if not sent:
                break
        return events

    pump()
    spark.open_slot(0, seed=9, prefix=[1, 2])
    pump()
    spark.step(0, round_id=1, depth=4, temperature=1.0, support=0, now=0.0)
    for chunk in spark.data_to_send():
        requested = [e for e in worker.receive_data(chunk, 0.0) if isinstance(e, DrawRequested)]
    (job,) = (e.job for e in requested)
    (result,) = DraftTogether(vocab, vocab)([job])
    worker.finish_draw(job, result)
    chunks = worker.data_to_send()
    payloads = [c for c in chunks if memoryview(c).nbytes == 4 * vocab]
    assert len(payloads) == len(result.rows) == 4
    for chunk, row in zip(payloads, result.rows, strict=True):
        assert isinstance(chunk, memoryview)
        assert np.shares_memory(np.frombuffer(chunk, dtype="<f4"), row.q32)  # sent as it is
    events = [e for c in chunks for e in spark.receive_data(c, 0.0)]
    (ready,) = (e for e in events if isinstance(e, ProposalReady))
    assert ready.proposal.tokens == tuple(r.token for r in result.rows)
