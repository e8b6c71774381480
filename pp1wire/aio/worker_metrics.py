"""Every metric the worker exposes, in a registry of its own (README: Metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SECONDS_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class WorkerMetrics:
    """Every metric the worker exposes, in a registry of its own."""

    def __init__(self) -> None:
        """Register the worker's metrics."""
        r = self.registry = CollectorRegistry()
        self.connections = Gauge("pp1_worker_open_connections", "Open connections.", registry=r)
        self.accepted = Counter("pp1_worker_connections", "Connections accepted.", registry=r)
        self.steps = Counter("pp1_worker_steps", "STEPs answered with a fresh draw.", registry=r)
        self.replays = Counter(
            "pp1_worker_replays", "Retried STEPs answered from the cache.", registry=r
        )
        self.rows = Counter("pp1_worker_rows", "REPLY rows sent.", registry=r)
        self.commits = Counter(
            "pp1_worker_commits",
            "COMMITs applied, by round: proposed (a drawn proposal's round) or target_only.",
            ["round"],
            registry=r,
        )
        self.committed_tokens = Counter(
            "pp1_worker_committed_tokens", "Tokens appended to slot prefixes by COMMIT.", registry=r
        )
        self.reply_bytes = Counter("pp1_worker_reply_bytes", "Bytes of replies sent.", registry=r)
        self.failed_steps = Counter(
            "pp1_worker_failed_proposals",
            "Replies sent with a failure status, by code.",
            ["code"],
            registry=r,
        )
        self.refusals = Counter(
            "pp1_worker_refusals", "Messages refused with an ERROR, by code.", ["code"], registry=r
        )
        self.propose_seconds = Histogram(
            "pp1_worker_propose_seconds",
            "Time to draw one proposal block.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "pp1_worker_evictions",
            "Connections closed to make room for a newcomer.",
            registry=r,
        )
        self.drafter_errors = Counter(
            "pp1_worker_drafter_errors",
            "Draws stopped by an unexpected exception in the drafter (or a group's proposer), "
            "by exception class; answered with a COMPLETION of status internal.",
            ["error"],
            registry=r,
        )
        self.draws_queued = Gauge(
            "pp1_worker_draws_queued", "Draws waiting for a draw thread.", registry=r
        )


#: Frames one connection may handle before the loop serves the others.


__all__ = ["SECONDS_BUCKETS", "WorkerMetrics"]
