"""Drafting many requests together gives each exactly what drafting it alone gives.

``propose_batch`` (one drafter call per position, q rows of the batch built in
one compiled pass) is qualified against ``propose`` run per job: the same
rows (token, counts with their dtype, sparse IDs), or the same error code,
for mixed dense and sparse supports, greedy and other temperatures, every
depth, an ``eos`` that occurs, and rows that fail. With the compiled module
and without it (the ``dyadic_path`` fixture).
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error
from pp1wire.q import dyadic, rows
from pp1wire.q.batch import propose_batch
from pp1wire.q.proposal import DraftJob, batched_drafter, propose
from pp1wire.q.rng import RoundStreams
from pp1wire.wire.messages import Step
from pp1wire.wire.replies import build_reply, reply_frames, row_payload

# Every rng below is seeded: the rows depend only on the prefix they are drawn for.


def _logits(vocab: int, style: int, fail: bool, prefix) -> np.ndarray:
    key = zlib.crc32(np.asarray(list(prefix), dtype=np.int64).tobytes())
    rng = np.random.default_rng([style, key, vocab])
    kind = int(rng.integers(0, 10))
    x = rng.standard_normal(vocab) * float(rng.choice([0.3, 3.0, 25.0]))
    if kind == 0:
        x[rng.random(vocab) < 0.4] = -np.inf  # masked entries
    elif kind == 1:
        x = np.round(x)  # many exact ties
    elif kind == 2:
        x = np.zeros(vocab)  # flat: every weight equal
    elif kind == 3:
        x[int(rng.integers(vocab))] += 60.0  # one dominant token
    elif kind == 4:
        x = x * 1e300  # huge magnitudes: shifted logits lose precision
    elif kind == 5 and fail:
        x[int(rng.integers(vocab))] = np.nan
    elif kind == 6 and fail:
        x[:] = -np.inf  # zero mass
    elif kind == 7 and fail:
        x[int(rng.integers(vocab))] = np.inf
    return x


def make_drafter(vocab: int, style: int, fail: bool):
    return lambda prefix: _logits(vocab, style, fail, prefix)


def reference(job: DraftJob, drafter):
    """``propose`` for one job, as the worker calls it: rows, or the error's code. For a
    drafter of either kind (``propose`` reads a probabilities drafter's ``kind``).

    On the numpy path (the compiled module off), so the batch, compiled or
    not, is checked against the plain construction: full-row top-k included.
    """
    saved, dyadic._fastq = dyadic._fastq, None
    try:
        return _reference(job, drafter)
    finally:
        dyadic._fastq = saved


def _reference(job: DraftJob, drafter):
    try:
        streams = RoundStreams(1, job.seed, job.generation, job.round_id)
        # as in the batch: a logit that overflows below the top has weight 0, silently
        with np.errstate(over="ignore"):
            return propose(
                job.prefix,
                job.depth,
                drafter,
                streams,
                temperature=job.temperature,
                support=job.support or None,
                eos=job.eos,
            )
    except Pp1Error as exc:
        return exc.code


STEP = Step(
    session=7, slot=3, generation=1, round=2, position=9, digest=5, depth=5,
    temperature=1.0, support=0, context=0,
)  # fmt: skip


def assert_same(got, want, entries: int | None = None) -> None:
    """The same rows, or the same error code. With ``entries``, dense rows may
    hold their wire values (``q32``) instead of counts: the same values, and
    the same reply bytes."""
    if isinstance(want, ErrorCode):
        assert isinstance(got, Pp1Error), (got, want)
        assert got.code is want
        return
    assert isinstance(got, tuple), got
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.token == b.token
        if a.counts is None:  # written as it travels
            assert entries is not None
            assert b.ids is None
            assert a.ids is None
            assert a.q32.dtype == np.dtype("<f4")
            assert a.q32.shape == (entries,)
            n = b.counts.size
            assert np.array_equal((a.q32[:n].astype(np.float64) * dyadic.M), b.counts)
            assert not a.q32[n:].view(np.uint32).any()  # +0.0 padding
            payload, _ = row_payload(a, entries)
            assert np.shares_memory(np.frombuffer(payload, dtype="<f4"), a.q32)  # no copy
            continue
        assert a.counts.dtype == b.counts.dtype
        assert np.array_equal(a.counts, b.counts)
        if b.ids is None:
            assert a.ids is None
        else:
            assert a.ids.dtype == b.ids.dtype
            assert np.array_equal(a.ids, b.ids)
    if entries is not None:
        assert build_reply(7, STEP, got, entries) == build_reply(7, STEP, want, entries)


temperatures = st.sampled_from(
    [0.0, 1.0, 1.0, 0.5, 1.7, 1e-3, 40.0, -0.0, -1.0, math.nan, math.inf]
)


@st.composite
def batches(draw):
    vocab = draw(st.sampled_from([1, 2, 7, 64, 300]))
    jobs = []
    eos_choice = []
    for _ in range(draw(st.integers(1, 8))):
        jobs.append(
            DraftJob(
                seed=draw(st.one_of(st.integers(0, 2**64 - 1), st.just(2**64))),
                generation=draw(st.one_of(st.integers(0, 5), st.just(2**32 - 1))),
                round_id=draw(st.one_of(st.integers(0, 9), st.just(2**32))),
                prefix=draw(st.lists(st.integers(0, vocab - 1), max_size=5)),
                depth=draw(st.sampled_from([1, 2, 3, 4, 5, 5, 5, 0, 6])),
                temperature=draw(temperatures),
                support=draw(st.sampled_from([0, 0, 0, 1, 3, 32, vocab, vocab + 5, -1])),
            )
        )
        eos_choice.append(draw(st.sampled_from(["none", "occurs", "zero"])))
    style = draw(st.integers(0, 2**16))
    fail = draw(st.booleans())
    return vocab, jobs, eos_choice, style, fail


def _with_eos(job: DraftJob, choice: str, drafter) -> DraftJob:
    """An eos that the job draws (its third draft, or its last), when asked for."""
    if choice == "zero":
        return DraftJob(**{**job.__dict__, "eos": 0})
    if choice == "occurs":
        rows = reference(job, drafter)
        if isinstance(rows, tuple) and rows:
            token = rows[min(2, len(rows) - 1)].token
            return DraftJob(**{**job.__dict__, "eos": token})
    return job


@pytest.mark.usefixtures("dyadic_path")
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches(), st.sampled_from([1, 2]), st.booleans(), st.sampled_from([None, 0, 3]))
def test_each_job_is_drafted_as_alone(batch, threads, two_d, padding):
    vocab, jobs, eos_choice, style, fail = batch
    drafter = make_drafter(vocab, style, fail)
    jobs = [_with_eos(j, c, drafter) for j, c in zip(jobs, eos_choice, strict=True)]
    want = [reference(j, drafter) for j in jobs]
    if two_d:  # a batched drafter returning one [B, V] array
        batch_fn = lambda prefixes: np.stack([drafter(p) for p in prefixes])  # noqa: E731
    else:  # the adapter for a per-prefix plugin
        batch_fn = batched_drafter(drafter)
    entries = None if padding is None else vocab + padding
    got = propose_batch(batch_fn, jobs, vocab, threads=threads, row_entries=entries)
    assert len(got) == len(jobs)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, entries)


@pytest.mark.usefixtures("dyadic_path")
@pytest.mark.parametrize(("vocab", "padding"), [(4097, None), (129_280, None), (129_280, 128)])
def test_full_vocabulary_batch(vocab, padding):
    # 8 slots x depth 5: dense, sparse:32 and greedy, temperatures 1 and not.
    drafter = make_drafter(vocab, 7, False)
    jobs = [
        DraftJob(
            seed=s,
            generation=1,
            round_id=3 + s,
            prefix=[s, 5, 9],
            depth=5,
            temperature=[1.0, 0.7, 1.0, 0.0][s % 4],
            support=[0, 0, 32, 0, 32, 0, 1, 0][s],
        )
        for s in range(8)
    ]
    want = [reference(j, drafter) for j in jobs]
    entries = None if padding is None else vocab + padding
    got = propose_batch(batched_drafter(drafter), jobs, vocab, row_entries=entries)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, entries)
    assert sum(isinstance(w, tuple) for w in want) >= 6  # the batch mostly drafts


def _jobs(n: int, vocab: int, **kw) -> list[DraftJob]:
    return [
        DraftJob(seed=i, generation=0, round_id=1, prefix=[i % vocab], depth=3, **kw)
        for i in range(n)
    ]


def test_one_drafter_call_per_position_over_every_live_job():
    vocab = 50
    calls = []
    drafter = make_drafter(vocab, 1, False)

    def batch(prefixes):
        calls.append(len(prefixes))
        return np.stack([drafter(p) for p in prefixes])

    # Depths 1..5: the call at position i covers the jobs still drafting.
    jobs = [DraftJob(seed=d, generation=0, round_id=0, prefix=[1], depth=d) for d in range(1, 6)]
    got = propose_batch(batch, jobs, vocab)
    assert all(isinstance(g, tuple) for g in got)
    assert calls == [5, 4, 3, 2, 1]


def test_a_drafter_that_raises_fails_every_job_of_its_call():
    def batch(prefixes):
        raise RuntimeError("model crashed")

    got = propose_batch(batch, _jobs(3, 10), 10)
    assert all(isinstance(g, Pp1Error) and g.code is ErrorCode.INTERNAL for g in got)
    assert isinstance(got[0].__cause__, RuntimeError)


def test_a_drafter_raising_a_pp1_error_keeps_its_code():
    def batch(prefixes):
        raise ConstructionError(ErrorCode.WEIGHT_NEGATIVE, "plugin refused")

    got = propose_batch(batch, _jobs(2, 10), 10)
    assert [g.code for g in got] == [ErrorCode.WEIGHT_NEGATIVE] * 2


@pytest.mark.parametrize(
    "shape_of",
    [
        lambda b: np.zeros((b + 1, 10)),  # a row too many
        lambda b: np.zeros((b, 11)),  # the wrong vocabulary
        lambda b: np.zeros(10),  # not 2-D
        lambda b: [np.zeros(10)] * (b - 1),  # a row too few
    ],
)
def test_a_call_of_the_wrong_shape_fails_every_job_with_bad_shape(shape_of):
    got = propose_batch(lambda prefixes: shape_of(len(prefixes)), _jobs(3, 10), 10)
    assert [g.code for g in got] == [ErrorCode.BAD_SHAPE] * 3


def test_a_bad_row_fails_only_its_own_job():
    rows = [np.zeros(10), np.zeros(9), np.zeros((2, 5)), np.full(10, np.nan), np.zeros(10)]
    got = propose_batch(lambda prefixes: [rows[p[0]] for p in prefixes], _jobs(5, 10), 10)
    assert isinstance(got[0], tuple)
    assert [g.code for g in got[1:4]] == [
        ErrorCode.BAD_SHAPE,
        ErrorCode.BAD_SHAPE,
        ErrorCode.WEIGHT_NON_FINITE,
    ]
    assert isinstance(got[4], tuple)


def test_batched_drafter_prefers_the_plugins_own_batch():
    class Plugin:
        def __call__(self, prefix):
            raise AssertionError("the per-prefix form must not be used")

        def batch(self, prefixes):
            return np.zeros((len(prefixes), 4))

    got = propose_batch(batched_drafter(Plugin()), _jobs(2, 4), 4)
    assert all(isinstance(g, tuple) and len(g) == 3 for g in got)
    per_prefix = batched_drafter(lambda prefix: np.arange(4.0))
    assert [list(r) for r in per_prefix([[1], [2]])] == [[0, 1, 2, 3]] * 2


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        propose_batch(batched_drafter(lambda p: np.zeros(3)), _jobs(1, 3), 0)
    with pytest.raises(ValueError, match="at least 1"):
        propose_batch(batched_drafter(lambda p: np.zeros(3)), _jobs(1, 3), 3, threads=0)
    with pytest.raises(ValueError, match="below the vocabulary"):
        propose_batch(batched_drafter(lambda p: np.zeros(3)), _jobs(1, 3), 3, row_entries=2)
    assert propose_batch(batched_drafter(lambda p: np.zeros(3)), [], 3) == []


def test_sparse_rows_skip_the_full_exponential_when_provable(monkeypatch):
    # The qualification above would be vacuous if the candidate path always fell back.
    if dyadic._fastq is None:
        pytest.skip("compiled fast path not built")
    fallbacks = []
    real = dyadic.QBuilder.sparse_from_logits

    def counting(self, *args):
        fallbacks.append(args)
        return real(self, *args)

    monkeypatch.setattr(dyadic.QBuilder, "sparse_from_logits", counting)
    vocab = 129_280
    jobs = _jobs(4, vocab, temperature=1.0, support=32)
    got = propose_batch(lambda ps: np.stack([_normal(p, vocab) for p in ps]), jobs, vocab)
    assert all(isinstance(g, tuple) for g in got)
    assert fallbacks == []


def _normal(prefix, vocab):
    return np.random.default_rng(len(prefix)).standard_normal(vocab) * 3.0


def test_row_buffers_are_reused_only_when_nothing_refers_to_them():
    pool = rows.RowBuffers(8, limit=4)
    a = pool.take()
    b = pool.take()
    assert a is not b
    a_id = id(a)
    del a
    c = pool.take()
    assert id(c) == a_id  # free again: recycled
    view, memory = c[2:], c.data.cast("B")
    del c
    held = [pool.take() for _ in range(6)]  # b is held too: the pool is full
    assert a_id not in map(id, held)  # a view and a memoryview still refer to it
    assert len(pool._buffers) == 4  # beyond the limit: fresh arrays, not kept
    del view
    assert a_id not in [id(pool.take()) for _ in range(4)]
    del memory
    assert a_id in [id(pool.take()) for _ in range(4)]
    assert b is not None


def test_a_kept_reply_is_never_overwritten_by_later_batches():
    vocab = 1000
    drafter = make_drafter(vocab, 11, False)
    kept = []
    for r in range(6):
        jobs = [
            DraftJob(seed=s, generation=0, round_id=r, prefix=[s, r], depth=5) for s in range(4)
        ]
        got = propose_batch(batched_drafter(drafter), jobs, vocab, row_entries=vocab)
        replies = [build_reply(7, STEP, rows, vocab) for rows in got]
        if r % 2 == 0:  # keep the frames (their payloads view the row buffers)
            frames = [reply_frames(7, STEP, rows, vocab) for rows in got]
            kept.append((frames, replies))
        del got
    for frames, replies in kept:
        for f, want in zip(frames, replies, strict=True):
            assert b"".join(bytes(p) for parts in f for p in parts) == want


def test_a_positions_rows_are_split_over_the_threads(monkeypatch):
    import threading

    from pp1wire.q import batch

    seen = []
    real = batch._construct

    def recording(dense, sparse, entries):
        seen.append((threading.get_ident(), len(dense), len(sparse)))
        return real(dense, sparse, entries)

    monkeypatch.setattr(batch, "_construct", recording)
    vocab = 500
    drafter = make_drafter(vocab, 5, False)
    jobs = _jobs(8, vocab)
    want = [reference(j, drafter) for j in jobs]
    got = propose_batch(batched_drafter(drafter), jobs, vocab, threads=2)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    per_position = [seen[k : k + 2] for k in range(0, len(seen), 2)]
    assert len(per_position) == 3  # depth 3
    for calls in per_position:
        assert len({ident for ident, _, _ in calls}) == 2  # the caller and one more thread
        assert sorted(d for _, d, _ in calls) == [4, 4]
