"""Prometheus text-format metrics with no dependency: counters, gauges, histograms.

Names follow the style ``pp1_spec_decode_draft_tokens_total``. A
:class:`Registry` renders the text exposition format (version 0.0.4) that
:func:`serve` answers on ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterable, Sequence
from typing import TypeVar

LabelKey = tuple[tuple[str, str], ...]


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(key: LabelKey, extra: Iterable[tuple[str, str]] = ()) -> str:
    items = [*key, *extra]
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in items)
    return "{" + body + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelKey:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple((k, str(labels[k])) for k in self.label_names)

    def samples(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> str:
        head = f"# HELP {self.name} {self.help}\n# TYPE {self.name} {self.kind}\n"
        return head + "".join(line + "\n" for line in self.samples())


class Counter(_Metric):
    """A monotonically increasing count."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        """Create a counter (no samples until first incremented, unless unlabelled)."""
        super().__init__(name, help_text, labels)
        self._values: dict[LabelKey, float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (must be >= 0).

        Raises:
            ValueError: for a negative amount or wrong label names.
        """
        if amount < 0:
            raise ValueError("counters only go up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """Current value for these labels (0 if never incremented)."""
        return self._values.get(self._key(labels), 0.0)

    def total(self) -> float:
        """Sum over every label combination."""
        return sum(self._values.values())

    def by_label(self) -> dict[str, float]:
        """Values keyed by the first label's value (for summaries)."""
        return {k[0][1] if k else "": v for k, v in self._values.items()}

    def samples(self) -> list[str]:
        """Exposition lines."""
        return [f"{self.name}{_labels(k)} {_fmt(v)}" for k, v in sorted(self._values.items())]


class Gauge(_Metric):
    """A value that goes up and down."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str) -> None:
        """Create a gauge at 0."""
        super().__init__(name, help_text)
        self._value = 0.0

    def set(self, value: float) -> None:
        """Set the value."""
        self._value = float(value)

    def add(self, delta: float) -> None:
        """Add ``delta`` (may be negative)."""
        with self._lock:
            self._value += delta

    def value(self) -> float:
        """Current value."""
        return self._value

    def samples(self) -> list[str]:
        """Exposition lines."""
        return [f"{self.name} {_fmt(self._value)}"]


DEFAULT_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class Histogram(_Metric):
    """Cumulative histogram of observations (seconds by convention)."""

    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, buckets: Sequence[float] = DEFAULT_BUCKETS
    ) -> None:
        """Create a histogram with the given upper bounds (``+Inf`` is implicit)."""
        super().__init__(name, help_text)
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._n = 0
        self._all: list[float] = []

    def observe(self, value: float) -> None:
        """Record one observation."""
        with self._lock:
            i = 0
            while i < len(self.bounds) and value > self.bounds[i]:
                i += 1
            self._counts[i] += 1
            self._sum += value
            self._n += 1
            if len(self._all) < 100_000:
                self._all.append(value)

    @property
    def count(self) -> int:
        """Number of observations."""
        return self._n

    def quantile(self, q: float) -> float:
        """Empirical quantile of the first 100,000 observations (NaN if none)."""
        if not self._all:
            return float("nan")
        ordered = sorted(self._all)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def samples(self) -> list[str]:
        """Exposition lines."""
        out = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self._counts, strict=True):
            running += n
            out.append(f"{self.name}_bucket{_labels((), [('le', _fmt(bound))])} {running}")
        out.append(f"{self.name}_sum {_fmt(self._sum)}")
        out.append(f"{self.name}_count {self._n}")
        return out


_M = TypeVar("_M", bound=_Metric)


class Registry:
    """A set of metrics rendered together."""

    def __init__(self) -> None:
        """An empty registry."""
        self._metrics: list[_Metric] = []

    def add(self, metric: _M) -> _M:
        """Register and return ``metric``.

        Raises:
            ValueError: if a metric of that name is already registered.
        """
        if any(m.name == metric.name for m in self._metrics):
            raise ValueError(f"duplicate metric {metric.name}")
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        """The whole exposition text."""
        return "".join(m.render() for m in self._metrics)


async def serve(registry: Registry, host: str, port: int) -> asyncio.Server:
    """Serve ``GET /metrics`` (Prometheus text) on ``host:port``; other paths get 404.

    Raises:
        OSError: if the address cannot be bound.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5.0)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        line = request.split(b"\r\n", 1)[0].split()
        if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
            body = registry.render().encode()
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
        else:
            body = b"not found\n"
            head = b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n"
        writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        try:
            await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)
