"""Prometheus metrics for both daemons, on ``prometheus_client``.

Each daemon keeps its own :class:`prometheus_client.CollectorRegistry` (so two
servers in one process never share counters) and serves it at ``GET /metrics``
from the daemon's own event loop. :func:`by_label` and :func:`total` read a
counter back for the daemons' JSON summaries.
"""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest


def _samples(counter: Counter) -> list[tuple[dict[str, str], float]]:
    out = []
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out.append((sample.labels, sample.value))
    return out


def total(counter: Counter) -> float:
    """The sum of a counter over all its label values."""
    return sum(value for _, value in _samples(counter))


def by_label(counter: Counter) -> dict[str, float]:
    """A one-label counter as ``{label value: count}`` (label values never seen are absent)."""
    out: dict[str, float] = {}
    for labels, value in _samples(counter):
        key = ",".join(labels.values())
        out[key] = out.get(key, 0.0) + value
    return out


async def serve(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """Serve ``GET /metrics`` (Prometheus text) on ``host:port``; other paths get 404.

    Port 0 binds any free port: read it from the returned server's sockets.

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
            body = generate_latest(registry)
            head = f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\n".encode()
        else:
            body = b"not found\n"
            head = b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n"
        writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        try:
            await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


def scrape_page(address: str) -> str:
    """The Prometheus text page a daemon serves at ``address`` (HOST:PORT).

    Raises:
        OSError: if it cannot be fetched within 5 s.
    """
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return str(response.read().decode())


def scrape(address: str, name: str) -> float:
    """One unlabelled sample of the page at ``address`` (0 if absent).

    Raises:
        OSError: as :func:`scrape_page`.
    """
    for line in scrape_page(address).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
