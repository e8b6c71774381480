"""Fair draw scheduling and the draw budgets (per slot, per principal), with no socket or clock."""

from __future__ import annotations

import functools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp1wire.errors import ErrorCode
from pp1wire.q.proposal import prefix_digest
from pp1wire.wire import framing
from pp1wire.wire.budgets import Account, Accounts, DrawGate, TokenBucket
from pp1wire.wire.draws import DrawScheduler, FailureLog
from pp1wire.wire.messages import MsgType, Reset
from pp1wire.wire.worker_core import DrawRequested, WorkerConfig

from .pairs import make_pair
from .test_worker_core import (
    PREFIX,
    commit,
    error_of,
    frames_of,
    open_slot,
    ready_pair,
    reply_bytes,
    step,
)

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


def test_a_key_keeps_to_its_share_of_the_workers_while_another_is_active():
    # Before: whoever had jobs queued took every free worker, so a peer that draws
    # and throws its draws away (STEP -> target-only COMMIT, never abandoning one)
    # held every thread whenever a legitimate peer was between two rounds, and the
    # legitimate draw waited for a whole batch. Now while another key has drawn
    # within the share window, a key holds at most its share of the workers.
    s: DrawScheduler[str, int] = DrawScheduler(2)  # a share window of 1 s
    s.submit("legit", 0, now=0.0)
    s.finished(s.next_batch(0.0))  # it drew, and is scoring its proposal
    for i in range(8):
        s.submit("attacker", i, now=0.1)
    first = s.next_batch(0.1)
    assert first == [("attacker", 0)]
    assert s.next_batch(0.1) == []  # the other worker is the legitimate peer's share
    s.submit("legit", 1, now=0.2)
    assert s.next_batch(0.2) == [("legit", 1)]  # at once, not after an attacker's batch
    s.finished(first)
    assert s.next_batch(0.3) == [("attacker", 1)]
    assert s.next_batch(1.5) == []  # both workers busy
    # A key that has not drawn for the window no longer holds a share back.
    s.finished([("legit", 1)])
    assert s.next_batch(1.5) == [("attacker", 2)]
    assert s.busy == 2


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


# -- the rate budget counts per slot ----------------------------------------------------------


class Slots:
    """A worker core with slots 0..n-1 open at PREFIX, each committing one token a round."""

    def __init__(self, n: int, **worker_kw) -> None:
        self.pair = make_pair(worker_kw=worker_kw, spark_kw={"max_slots": n})
        for slot in range(n):
            open_slot(self.pair, slot=slot, seed=slot + 1)
        self.prefixes = {slot: list(PREFIX) for slot in range(n)}

    def step(self, slot: int, round_id: int):
        prefix = self.prefixes[slot]
        return step(slot=slot, round=round_id, position=len(prefix), digest=prefix_digest(prefix))

    def commit(self, slot: int, round_id: int):
        prefix = self.prefixes[slot]
        prefix.append(5)
        done = commit(round=round_id, position=len(prefix), digest=prefix_digest(prefix))
        return msgspec.structs.replace(done, slot=slot)

    def fresh(self, slot: int, round_id: int, now: float) -> MsgType | ErrorCode:
        """At ``now``: COMMIT round ``round_id - 1`` (if any), then STEP ``round_id``;
        COMPLETION, or the code the STEP was refused with."""
        self.pair.now = now
        if round_id:
            acked = frames_of([reply_bytes(self.pair, self.commit(slot, round_id - 1))])
            assert acked[0].type is MsgType.COMMITTED
        out = frames_of([reply_bytes(self.pair, self.step(slot, round_id))])
        if out[-1].type is MsgType.COMPLETION:
            return MsgType.COMPLETION
        return ErrorCode(out[-1].message.code)


def test_slots_stepping_together_at_the_per_slot_rate_are_never_refused():
    # Before: one bucket per connection, so 16 slots stepping together against a
    # rate an operator would choose for one request (10 rounds a second) were
    # refused after the first burst. Now --max-draw-rate counts per slot: a slot
    # that steps at most 10 times a second is never refused, however many step with it.
    slots = Slots(16, max_slots=16, max_draw_rate=10.0, draw_burst=1)
    got = [slots.fresh(slot, r, now=r * 0.1) for r in range(5) for slot in range(16)]
    assert got == [MsgType.COMPLETION] * 80


def test_a_slot_beyond_its_rate_is_refused_alone():
    slots = Slots(2, max_draw_rate=10.0, draw_burst=1)
    assert slots.fresh(0, 0, now=0.0) is MsgType.COMPLETION
    assert slots.fresh(0, 1, now=0.05) is ErrorCode.DRAW_RATE_LIMITED  # 20 rounds/s
    assert slots.fresh(1, 0, now=0.05) is MsgType.COMPLETION  # slot 1 has its own budget
    slots.pair.now = 0.1
    again = frames_of([reply_bytes(slots.pair, slots.step(0, 1))])
    assert again[-1].type is MsgType.COMPLETION


def test_a_refusal_holds_only_the_next_step_of_the_slot_that_exceeded():
    # Before: a DRAW_RATE_LIMITED refusal held the whole connection until the budget
    # allowed a draw, so one slot over its rate paused every other slot's COMMITs and
    # STEPs. Now only that slot's next fresh STEP waits (with what follows it).
    slots = Slots(3, max_draw_rate=10.0, draw_burst=1)
    for slot in range(3):
        assert slots.fresh(slot, 0, now=0.0) is MsgType.COMPLETION
    assert slots.fresh(0, 1, now=0.01) is ErrorCode.DRAW_RATE_LIMITED
    # The peer goes on at once: slot 0's round 1 decoded target-only and committed,
    # slot 1's round 0 committed, slot 0's round 2 asked for.
    later = [slots.commit(0, 1), slots.commit(1, 0), slots.step(0, 2)]
    worker = slots.pair.worker
    data = b"".join(framing.encode_frame(m) for m in later)
    worker.get_buffer()[: len(data)] = data
    worker.decoder.account(len(data))
    worker.pump(0.02, hold_after_refusal=True)
    out = frames_of([b"".join(worker.data_to_send())])
    # Both COMMITs are answered; only slot 0's STEP waits, for its budget (at 0.11 s).
    assert [f.type for f in out] == [MsgType.COMMITTED, MsgType.COMMITTED]
    assert worker.waiting
    worker.pump(0.05, hold_after_refusal=True)
    assert worker.data_to_send() == []  # still waiting: not refused a second time
    worker.pump(0.11, hold_after_refusal=True)
    out = frames_of([b"".join(worker.data_to_send())])
    assert out[-1].type is MsgType.COMPLETION


# -- budgets per principal ------------------------------------------------------------------


class Limits:
    """Draw limits as a worker configuration gives them."""

    def __init__(self, rate=None, burst=1, abandon_rate=None, abandon_burst=1):
        self.max_draw_rate, self.draw_burst = rate, burst
        self.abandon_rate, self.abandon_burst = abandon_rate, abandon_burst


def test_a_lane_handed_back_is_taken_again_so_reopening_earns_nothing():
    account = Account(Limits(rate=1.0, burst=2), now=0.0)
    lane = account.bind(0.0)
    assert [account.allows(lane, 0.0) for _ in range(3)] == [True, True, False]
    account.unbind(lane, 0.0)  # CLOSE (or the connection lost)
    again = account.bind(0.0)  # OPEN: the same spent lane, not a fresh one
    assert again is lane
    assert not account.allows(again, 0.5)
    assert account.allows(again, 1.0)
    # A second slot open at the same time gets a lane of its own.
    other = account.bind(1.0)
    assert other is not lane
    assert account.allows(other, 1.0)
    assert account.bound == 2


def test_the_fullest_lane_handed_back_is_taken_first_and_full_ones_are_forgotten():
    account = Account(Limits(rate=1.0, burst=2), now=0.0)
    a, b = account.bind(0.0), account.bind(0.0)
    account.allows(a, 0.0)
    account.allows(a, 0.0)
    account.allows(b, 0.0)
    account.unbind(a, 0.0)
    account.unbind(b, 0.0)
    assert account.bind(0.0) is b  # one draw left beats none
    assert account.bind(0.0) is a
    account.unbind(a, 0.0)
    assert not account.settled(0.0)  # a slot is still open (b)


def test_an_account_is_settled_once_every_budget_is_paid_back():
    account = Account(Limits(rate=1.0, burst=1, abandon_rate=1.0, abandon_burst=1), now=0.0)
    lane = account.bind(0.0)
    assert account.allows(lane, 0.0)
    account.abandoned(0.0)
    account.abandoned(0.0)  # one owed
    account.unbind(lane, 0.0)
    assert not account.settled(0.5)
    assert account.owes(0.5) == pytest.approx(0.5)
    assert account.owes(1.0) == 0.0
    assert not account.settled(1.5)  # the debt is paid, the abandon burst not yet back
    assert account.settled(2.0)


def test_principals_keep_their_debt_across_connections_and_are_forgotten_when_paid():
    accounts: Accounts[str] = Accounts(Limits(abandon_rate=1.0, abandon_burst=1))
    first = accounts.acquire("10.0.0.1", 0.0)
    first.abandoned(0.0)
    first.abandoned(0.0)  # one owed: refused until t = 1
    accounts.release("10.0.0.1", 0.0)
    assert "10.0.0.1" in accounts  # owing: remembered with no connection open
    again = accounts.acquire("10.0.0.1", 0.5)  # it reconnects
    assert again is first
    assert not again.allows(None, 0.5)
    assert accounts.acquire("10.0.0.2", 0.5).allows(None, 0.5)  # another principal: its own
    accounts.release("10.0.0.1", 0.5)
    accounts.release("10.0.0.2", 0.5)  # owes nothing: forgotten at once
    assert "10.0.0.2" not in accounts
    accounts.acquire("10.0.0.3", 3.0)  # any later call forgets what is paid back
    assert "10.0.0.1" not in accounts
    assert len(accounts) == 1


def test_principals_without_a_connection_are_bounded_in_number():
    accounts: Accounts[int] = Accounts(Limits(abandon_rate=0.001, abandon_burst=1), idle=3)
    for n in range(10):
        acct = accounts.acquire(n, 0.0)
        acct.abandoned(0.0)
        acct.abandoned(0.0)  # owing for 1000 s
        accounts.release(n, 0.0)
    assert len(accounts) == 3  # the longest idle forgotten first
    assert all(n in accounts for n in (7, 8, 9))
    held = accounts.acquire(7, 0.0)  # connected principals are never forgotten
    for n in range(10, 20):
        accounts.acquire(n, 0.0).abandoned(0.0)
        accounts.release(n, 0.0)
    assert 7 in accounts
    assert accounts.acquire(7, 0.0) is held


def test_one_connection_of_a_principal_gets_the_first_draw_grace_per_period():
    account = Account(Limits(), now=0.0)
    assert account.grace(0.0, period=10.0)
    assert not account.grace(5.0, period=10.0)  # a second connection, or a reconnect
    assert not account.settled(5.0)  # the period is remembered
    assert account.grace(10.0, period=10.0)


def test_a_peer_that_hangs_up_and_reconnects_finds_its_lanes_spent():
    # Before: the rate budget lived on the connection, so a peer that drew, hung up
    # and reconnected drew again on a full budget, without ever sending RESET.
    accounts: Accounts[str] = Accounts(WorkerConfig(vocab_size=64, max_draw_rate=1.0, draw_burst=2))
    drawn = 0
    for n in range(6):
        pair = make_pair()
        pair.worker.gate = DrawGate(accounts.acquire("10.0.0.9", n * 0.1))  # as the server does
        pair.now = n * 0.1
        open_slot(pair)
        drawn += frames_of([reply_bytes(pair, step())])[-1].type is MsgType.COMPLETION
        pair.worker.connection_lost()  # hangs up, the draw left uncommitted
        accounts.release("10.0.0.9", pair.now)
    assert drawn == 2  # the burst; 0.5 s is not enough to earn a third


def test_the_source_address_a_peer_counts_as():
    from pp1wire.wire.principals import address_key

    assert address_key("::ffff:10.1.2.3") == "10.1.2.3"  # one host, either family
    assert address_key("2001:db8::1") == address_key("2001:DB8:0::1")
    assert address_key("fe80::1%eth0") == "fe80::/64"
    assert address_key("/run/pp1.sock") == "/run/pp1.sock"
    # Before: an IPv6 peer was one address, so a host with a /64 (2^64 addresses)
    # was as many principals. Now its network is one address (--ipv6-prefix).
    assert address_key("2001:db8:0:7::1") == address_key("2001:db8:0:7:ffff::9") == (
        "2001:db8:0:7::/64"
    )
    assert address_key("2001:db8:0:7::1") != address_key("2001:db8:0:8::1")
    assert address_key("2001:db8:0:7::1", 128) == "2001:db8:0:7::1/128"
    assert address_key("2001:db8:1:7::1", 48) == address_key("2001:db8:1:8::1", 48)
    with pytest.raises(ValueError, match=r"1\.\.128"):
        address_key("::1", 0)


def test_a_draw_passed_over_by_a_later_target_only_commit_is_abandoned_while_others_draw():
    # Before: STEP round r, then COMMIT round r + 1 with no STEP (a target-only
    # COMMIT) threw round r's draw away without it ever counting: the loop drew
    # without bound, never refused, beside a Spark side waiting for the threads.
    accounts: Accounts[str] = Accounts(WorkerConfig(vocab_size=64, abandon_burst=2))
    accounts.acquire("10.0.0.1", 0.0).drew(0.0)  # a Spark side drawing meanwhile
    looping = _connection(accounts, "10.0.0.66", 0.0, slots=1)
    # Each call commits the round before the one it steps: 1, 3, 5, never stepped.
    got = [looping.fresh(0, r, now=0.0) for r in (0, 2, 4, 6)]
    # Rounds 0, 2 and 4 drawn, and passed over: one beyond the burst of two is owed.
    assert got == [MsgType.COMPLETION] * 3 + [ErrorCode.DRAW_RATE_LIMITED]
    # A Spark side commits the round it stepped (accepting nothing, if its target
    # rejects every draft): it abandons nothing, however many rounds.
    honest = _connection(accounts, "10.0.0.1", 0.0, slots=1)
    assert [honest.fresh(0, r, now=0.0) for r in range(8)] == [MsgType.COMPLETION] * 8
    # Alone, a Spark side that discards proposals (corrupt, late) and decodes the
    # next round target-only takes nothing from anyone: nothing is counted.
    alone = _connection(Accounts(WorkerConfig(vocab_size=64, abandon_burst=2)), "10.0.0.66", 0.0)
    assert [alone.fresh(0, r, now=0.0) for r in (0, 2, 4, 6)] == [MsgType.COMPLETION] * 4


def _connection(accounts, principal: str, now: float, slots: int = 2) -> Slots:
    """A connection of ``principal`` with ``slots`` slots open, holding its account."""
    conn = Slots(slots, abandon_rate=1.0, abandon_burst=1)
    conn.pair.worker.gate = DrawGate(accounts.acquire(principal, now))  # as the server does
    return conn


def _refused_once(accounts: Accounts[str], host: str) -> Slots:
    """A connection of ``host`` at time 0 that drew, then RESET and drew anew until a
    STEP was refused ``DRAW_RATE_LIMITED`` (burst 1): it owes one abandon."""
    conn = _connection(accounts, host, 0.0)
    assert conn.fresh(0, 0, now=0.0) is MsgType.COMPLETION
    for generation in (1, 2):  # RESET abandons the draw, STEP draws anew
        reply_bytes(conn.pair, Reset(session=7, slot=0, generation=generation))
        last = frames_of([reply_bytes(conn.pair, step(generation=generation))])[-1]
    assert ErrorCode(last.message.code) is ErrorCode.DRAW_RATE_LIMITED
    return conn


def test_a_peer_that_hangs_up_when_refused_owes_what_it_cut():
    # Before (and with budgets kept per principal alone): a RESET/STEP loop that
    # hung up at each refusal and reconnected drew the STEPs let through once its
    # debt was paid and cut them with the connection, uncounted: 1.6x its budget.
    accounts: Accounts[str] = Accounts(WorkerConfig(vocab_size=64, abandon_burst=1))
    conn = _refused_once(accounts, "10.0.0.7")  # owes 1
    conn.pair.now = 1.0  # paid back: both slots draw, and the peer hangs up
    reply_bytes(conn.pair, step(generation=2))
    assert conn.fresh(1, 0, now=1.0) is MsgType.COMPLETION
    conn.pair.worker.connection_lost()
    accounts.release("10.0.0.7", 1.0)
    again = _connection(accounts, "10.0.0.7", 1.0)
    assert again.fresh(0, 0, now=1.0) is ErrorCode.DRAW_RATE_LIMITED  # the two it cut



def test_a_peer_that_hangs_up_mid_draw_owes_it_refused_or_not():
    # Before: a connection never refused that hung up with draws in flight owed
    # nothing, so a connect -> STEP -> hang-up loop (no RESET, never refused) was
    # never charged. Now what a hang-up cuts is abandoned, refused before or not.
    accounts: Accounts[str] = Accounts(WorkerConfig(vocab_size=64, abandon_burst=1))
    looping = _connection(accounts, "10.0.0.8", 0.0)
    assert [looping.fresh(s, 0, now=0.0) for s in (0, 1)] == [MsgType.COMPLETION] * 2
    looping.pair.worker.connection_lost()  # hangs up, two draws uncommitted
    accounts.release("10.0.0.8", 0.0)
    again = _connection(accounts, "10.0.0.8", 0.5)
    assert again.fresh(0, 0, now=0.5) is ErrorCode.DRAW_RATE_LIMITED  # one beyond the burst
    assert again.pair.worker.gate.account.owes(0.5) == pytest.approx(0.5)  # paid from 1.0
    # A Spark side that commits every round it stepped and then hangs up (or closes
    # its slots) leaves nothing uncommitted: never charged, however often.
    honest = _connection(accounts, "10.0.0.9", 0.0)
    for n in range(5):
        assert honest.fresh(0, n, now=0.0) is MsgType.COMPLETION  # stepped and committed
    reply_bytes(honest.pair, honest.commit(0, 4))  # the last round too, then it leaves
    honest.pair.worker.connection_lost()
    accounts.release("10.0.0.9", 0.0)
    assert "10.0.0.9" not in accounts  # owes nothing: forgotten at once


@pytest.mark.parametrize("evicted", [False, True], ids=["hung_up", "evicted"])
def test_a_draw_in_progress_when_a_refused_connection_ends_is_abandoned(evicted):
    # Before: only a draw already served counted at the end of a connection, so a
    # peer refused once that hung up with its draws still being drawn (a worker
    # that draws off its event loop) cut them uncounted.
    accounts: Accounts[str] = Accounts(WorkerConfig(vocab_size=64, abandon_burst=1))
    conn = _refused_once(accounts, "10.0.0.5")  # owes 1 s
    conn.pair.now = 1.0  # paid back: both slots' STEPs are accepted and being drawn
    conn.pair.worker.defer_draws = True
    for fresh in (step(generation=2), conn.step(1, 0)):
        got = conn.pair.send_raw(fresh)
        assert [type(e) for e in got] == [DrawRequested], got
    account = conn.pair.worker.gate.account
    assert account.owes(1.0) == 0.0
    if evicted:  # the connection ends on the worker's decision, then the transport goes
        conn.pair.worker.close_with(ErrorCode.CONNECTION_LIMIT)
    conn.pair.worker.connection_lost()
    assert account.owes(1.0) == pytest.approx(2.0)  # two abandons, each one second


def test_a_key_at_its_share_holds_no_free_worker_waiting_for_its_announced_jobs():
    # A free worker waiting for a capped key's announced STEPs would wait for nothing
    # (the key may not take it): the shell's gather timer would fire again at once.
    s: DrawScheduler[str, int] = DrawScheduler(2, max_batch=8, gather=0.002)
    s.submit("legit", 0, now=0.0)
    s.finished(s.next_batch(0.0))  # the legitimate key drew: it holds a share
    s.submit("attacker", 0, now=0.1)
    assert s.next_batch(0.1) == [("attacker", 0)]
    s.expect("attacker", 1)
    s.submit("attacker", 2, now=0.1, tag=2)
    assert s.hold_until(0.1) is None
    assert s.next_batch(0.2) == []
