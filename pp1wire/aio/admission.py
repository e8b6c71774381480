"""Who a full worker admits, and whom it replaces (``docs/protocol.md`` §2): a newcomer replaces
a connection still in its handshake or, once authenticated, one doing no useful work (only a
fresh draw protects); at its handshake's end a connection is bound to its principal."""

from __future__ import annotations

import select
import time
from collections.abc import Hashable
from functools import partial
from typing import Final, Generic, Protocol, TypeVar

from pp1wire.aio.worker_metrics import WorkerMetrics
from pp1wire.errors import ErrorCode
from pp1wire.wire.budgets import IDLE_ACCOUNTS, Account, Accounts, Binder, DrawLimits
from pp1wire.wire.messages import Hello
from pp1wire.wire.principals import (
    PACED_LINEAGE_FREE,
    Births,
    Principal,
    PrincipalPolicy,
    new_lineage,
)
from pp1wire.wire.worker_core import WorkerProtocol
from pp1wire.wire.worker_events import GroupDraws

#: How long after its handshake a connection that has not drawn is protected from
#: replacement (one connection per principal per --slot-idle-timeout).
HANDSHAKE_GRACE_S: Final = 1.0
#: A connection that had no fresh draw for this long may be replaced by a newcomer.
SLOT_IDLE_S: Final = 10.0
# A peer gone (its FIN or an error received) although its connection is not read.
_GONE: Final = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


class Peer(Hashable, Protocol):
    """What admission reads of, and does to, a connection of the server."""

    address: str  # the source address it counts as (an IPv6 address's network)
    principal: Principal | None  # bound at the end of its handshake
    accepted_at: float
    authenticated_at: float
    grace_until: float  # protected from replacement until then, if it has not drawn

    @property
    def core(self) -> WorkerProtocol | None:
        """The connection's protocol core (None if refused at accept)."""

    @property
    def authenticated(self) -> bool:
        """The peer completed the handshake (HELLO, and AUTH when a key is set)."""

    def fileno(self) -> int | None:
        """The socket descriptor (None once closed)."""

    def peer_left(self) -> None:
        """End the connection: its peer is gone."""

    def evict(self) -> None:
        """Close the connection (``CONNECTION_LIMIT``) to make room for a newcomer."""

    def refuse(self, code: ErrorCode) -> None:
        """Close the authenticated connection with a fatal ERROR ``code``."""


C = TypeVar("C", bound=Peer)


class Admission(Generic[C]):
    """The admission rules of a server whose connections are ``C`` (see the module)."""

    conns: set[C]  # open: counted against the limits
    closing: set[C]  # closed, flushing what was queued
    max_connections: int
    max_per_address: int | None
    slot_idle_timeout: float
    handshake_grace: float
    stopping: bool
    group: GroupDraws | None
    metrics: WorkerMetrics
    accounts: Accounts[Principal]
    births: Births
    policy: PrincipalPolicy

    def init_principals(self, config: DrawLimits, policy: PrincipalPolicy | None) -> None:
        """The principals' accounts (``config``'s budgets, ``policy``'s caps) and births."""
        self.policy = policy or PrincipalPolicy()
        self.accounts = Accounts(config)
        self.births = Births(self.policy.lineage_rate, self.policy.lineage_burst)

    def binder(self, conn: C) -> Binder:
        """What ``conn``'s protocol core asks at the end of its handshake (§2, §4.4)."""
        return _Binder(self, conn)

    def hello_ready_at(self, conn: C, hello: Hello, now: float) -> float:
        """When ``conn``'s keyless ``hello`` may be answered (§4.4): at once for a lineage this
        worker knows, else at its address's next birth, in the order its newcomers asked."""
        if hello.lineage and Principal.of_lineage(hello.lineage) in self.accounts:
            return now
        if len(self.births) > IDLE_ACCOUNTS:
            self.births.trim(now)  # addresses whose births are long earned back
        return self.births.ready_at(conn.address, conn, now)

    def bind_principal(
        self, conn: C, hello: Hello, key_id: str | None, now: float
    ) -> tuple[Account, bytes]:
        """``conn``'s principal at the end of its handshake (§2): its key ID, else the lineage it
        presented if known, else a new one (§4.4), its account held until :meth:`unbind`; and
        the lineage token the HELLO answer carries."""
        self.births.cancel(conn.address, conn)
        known = bool(hello.lineage) and Principal.of_lineage(hello.lineage) in self.accounts
        token = b"" if key_id is not None else hello.lineage if known else new_lineage()
        principal = (
            Principal.of_key(key_id)
            if key_id is not None
            else Principal.of_lineage(token, conn.address)
        )
        conn.principal = principal
        paced = key_id is None and not known and self.births.paced(conn.address, now)
        account = self.accounts.acquire(
            principal,
            now,
            cap=self.policy.cap(principal),
            on_abandon=None if key_id is not None else partial(self.births.spoil, conn.address),
            start=PACED_LINEAGE_FREE if paced else None,  # a loop's next lineage: little
            keep=self.policy.lineage_keep if key_id is None else 0.0,
        )
        return account, token

    def unbind(self, conn: C, now: float) -> None:
        """``conn`` ended: its account is released, its place among the births given up."""
        self.births.cancel(conn.address, conn)
        if conn.principal is not None:
            self.accounts.release(conn.principal, now)

    def _scopes(self, conn: C) -> list[tuple[list[C], int]]:
        """The connection groups ``conn`` counts in, each with its limit."""
        scopes: list[tuple[list[C], int]] = []
        if self.max_per_address is not None:
            same = [c for c in self.conns if c.address == conn.address]
            scopes.append((same, self.max_per_address))
        scopes.append((list(self.conns), self.max_connections))
        return scopes

    def closed_conn(self, conn: C) -> None:
        """``conn`` is closing: it no longer counts against the limits (nor is evicted)."""
        if conn in self.conns:
            self.conns.discard(conn)
            self.closing.add(conn)
            self.metrics.connections.set(len(self.conns))

    def reap_gone(self) -> None:
        """End every connection whose peer has left (its FIN, a reset), read or not: one not
        being read would otherwise count until it is read again."""
        poller = select.poll()
        by_fd: dict[int, C] = {}
        for conn in self.conns:
            fd = conn.fileno()
            if fd is not None and fd >= 0:
                by_fd[fd] = conn
                poller.register(fd, _GONE)
        for fd, _ in poller.poll(0):
            by_fd[fd].peer_left()

    def replaceable(self, conn: C, now: float) -> bool:
        """Whether ``conn`` may be evicted for an authenticated newcomer: authenticated, not
        drawing, and no fresh draw for ``slot_idle_timeout`` s (or past its first-draw grace).
        Only a fresh draw protects: anything else costs the worker nothing (§2)."""
        core = conn.core
        if core is None or not conn.authenticated or core.drawing:
            return False
        drew = core.gate.drew_at
        if drew is None:
            return now >= conn.grace_until
        return now - drew >= self.slot_idle_timeout

    def admit(self, new: C, now: float) -> ErrorCode | None:
        """Make room for ``new`` at accept (evicting a handshake if needed), or the
        code it is refused with. Nobody authenticated is evicted here."""
        if self.stopping:
            return ErrorCode.SHUTTING_DOWN
        if any(len(members) + 1 > limit for members, limit in self._scopes(new)):
            self.reap_gone()  # over a limit, credit aside: first forget who has left
        evict: list[C] = []
        for scope, limit in self._scopes(new):
            members = [c for c in scope if c not in evict]
            credit = sum(1 for c in members if self.replaceable(c, now))
            over = len(members) + 1 - (limit + credit)
            if over <= 0:
                continue  # room, or admitted on credit: see handshake_done
            pending = sorted(
                (c for c in members if not c.authenticated), key=lambda c: c.accepted_at
            )
            if len(pending) < over:
                return ErrorCode.CONNECTION_LIMIT
            evict += pending[:over]
        for victim in evict:
            victim.evict()
        return None

    def handshake_done(self, conn: C) -> None:
        """``conn`` authenticated: over a limit, evict the replaceable peer whose last draw (or
        handshake) is oldest, or close ``conn`` if none is left. A sharded link joins its
        group session first (``GROUP_IN_USE``: closed, evicting no one)."""
        core = conn.core
        if self.group and core and not core.closed and not self.group.join(conn, core.limits.group):
            conn.refuse(ErrorCode.GROUP_IN_USE)
            return
        now = time.monotonic()
        conn.authenticated_at = now
        if any(
            len([c for c in members if c.authenticated]) > limit
            for members, limit in self._scopes(conn)
        ):
            self.reap_gone()
        for members, limit in self._scopes(conn):
            authenticated = [c for c in members if c.authenticated]
            if len(authenticated) <= limit:
                continue
            victims = [c for c in authenticated if c is not conn and self.replaceable(c, now)]
            victim = min(victims, key=_worked_at, default=None)
            if victim is None:  # the peers it was admitted for became busy meanwhile
                conn.refuse(ErrorCode.CONNECTION_LIMIT)
                return
            victim.evict()
        # Time for its first draw, once per principal and period however often it reconnects.
        if core is not None and core.gate.account.grace(now, self.slot_idle_timeout):
            conn.grace_until = now + self.handshake_grace


def _worked_at(conn: Peer) -> float:
    """When ``conn`` last did work that protects it: its last fresh draw, else its handshake."""
    core = conn.core
    drew = core.gate.drew_at if core is not None else None
    return conn.authenticated_at if drew is None else max(drew, conn.authenticated_at)


class _Binder(Generic[C]):
    """A :class:`~pp1wire.wire.budgets.Binder` for one connection of an admission."""

    def __init__(self, admission: Admission[C], conn: C) -> None:
        self.admission, self.conn = admission, conn

    def ready_at(self, hello: Hello, now: float) -> float:
        return self.admission.hello_ready_at(self.conn, hello, now)

    def bind(self, hello: Hello, key_id: str | None, now: float) -> tuple[Account, bytes]:
        return self.admission.bind_principal(self.conn, hello, key_id, now)
