"""Who a worker's budgets belong to (``docs/protocol.md`` §2, §4.4; sans-IO): a key's ID, or
without a key a *lineage* (a token the worker issues and the peer presents again), whose births
per source address are paced after an abandon (:class:`Births`); callers pass ``now``."""

from __future__ import annotations

import ipaddress
import math
import secrets
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Final

from pp1wire.wire.messages import LINEAGE_SIZE

#: The IPv6 prefix length one source address stands for (``--ipv6-prefix``).
IPV6_PREFIX: Final = 64
#: New lineages one address may start a second and at once, while paced (an abandon in
#: the last :data:`LINEAGE_WINDOW_S` seconds).
LINEAGE_RATE: Final = 1.0
LINEAGE_BURST: Final = 16
LINEAGE_WINDOW_S: Final = 10.0
#: The free abandons a lineage born while its address is paced starts with.
PACED_LINEAGE_FREE: Final = 1.0
#: Seconds a lineage owing nothing is remembered after its last connection.
LINEAGE_KEEP_S: Final = 600.0


def address_key(address: str, ipv6_prefix: int = IPV6_PREFIX) -> str:
    """The source address a peer at ``address`` counts as (§2): IPv4 (also IPv4-mapped) as
    itself, IPv6 as its ``/ipv6_prefix`` network (zone dropped), anything else as itself.

    Raises:
        ValueError: for an ``ipv6_prefix`` outside 1..128.
    """
    if not 1 <= ipv6_prefix <= 128:
        raise ValueError(f"an IPv6 prefix length is 1..128, not {ipv6_prefix}")
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, ipv6_prefix), strict=False))
    return str(ip)


@dataclass(frozen=True)
class Principal:
    """A principal (§2): ``kind`` ``"key"`` (``name`` the key ID) or ``"lineage"`` (the token
    in hex); ``group``, not part of its identity, is a lineage's source address."""

    kind: str
    name: str
    group: Hashable = field(default=None, compare=False)

    @classmethod
    def of_key(cls, key_id: str) -> Principal:
        """The principal of the connections that authenticated with key ``key_id``."""
        return cls("key", key_id)

    @classmethod
    def of_lineage(cls, token: bytes, address: str = "") -> Principal:
        """The principal of the keyless connections of lineage ``token`` (one from ``address``)."""
        return cls("lineage", token.hex(), address)

    def __str__(self) -> str:
        """``key:ID`` or ``lineage:TOKEN`` (for logs)."""
        return f"{self.kind}:{self.name}"


def draw_group(principal: Principal | None) -> Hashable:
    """Who ``principal`` shares the draw threads with (§4.4): a key alone, the lineages of
    one address together (opening more of them gets a peer no more threads)."""
    if principal is None or principal.kind == "key":
        return principal
    return ("address", principal.group)


def new_lineage() -> bytes:
    """A fresh lineage token: random, so that no other peer can present it."""
    return secrets.token_bytes(LINEAGE_SIZE)


@dataclass(frozen=True)
class PrincipalPolicy:
    """The worker's settings of §2 and §4.4 that its configuration does not carry: each
    principal's cap on fresh draws a second (``rate``; ``rates`` per key ID; None: no cap),
    the IPv6 prefix, the births of lineages (:class:`Births`), and how long a lineage
    owing nothing is remembered (``lineage_keep``).
    """

    rate: float | None = None
    rates: Mapping[str, float | None] = field(default_factory=dict)
    ipv6_prefix: int = IPV6_PREFIX
    lineage_rate: float = LINEAGE_RATE
    lineage_burst: int = LINEAGE_BURST
    lineage_keep: float = LINEAGE_KEEP_S

    def __post_init__(self) -> None:
        """Check every setting.

        Raises:
            ValueError: for a rate not finite and above 0, a prefix outside 1..128, a burst
                below 1 or a negative ``lineage_keep``.
        """
        for r in [self.rate, self.lineage_rate, *self.rates.values()]:
            if r is not None and not (math.isfinite(r) and r > 0):
                raise ValueError(f"a rate must be finite and above 0, not {r}")
        if not 1 <= self.ipv6_prefix <= 128:
            raise ValueError(f"an IPv6 prefix length is 1..128, not {self.ipv6_prefix}")
        if self.lineage_burst < 1 or not self.lineage_keep >= 0:
            raise ValueError("a lineage burst is at least 1 and its keep time at least 0")

    def cap(self, principal: Principal) -> float | None:
        """The fresh draws a second ``principal`` may ask for (None: no cap)."""
        if principal.kind == "key" and principal.name in self.rates:
            return self.rates[principal.name]
        return self.rate


class Births:
    """When new lineages of each address are born (§4.4): at once, unless one of its
    lineages abandoned a draw in the last ``window`` seconds (:meth:`spoil`); then at most
    ``burst`` at once and ``rate`` a second, in the order they asked (:meth:`ready_at`).
    """

    def __init__(
        self,
        rate: float = LINEAGE_RATE,
        burst: int = LINEAGE_BURST,
        window: float = LINEAGE_WINDOW_S,
    ) -> None:
        """``rate`` births a second per address, ``burst`` at once, for ``window`` seconds.

        Raises:
            ValueError: for a rate, burst or window out of range.
        """
        if not (math.isfinite(rate) and rate > 0) or burst < 1:
            raise ValueError("births need a finite rate above 0 and a burst of at least 1")
        if not (math.isfinite(window) and window >= 0):
            raise ValueError("the births' window must be finite and at least 0")
        self.rate = rate
        self.burst = burst
        self.window = window
        self._spoiled: dict[Hashable, float] = {}  # address -> pacing ends then
        # Per address: (free births, when counted), and the tickets waiting in order.
        self._level: dict[Hashable, tuple[float, float]] = {}
        self._queue: dict[Hashable, dict[Hashable, None]] = {}
        self._born: set[tuple[Hashable, Hashable]] = set()

    def __len__(self) -> int:
        """Addresses remembered (paced, with tickets waiting, or births not earned back)."""
        return len(self._level) + len(self._spoiled)

    def paced(self, address: Hashable, now: float) -> bool:
        """Whether ``address``'s births are paced at ``now``."""
        return self._spoiled.get(address, -math.inf) > now or bool(self._queue.get(address))

    def spoil(self, address: Hashable, now: float) -> None:
        """A lineage of ``address`` abandoned a draw at ``now``: pace its births a while."""
        self._spoiled[address] = max(self._spoiled.get(address, now), now + self.window)

    def ready_at(self, address: Hashable, ticket: Hashable, now: float) -> float:
        """When ``ticket`` (a connection of ``address`` asking for a new lineage) is born:
        ``now`` if it is, else when to ask again (while paced, births go in queue order)."""
        if not self.paced(address, now):
            self._spoiled.pop(address, None)
            return now
        level, stamp = self._level.get(address, (float(self.burst), now))
        level = min(float(self.burst), level + max(0.0, now - stamp) * self.rate)
        queue = self._queue.setdefault(address, {})
        if (address, ticket) not in self._born:
            queue.setdefault(ticket, None)
        while queue and level >= 1.0 - 1e-9:
            head = next(iter(queue))
            del queue[head]
            self._born.add((address, head))
            level -= 1.0
        self._level[address] = (level, now)
        if (address, ticket) in self._born:
            self._born.discard((address, ticket))
            self._forget(address)
            return now
        ahead = list(queue).index(ticket)
        return now + (ahead + 1 - level) / self.rate

    def cancel(self, address: Hashable, ticket: Hashable) -> None:
        """``ticket`` gives up: out of the queue, or its birth unused."""
        queue = self._queue.get(address)
        if queue is not None:
            queue.pop(ticket, None)
        self._born.discard((address, ticket))
        self._forget(address)

    def _forget(self, address: Hashable) -> None:
        """Drop an address with nobody waiting whose births are all earned back."""
        if self._queue.get(address):
            return
        self._queue.pop(address, None)
        level = self._level.get(address)
        if level is not None and level[0] >= self.burst - 1e-9:
            del self._level[address]

    def trim(self, now: float) -> None:
        """Forget the addresses with nobody waiting and births earned back, and ended pacing."""
        for address, until in list(self._spoiled.items()):
            if until <= now:
                del self._spoiled[address]
        for address, (level, stamp) in list(self._level.items()):
            if self._queue.get(address):
                continue
            if level + max(0.0, now - stamp) * self.rate >= self.burst - 1e-9:
                del self._level[address]
                self._queue.pop(address, None)
