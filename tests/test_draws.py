"""Fair draw scheduling and the per-connection draw budget, without sockets or clocks."""

from __future__ import annotations

import functools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.errors import ErrorCode
from pp1wire.q.proposal import prefix_digest
from pp1wire.wire.draws import DrawScheduler, FailureLog, TokenBucket
from pp1wire.wire.messages import MsgType, Reset

from .test_worker_core import PREFIX, commit, error_of, frames_of, ready_pair, reply_bytes, step

# -- the scheduler ------------------------------------------------------------------------


def drain(s: DrawScheduler) -> list[tuple[str, int]]:
    """Hand out every job one batch at a time, finishing each before the next."""
    order = []
    while batch := s.next_batch():
        order += batch
        s.finished(batch)
    return order


def test_a_backlogged_connection_does_not_delay_a_newcomer_behind_its_queue():
    s: DrawScheduler[str, int] = DrawScheduler(1)
    for i in range(16):
        s.submit("attacker", i)
    (first,) = s.next_batch()  # the attacker's first draw runs
    s.submit("legit", 0)
    s.finished([first])
    assert s.next_batch() == [("legit", 0)]  # next, not after 15 more


def test_connections_with_equal_work_are_served_in_turn():
    s: DrawScheduler[str, int] = DrawScheduler(1)
    for key in "abc":
        for i in range(3):
            s.submit(key, i)
    assert drain(s) == [(k, i) for i in range(3) for k in "abc"]


def test_the_fewest_running_go_first_and_workers_are_bounded():
    s: DrawScheduler[str, int] = DrawScheduler(2)
    for i in range(4):
        s.submit("a", i)
    one = s.next_batch()
    s.submit("b", 0)
    two = s.next_batch()
    assert (one, two) == ([("a", 0)], [("b", 0)])
    assert s.next_batch() == []  # both workers busy
    assert (s.running("a"), s.running("b"), s.queued, s.busy) == (1, 1, 3, 2)


def test_batches_take_jobs_fairly_across_connections():
    s: DrawScheduler[str, int] = DrawScheduler(1, max_batch=4)
    for i in range(6):
        s.submit("a", i)
    s.submit("b", 0)
    s.submit("c", 0)
    assert s.next_batch() == [("a", 0), ("b", 0), ("c", 0), ("a", 1)]


def test_a_dropped_connection_leaves_nothing_queued():
    s: DrawScheduler[str, int] = DrawScheduler(1)
    s.submit("a", 0)
    s.submit("a", 1)
    s.submit("b", 0)
    assert s.drop("a") == [0, 1]
    assert drain(s) == [("b", 0)]
    assert (s.queued, s.busy) == (0, 0)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least one worker"):
        DrawScheduler(0)
    with pytest.raises(ValueError, match="at least one worker"):
        DrawScheduler(1, max_batch=0)
    for gather in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gather time"):
            DrawScheduler(1, gather=gather)


# -- gathering the STEPs of one step ---------------------------------------------------------


def announced(slots: int, *, max_batch: int = 8) -> DrawScheduler[str, int]:
    """A scheduler whose connection "a" committed ``slots`` slots: their STEPs are due."""
    s: DrawScheduler[str, int] = DrawScheduler(1, max_batch=max_batch, gather=0.002)
    for slot in range(slots):
        s.expect("a", slot)
    return s


def test_a_free_worker_waits_for_the_steps_a_connection_announced():
    s = announced(4)
    s.submit("a", 0, now=0.0, tag=0)
    assert s.next_batch(now=0.001) == []
    assert s.hold_until() == 0.002
    s.submit("a", 1, now=0.0012, tag=1)
    s.submit("a", 2, now=0.0013, tag=2)
    assert s.next_batch(now=0.0014) == []
    s.submit("a", 3, now=0.0015, tag=3)  # the last one announced: no reason to wait
    assert s.hold_until() is None
    assert s.next_batch(now=0.0015) == [("a", 0), ("a", 1), ("a", 2), ("a", 3)]


def test_the_wait_ends_after_gather_and_a_dispatch_forgets_the_rest():
    s = announced(3)
    s.submit("a", 0, now=0.0, tag=0)
    assert s.next_batch(now=0.0019) == []
    batch = s.next_batch(now=0.002)  # slots 1 and 2 never came (say, target-only rounds)
    assert batch == [("a", 0)]
    s.finished(batch)
    s.submit("a", 1, now=0.003, tag=1)  # no longer expected to bring company
    assert s.next_batch(now=0.003) == [("a", 1)]


def test_only_a_queued_connections_announcements_hold_a_worker():
    s = announced(2)
    s.submit("b", 0, now=0.0, tag=0)  # "b" announced nothing; "a" has nothing queued
    assert s.next_batch(now=0.0) == [("b", 0)]


def test_a_full_batch_a_closed_slot_or_a_dropped_connection_ends_the_wait():
    s = announced(4, max_batch=2)
    s.submit("a", 0, now=0.0, tag=0)
    s.submit("a", 1, now=0.0, tag=1)
    assert s.next_batch(now=0.0) == [("a", 0), ("a", 1)]  # a full batch goes at once
    s = announced(2)
    s.submit("a", 0, now=0.0, tag=0)
    assert s.next_batch(now=0.0) == []
    s.unexpect("a", 1)  # its slot closed
    assert s.next_batch(now=0.0) == [("a", 0)]
    s = announced(2)
    s.submit("a", 0, now=0.0, tag=0)
    s.drop("a")
    assert s.hold_until() is None
    s.submit("a", 1, now=0.0, tag=0)
    assert s.next_batch(now=0.0) == [("a", 1)]


def test_a_busy_pool_holds_nothing_and_no_gather_never_waits():
    s = announced(2)
    s.submit("a", 0, now=0.0, tag=0)
    s.submit("b", 0, now=0.0)
    s.busy = s.workers  # every worker holds a batch
    assert s.hold_until() is None
    s = DrawScheduler(1, max_batch=8)  # gather 0
    s.expect("a", 1)
    s.submit("a", 0, now=0.0, tag=0)
    assert s.next_batch(now=0.0) == [("a", 0)]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from("abcd")),
        st.tuples(st.just("next"), st.just("")),
        st.tuples(st.just("finish"), st.integers(0, 3)),
        st.tuples(st.just("drop"), st.sampled_from("abcd")),
        st.tuples(st.just("expect"), st.sampled_from("abcd")),
        st.tuples(st.just("wait"), st.integers(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 3), st.integers(1, 3), st.sampled_from([0.0, 2.0]))
def test_no_job_is_lost_duplicated_or_reordered(ops, workers, max_batch, gather):
    s: DrawScheduler[str, int] = DrawScheduler(workers, max_batch=max_batch, gather=gather)
    submitted: dict[str, list[int]] = {k: [] for k in "abcd"}
    handed: dict[str, list[int]] = {k: [] for k in "abcd"}
    dropped: dict[str, list[int]] = {k: [] for k in "abcd"}
    running: list[list[tuple[str, int]]] = []
    n = 0
    now = 0.0
    for op, arg in ops:
        if op == "submit":
            s.submit(arg, n, now=now, tag=n % 3)
            submitted[arg].append(n)
            n += 1
        elif op == "expect":
            s.expect(arg, n % 3)
        elif op == "wait":
            now += arg
        elif op == "next":
            until = s.hold_until()
            batch = s.next_batch(now)
            if until is not None and now < until:
                assert batch == []
            assert len(batch) <= max_batch
            if batch:
                running.append(batch)
                for k, j in batch:
                    handed[k].append(j)
            assert s.busy <= workers
        elif op == "finish" and running:
            s.finished(running.pop(arg % len(running)))
        elif op == "drop":
            dropped[arg] += s.drop(arg)
    for batch in running:
        s.finished(batch)
    # Past every wait, everything left goes out.
    for batch in iter(functools.partial(s.next_batch, now + gather), []):
        for k, j in batch:
            handed[k].append(j)
        s.finished(batch)
    for k in "abcd":
        # Each connection's jobs go out in submission order, once, or are dropped.
        assert sorted(handed[k] + dropped[k]) == submitted[k]
        assert handed[k] == sorted(handed[k])
    assert (s.queued, s.busy) == (0, 0)


# -- the token bucket -----------------------------------------------------------------------


def test_a_bucket_allows_its_burst_then_its_rate():
    b = TokenBucket(rate=10.0, burst=3, now=100.0)
    assert [b.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert b.wait(100.0) == pytest.approx(0.1)
    assert not b.take(100.05)  # half a token: nothing spent
    assert b.take(100.1)
    assert not b.take(100.1)
    assert [b.take(200.0) for _ in range(4)] == [True, True, True, False]  # never above burst


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1), (float("inf"), 1), (1.0, 0)])
def test_a_bucket_refuses_a_meaningless_budget(rate, burst):
    with pytest.raises(ValueError, match="draw budget"):
        TokenBucket(rate, burst, 0.0)


# -- the budget in the worker core ----------------------------------------------------------


def _loop_step(pair, generation: int, now: float) -> bytes:
    """RESET to ``generation`` (a fresh round 0), then STEP it: the attack's loop."""
    pair.now = now
    if generation:
        reply_bytes(pair, Reset(session=7, slot=0, generation=generation))
    return reply_bytes(pair, step(generation=generation))


def test_a_reset_step_loop_is_refused_beyond_the_draw_budget_and_refusals_change_nothing():
    pair = ready_pair(worker_kw={"max_draw_rate": 2.0, "draw_burst": 2})
    twin = ready_pair()
    served = [_loop_step(pair, g, now=0.0) for g in range(3)]
    assert [frames_of([r])[-1].type for r in served[:2]] == [MsgType.COMPLETION] * 2
    err = error_of(served[2])
    assert ErrorCode(err.code) is ErrorCode.DRAW_RATE_LIMITED
    assert (err.answers, err.slot, err.generation, err.round) == (MsgType.STEP, 0, 2, 0)
    # Half a second later the budget has one draw again: the same STEP is drawn,
    # exactly as a worker that never refused it draws it.
    pair.now = 0.5
    again = reply_bytes(pair, step(generation=2))
    reply_bytes(twin, Reset(session=7, slot=0, generation=2))
    assert again == reply_bytes(twin, step(generation=2))


def test_the_budget_counts_only_fresh_draws():
    pair = ready_pair(worker_kw={"max_draw_rate": 1.0, "draw_burst": 1})
    first = reply_bytes(pair, step())
    assert reply_bytes(pair, step()) == first  # a retry replays: no draw, no budget
    bad = msgspec.structs.replace(step(round=1), depth=9)
    assert ErrorCode(error_of(reply_bytes(pair, bad)).code) is ErrorCode.DEPTH_OUT_OF_RANGE
    # A target-only commit needs no draw either.
    assert frames_of([reply_bytes(pair, commit(round=1))])[0].type is MsgType.COMMITTED


# -- which drafter failures are logged --------------------------------------------------------


def _raised(message: str) -> BaseException:
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        return exc


def test_each_kind_of_failure_is_logged_once_then_at_most_once_per_period():
    log = FailureLog(every=60.0, kinds=2)
    a, b, c = _raised("a"), _raised("b"), _raised("c")
    assert log.note(a, 0.0) == (True, True, 0)  # new: logged with its traceback
    assert log.note(a, 1.0) == (False, False, 1)
    assert log.note(a, 59.0) == (False, False, 2)
    assert log.note(b, 59.0) == (True, True, 0)  # another kind is news
    assert log.note(a, 60.0) == (True, False, 2)  # a minute on: one line, with the count
    assert log.note(a, 61.0) == (False, False, 1)
    # Beyond the kinds remembered, the rest share one rate-limited line.
    assert log.note(c, 61.0) == (True, False, 0)
    assert log.note(_raised("d"), 62.0) == (False, False, 1)


def test_a_reset_step_loop_owes_its_abandoned_draws_and_a_committing_peer_never_does():
    # Before: every RESET opened a fresh draw, so a peer looping STEP -> RESET made
    # the worker draw without bound (no rate limit set, as by default).
    pair = ready_pair(worker_kw={"abandon_rate": 1.0, "abandon_burst": 2})
    served = [_loop_step(pair, g, now=0.0) for g in range(4)]
    # Draws 0, 1 and 2 were drawn; the RESETs before 1 and 2 abandoned two (the
    # burst), the RESET before 3 a third: that one is owed, so STEP 3 is refused.
    assert [frames_of([r])[-1].type for r in served[:3]] == [MsgType.COMPLETION] * 3
    assert ErrorCode(error_of(served[3]).code) is ErrorCode.DRAW_RATE_LIMITED
    pair.now = 0.5
    assert ErrorCode(error_of(reply_bytes(pair, step(generation=3))).code) is (
        ErrorCode.DRAW_RATE_LIMITED  # half a draw earned back: still owing
    )
    pair.now = 1.0
    assert frames_of([reply_bytes(pair, step(generation=3))])[-1].type is MsgType.COMPLETION
    # A peer that commits every round it asks for abandons nothing, however many
    # rounds, and a RESET after a COMMIT abandons nothing either.
    honest = ready_pair(worker_kw={"abandon_rate": 1.0, "abandon_burst": 1})
    prefix = list(PREFIX)
    for r in range(6):
        ask = step(round=r, position=len(prefix), digest=prefix_digest(prefix))
        assert frames_of([reply_bytes(honest, ask)])[-1].type is MsgType.COMPLETION
        done = commit(round=r, position=len(prefix) + 1, digest=prefix_digest([*prefix, 5]))
        assert frames_of([reply_bytes(honest, done)])[0].type is MsgType.COMMITTED
        prefix.append(5)
    reply_bytes(honest, Reset(session=7, slot=0, generation=1))
    ask = step(generation=1, round=0, position=len(prefix), digest=prefix_digest(prefix))
    assert frames_of([reply_bytes(honest, ask)])[-1].type is MsgType.COMPLETION
