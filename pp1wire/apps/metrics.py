"""Prometheus metrics for both daemons on ``prometheus_client``, each daemon's registry its own
and served at ``GET /metrics`` from its event loop; reading them back for the JSON summaries,
and every metric ``pp1-spark`` exports (:class:`SparkMetrics`)."""

from __future__ import annotations

import asyncio
import functools
import hmac
import urllib.request
from collections.abc import Mapping
from typing import Any

import prometheus_client as prom
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from pp1wire.aio.worker_metrics import SECONDS_BUCKETS


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


def by_label(counter: Counter) -> dict[str, int]:
    """A counter of events as ``{label values: count}`` (whole counts: it counts by one)."""
    out: dict[str, int] = {}
    for labels, value in _samples(counter):
        key = ",".join(labels.values())
        out[key] = out.get(key, 0) + int(value)
    return out


def print_summary(title: str, summary: Mapping[str, Any], width: int) -> None:
    """Print ``title``, then each entry of ``summary`` indented (floats to 4 places)."""
    print(title)
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key:{width}s} {shown}")


def bearer(request: bytes) -> bytes | None:
    """The token of a request head's ``Authorization: Bearer TOKEN`` header (any case), or None."""
    for line in request.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
    return None


async def serve(
    registry: CollectorRegistry, host: str, port: int, *, token: bytes | None = None
) -> asyncio.Server:
    """Serve ``GET /metrics`` (Prometheus text) on ``host:port`` (0: any free port), other paths
    404; with a ``token``, a request without it as its bearer token gets 401.

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
        given = bearer(request) if token is not None else None
        if token is not None and not hmac.compare_digest(given or b"", token):
            body = b"unauthorized\n"
            head = b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\n"
            head += b"Content-Type: text/plain\r\n"
        elif len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
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


def scrape_page(address: str, token: bytes | None = None) -> str:
    """The Prometheus text page a daemon serves at ``address`` (``token``: as bearer token).

    Raises:
        OSError: if it cannot be fetched within 5 s (``urllib.error.HTTPError``, an
            ``OSError``, for a 401).
    """
    request = urllib.request.Request(f"http://{address}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token.decode()}")
    with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 - http:// only
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


class SparkMetrics:
    """Every metric the Spark side exposes, in a registry of its own."""

    def __init__(self, max_depth: int) -> None:
        """Register the metrics."""
        r = self.registry = prom.CollectorRegistry()
        counter = functools.partial(prom.Counter, registry=r)
        histogram = functools.partial(prom.Histogram, registry=r)
        self.drafts = counter("pp1_spec_decode_draft_tokens", "Draft tokens verified.")
        self.accepted = counter("pp1_spec_decode_accepted_tokens", "Draft tokens accepted.")
        self.num_drafts = counter("pp1_spec_decode_num_drafts", "Proposals verified (rounds).")
        per_position = counter(
            "pp1_spec_decode_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the block (0-based).",
            ["position"],
        )
        # Made once: every position is exported from the start, with no lookup per round.
        self.per_position = [per_position.labels(position=str(i)) for i in range(max_depth)]
        self.tokens = counter("pp1_tokens", "Tokens committed.")
        self.requests = counter("pp1_requests", "Requests completed.")
        self.stopped = counter(
            "pp1_requests_stopped",
            "Requests stopped before their end, by reason (target_failed, group_failed).",
            ["reason"],
        )
        self.fallbacks = counter(
            "pp1_fallbacks", "Rounds decoded target-only, by reason.", ["reason"]
        )
        self.cuts = counter(
            "pp1_blocks_cut",
            "Rounds whose block a fault ended before its next row (the rows before it "
            "were verified), by the fault.",
            ["reason"],
        )
        self.faults = counter(
            "pp1_faults_by_row",
            "Proposals a fault ended, by the row it struck (0: before any row, a whole-block "
            "fallback; i: after i valid rows, a cut) and the fault.",
            ["row", "reason"],
        )
        self.rejected = counter(
            "pp1_frames_rejected", "Frames that failed validation, by code.", ["code"]
        )
        self.dropped = counter(
            "pp1_frames_dropped", "Late or duplicate frames dropped, by code.", ["code"]
        )
        self.reconnects = counter("pp1_reconnects", "Reconnections.")
        self.audit_failures = counter(
            "pp1_audit_failures",
            "Proposals whose drafts are not what the worker's own draw selects from its q.",
        )
        self.steps = counter(
            "pp1_steps", "Engine steps: rounds decided together (one target call)."
        )
        self.step_rounds = counter("pp1_step_rounds", "Rounds decided, summed over steps.")
        self.step_slots = counter(
            "pp1_step_slots", "Running requests at each step, summed over steps."
        )
        self.tp_votes_failed = counter(
            "pp1_tp_votes_failed",
            "TP group attempts voted down, by the reason each no-vote gave.",
            ["reason"],
        )
        self.tp_fanout_bytes = counter(
            "pp1_tp_fanout_bytes", "Proposal bytes this rank fanned out to the group."
        )
        self.tp_fanout_seconds = counter(
            "pp1_tp_fanout_seconds", "Seconds spent broadcasting proposals."
        )
        self.rtt = histogram(
            "pp1_proposal_round_trip_seconds",
            "STEP sent to proposal validated, seconds.",
            buckets=SECONDS_BUCKETS,
        )
