"""Draw budgets per principal, kept across its connections (``docs/protocol.md`` §4.4; sans-IO):
one principal's :class:`Account`, the :class:`Accounts` of all, and a connection's
:class:`DrawGate`; callers pass ``now``."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Final, Generic, Protocol, TypeVar

from pp1wire.wire import fencing
from pp1wire.wire.fencing import Action, WorkerSlotFence
from pp1wire.wire.messages import Hello, Step

#: Seconds a principal counts as drawing after its last draw (the draw threads'
#: share, and whether others wait for them).
SHARE_WINDOW_S: Final = 1.0
#: Fresh draws one slot may ask for ahead of ``--max-draw-rate`` (the default ``--draw-burst``).
DRAW_BURST: Final = 4
#: Principals remembered with no connection open (their budgets still owing).
IDLE_ACCOUNTS: Final = 4096

# Refills add up elapsed time in floating point: a token due exactly now may come
# out a few ulps short of 1.
_EPSILON = 1e-9


class _Refilling:
    """A level that refills at ``rate`` per second up to ``burst``, full at creation (the
    clock is the caller's, monotonic seconds)."""

    __slots__ = ("_level", "_stamp", "burst", "rate")

    def __init__(self, rate: float, burst: int, now: float, *, start: float | None = None) -> None:
        """A full level at ``now`` (or ``start``, at most ``burst``, refilling from there).

        Raises:
            ValueError: unless ``rate`` is finite and above 0 and ``burst`` >= 1.
        """
        if not (math.isfinite(rate) and rate > 0) or burst < 1:
            raise ValueError("a draw budget needs a finite rate above 0 and a burst of at least 1")
        self.rate = rate
        self.burst = burst
        self._level = float(burst) if start is None else min(float(burst), start)
        self._stamp = now

    def _refill(self, now: float) -> None:
        if now > self._stamp:
            self._level = min(float(self.burst), self._level + (now - self._stamp) * self.rate)
            self._stamp = now

    def full(self, now: float) -> bool:
        """Whether the level is back at ``burst`` at ``now`` (as new)."""
        self._refill(now)
        return self._level >= self.burst - _EPSILON


class TokenBucket(_Refilling):
    """At most ``burst`` draws at once and ``rate`` per second on average, full at creation
    (``TokenBucket(rate, burst, now)``; ``ValueError`` for a bad rate or burst)."""

    __slots__ = ()

    def level(self, now: float) -> float:
        """The draws the bucket holds at ``now`` (fractions included)."""
        self._refill(now)
        return self._level

    def take(self, now: float) -> bool:
        """Spend one draw at ``now`` if the budget has one; False (nothing spent) if not."""
        self._refill(now)
        if self._level >= 1.0 - _EPSILON:
            self._level = max(0.0, self._level - 1.0)
            return True
        return False

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`take` would succeed (0 if it would now)."""
        self._refill(now)
        return 0.0 if self._level >= 1.0 - _EPSILON else (1.0 - self._level) / self.rate


class AbandonBudget(_Refilling):
    """Fresh draws a principal may leave uncommitted (its slot reset or closed before a
    COMMIT of that round, §4.4): ``burst`` free, then ``rate`` a second. Its level goes
    below 0, what is owed, and while it does the principal's fresh STEPs are refused
    (``DRAW_RATE_LIMITED``); full at creation (or at ``start``), as :class:`TokenBucket`.
    """

    __slots__ = ()

    def abandoned(self, now: float) -> None:
        """One more draw left uncommitted at ``now``."""
        self._refill(now)
        self._level -= 1.0

    def allows(self, now: float) -> bool:
        """Whether a fresh draw may start at ``now`` (nothing is owed)."""
        self._refill(now)
        return self._level > -_EPSILON

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`allows` would be true (0 if it is now)."""
        return 0.0 if self.allows(now) else -self._level / self.rate


class DrawLimits(Protocol):
    """The draw limits of a worker's configuration (``WorkerConfig``)."""

    @property
    def max_draw_rate(self) -> float | None:
        """Fresh draws per second per slot (None: no limit)."""

    @property
    def draw_burst(self) -> int:
        """Fresh draws one slot may ask for ahead of that rate."""

    @property
    def abandon_rate(self) -> float | None:
        """Uncommitted draws per second per principal (None: no limit)."""

    @property
    def abandon_burst(self) -> int:
        """Uncommitted draws at once per principal."""


class Activity:
    """Whether a principal draws while others do (§4.4): the two principals that drew last."""

    __slots__ = ("_last", "window")

    def __init__(self, window: float = SHARE_WINDOW_S) -> None:
        """Others count as drawing for ``window`` seconds after their last draw."""
        self.window = window
        self._last: list[tuple[object, float]] = []  # (principal, when), latest first

    def drew(self, principal: object, now: float) -> None:
        """``principal`` had a fresh draw accepted at ``now``."""
        others = [e for e in self._last if e[0] != principal]
        self._last = [(principal, now), *others[:1]]

    def others(self, principal: object, now: float) -> bool:
        """Whether a principal other than ``principal`` drew in the last ``window`` s."""
        return any(p != principal and now - t < self.window for p, t in self._last)


class Account:
    """One principal's draw budgets (§4.4), shared by its connections and kept between them,
    so that reconnecting earns nothing: a rate *lane* per open slot (a lane handed back
    still owes what it spent, and is reused before a new one is made), one
    :class:`AbandonBudget`, a ``cap`` over all its slots, and the first-draw grace of
    admission (:meth:`grace`). The clock is the caller's.
    """

    __slots__ = (
        "_abandons",
        "_activity",
        "_burst",
        "_cap",
        "_free",
        "_grace_free",
        "_on_abandon",
        "_rate",
        "bound",
        "keep",
        "kept_until",
        "principal",
        "refs",
    )

    def __init__(
        self,
        limits: DrawLimits,
        now: float,
        *,
        principal: object = None,
        activity: Activity | None = None,
        cap: float | None = None,
        on_abandon: Callable[[float], object] | None = None,
        start: float | None = None,
        keep: float = 0.0,
    ) -> None:
        """Full budgets at ``now`` for ``limits`` (None: off), for ``principal``, whose draws
        go into ``activity``; ``cap``: its fresh draws a second; ``on_abandon``: called at
        each abandon; ``start``: its free abandons (None: the burst); ``keep``: seconds it
        is remembered after its last connection.

        Raises:
            ValueError: for a rate or cap that is not finite and above 0, or a burst
                below 1.
        """
        rate, abandon = limits.max_draw_rate, limits.abandon_rate
        if rate is not None:
            TokenBucket(rate, limits.draw_burst, now)  # checks the limits once, here
        self._rate = rate
        self._burst = limits.draw_burst
        self._abandons = (
            None
            if abandon is None
            else AbandonBudget(abandon, limits.abandon_burst, now, start=start)
        )
        self._cap = None if cap is None else TokenBucket(cap, max(1, math.ceil(cap)), now)
        self._free: list[TokenBucket] = []  # lanes handed back, still paying back
        self._grace_free = -math.inf
        self._activity = activity if activity is not None else Activity()
        self._on_abandon = on_abandon
        self.principal = principal
        self.bound = 0  #: lanes held by open slots
        self.refs = 0  #: connections of the principal holding this account
        self.keep = keep
        self.kept_until = -math.inf  #: remembered until then without a connection

    def bind(self, now: float) -> TokenBucket | None:
        """A lane for a slot opened at ``now`` (None without a rate limit)."""
        if self._rate is None:
            return None
        self.bound += 1
        self._free = [lane for lane in self._free if not lane.full(now)]
        if not self._free:
            return TokenBucket(self._rate, self._burst, now)
        lane = max(self._free, key=lambda b: b.level(now))
        self._free.remove(lane)
        return lane

    def unbind(self, lane: TokenBucket | None, now: float) -> None:
        """The slot holding ``lane`` closed at ``now``: the lane is handed back."""
        if lane is None:
            return
        self.bound -= 1
        if not lane.full(now):
            self._free.append(lane)

    def allows(self, lane: TokenBucket | None, now: float) -> bool:
        """Whether a fresh draw of the slot holding ``lane`` may start at ``now`` (then spent
        from its lane and the cap; if not, nothing is spent)."""
        if self._abandons is not None and not self._abandons.allows(now):
            return False
        if self._cap is not None and self._cap.wait(now) > 0:
            return False
        if lane is not None and not lane.take(now):
            return False
        return self._cap is None or self._cap.take(now)

    @property
    def capped(self) -> bool:
        """Whether a rate (``--max-draw-rate``) or a cap (``--principal-rate``) bounds its draws."""
        return self._rate is not None or self._cap is not None

    def owes(self, now: float) -> float:
        """Seconds from ``now`` until the abandons and the cap allow a fresh draw (0: now)."""
        owed = 0.0 if self._abandons is None else self._abandons.wait(now)
        return max(owed, 0.0 if self._cap is None else self._cap.wait(now))

    def abandoned(self, now: float) -> None:
        """A fresh draw of the principal died uncommitted at ``now``."""
        if self._abandons is not None:
            self._abandons.abandoned(now)
        if self._on_abandon is not None:
            self._on_abandon(now)

    def drew(self, now: float) -> None:
        """A fresh draw of the principal was accepted at ``now``."""
        self._activity.drew(self.principal, now)

    def contended(self, now: float) -> bool:
        """Whether another principal drew in the last share window."""
        return self._activity.others(self.principal, now)

    def grace(self, now: float, period: float) -> bool:
        """Whether a connection whose handshake ended at ``now`` gets the first-draw grace:
        yes (taking it) unless another one got it less than ``period`` seconds ago."""
        if now < self._grace_free:
            return False
        self._grace_free = now + period
        return True

    def settled(self, now: float) -> bool:
        """Whether nothing is left to remember at ``now`` (a new account would be the same)."""
        return (
            self.refs == 0
            and self.bound == 0
            and now >= self._grace_free
            and now >= self.kept_until
            and (self._abandons is None or self._abandons.full(now))
            and (self._cap is None or self._cap.full(now))
            and all(lane.full(now) for lane in self._free)
        )


P = TypeVar("P", bound=Hashable)


class Accounts(Generic[P]):
    """The :class:`Account` of each principal, kept while it has a connection, then while it
    owes something, for up to ``idle`` principals (the longest idle forgotten first)."""

    def __init__(self, limits: DrawLimits, *, idle: int = IDLE_ACCOUNTS) -> None:
        """Budgets of ``limits`` for every principal, ``idle`` (>= 0) kept without a connection.

        Raises:
            ValueError: for a negative ``idle``, or limits :class:`Account` refuses.
        """
        if idle < 0:
            raise ValueError("the idle accounts kept must be at least 0")
        Account(limits, 0.0)  # checks the limits once, here
        self.limits = limits
        self.idle = idle
        self.activity = Activity()
        self._accounts: dict[P, Account] = {}
        self._released: dict[P, None] = {}  # principals without a connection, oldest first

    def __len__(self) -> int:
        """Principals remembered (with a connection or still owing)."""
        return len(self._accounts)

    def __contains__(self, principal: object) -> bool:
        """Whether ``principal`` is remembered."""
        return principal in self._accounts

    def acquire(
        self,
        principal: P,
        now: float,
        *,
        cap: float | None = None,
        on_abandon: Callable[[float], object] | None = None,
        start: float | None = None,
        keep: float = 0.0,
    ) -> Account:
        """The account of ``principal`` for a new connection at ``now`` (one made now takes
        ``cap``, ``on_abandon``, ``start`` and ``keep``: :class:`Account`).

        Raises:
            ValueError: for a ``cap`` :class:`Account` refuses.
        """
        self._trim(now)
        account = self._accounts.get(principal)
        if account is None:
            account = Account(
                self.limits,
                now,
                principal=principal,
                activity=self.activity,
                cap=cap,
                on_abandon=on_abandon,
                start=start,
                keep=keep,
            )
            self._accounts[principal] = account
        self._released.pop(principal, None)
        account.refs += 1
        return account

    def release(self, principal: P, now: float) -> None:
        """A connection of ``principal`` ended at ``now`` (its slots closed first)."""
        account = self._accounts.get(principal)
        if account is None:
            return
        account.refs -= 1
        if not account.refs:
            account.kept_until = now + account.keep
            if account.settled(now):
                del self._accounts[principal]
            else:
                self._released[principal] = None
        self._trim(now)

    def _trim(self, now: float) -> None:
        """Forget the oldest released principals that are settled, and any beyond ``idle``."""
        while self._released:
            oldest = next(iter(self._released))
            if len(self._released) <= self.idle and not self._accounts[oldest].settled(now):
                break
            del self._released[oldest]
            del self._accounts[oldest]


class DrawnSlot(Protocol):
    """What :class:`DrawGate` reads of a worker's open slot."""

    @property
    def fence(self) -> WorkerSlotFence:
        """The slot's fencing state (its last STEP and COMMIT rounds)."""

    @property
    def drafts(self) -> tuple[int, ...]:
        """The drafts of its last fresh draw, until committed (none if it failed)."""


def pending(slot: DrawnSlot) -> bool:
    """Whether ``slot`` holds a fresh draw not committed (§4.4; a failed one is the worker's)."""
    return slot.fence.last_step_round > slot.fence.committed_round and bool(slot.drafts)


class DrawGate:
    """One connection's side of its principal's :class:`Account`: each open slot's lane, and
    after a ``DRAW_RATE_LIMITED`` refusal until when its next fresh STEP waits (§4.4)."""

    __slots__ = ("_lanes", "_wait_all", "_wait_slot", "account", "drew_at", "hold_until")

    def __init__(self, account: Account) -> None:
        """The gate of a connection of ``account``'s principal."""
        self.account = account
        self._lanes: dict[int, TokenBucket | None] = {}
        self._wait_all = 0.0
        self._wait_slot: dict[int, float] = {}
        #: When a fresh STEP was last let through (None: never): what protects from eviction.
        self.drew_at: float | None = None
        #: Until when the STEP held by :meth:`holds` waits (0: none is held for its budget).
        self.hold_until = 0.0

    def opened(self, slot: int, now: float) -> None:
        """``slot`` opened at ``now``: it takes a lane of the principal."""
        self._lanes[slot] = self.account.bind(now)

    def closed(self, index: int, slot: DrawnSlot, now: float, *, drawing: bool = False) -> None:
        """Slot ``index`` closed at ``now``: its lane goes back, and a draw it leaves
        uncommitted, served or still ``drawing``, is abandoned."""
        if drawing or pending(slot):
            self.account.abandoned(now)
        self.account.unbind(self._lanes.pop(index, None), now)
        self._wait_slot.pop(index, None)

    def lost(
        self, slots: Mapping[int, DrawnSlot], now: float, drawing: Collection[int] = ()
    ) -> None:
        """The connection ended at ``now`` with ``slots`` open (those in ``drawing`` mid-draw):
        each slot's uncommitted draw, at most one, is abandoned."""
        for index, slot in slots.items():
            self.closed(index, slot, now, drawing=index in drawing)

    def fresh(self, slot: int, now: float) -> bool:
        """Whether ``slot`` may start a fresh draw at ``now`` (spent if so; if not, the next
        fresh STEP's wait is recorded)."""
        lane = self._lanes.get(slot)
        if self.account.allows(lane, now):
            self.account.drew(now)
            self.drew_at = now
            return True
        owes = self.account.owes(now)
        if owes > 0:
            self._wait_all = now + owes
        elif lane is not None:
            self._wait_slot[slot] = now + lane.wait(now)
        return False

    def holds(self, step: Step, fence: WorkerSlotFence, now: float) -> bool:
        """Whether ``step`` (its slot's fencing state ``fence``) waits at ``now`` for the budget
        a refusal found empty (until :attr:`hold_until`); a retry or a refused STEP does not."""
        until = max(self._wait_all, self._wait_slot.get(step.slot, 0.0))
        if until <= now or fencing.worker_step(fence, step).action is not Action.ACCEPT:
            return False
        self.hold_until = until
        return True

    def reset(self, slot: DrawnSlot, now: float) -> None:
        """``slot`` was reset at ``now``: a draw it leaves uncommitted is abandoned."""
        if pending(slot):
            self.account.abandoned(now)

    def committed(self, slot: DrawnSlot, round_id: int, now: float) -> None:
        """``slot`` is about to commit ``round_id`` at ``now``: a round after its last STEP's
        passes a draw over, abandoned only while other principals draw (alone, a Spark side
        that could not use a proposal costs nobody anything)."""
        passed = round_id != slot.fence.last_step_round and pending(slot)
        if passed and self.account.contended(now):
            self.account.abandoned(now)


class Binder(Protocol):
    """Names a worker connection's principal at the end of its handshake (§2, §4.4)."""

    def ready_at(self, hello: Hello, now: float) -> float:
        """When a keyless ``hello`` may be answered (a new lineage waits its turn, §4.4)."""

    def bind(self, hello: Hello, key_id: str | None, now: float) -> tuple[Account, bytes]:
        """The account of the connection's principal (``key_id``: its key, None without keys)
        and the lineage token the worker's HELLO carries (empty with a key)."""
