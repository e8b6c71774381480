"""Every metric the worker exposes, in a registry of its own (docs/operators.md §4)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Round trips and draws on loopback span 50 us to seconds.
SECONDS_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class WorkerMetrics:
    """Every metric the worker exposes, in a registry of its own."""

    def __init__(self) -> None:
        """Register the worker's metrics."""
        r = self.registry = CollectorRegistry()
        counter = functools.partial(Counter, registry=r)
        gauge = functools.partial(Gauge, registry=r)
        histogram = functools.partial(Histogram, registry=r)
        self.connections = gauge("pp1_worker_open_connections", "Open connections.")
        self.accepted = counter("pp1_worker_connections", "Connections accepted.")
        self.steps = counter("pp1_worker_steps", "STEPs answered with a fresh draw.")
        self.replays = counter("pp1_worker_replays", "Retried STEPs answered from the cache.")
        self.rows = counter("pp1_worker_rows", "REPLY rows sent.")
        self.commits = counter(
            "pp1_worker_commits",
            "COMMITs applied, by round: proposed (a drawn proposal's round) or target_only.",
            ["round"],
        )
        self.committed_tokens = counter(
            "pp1_worker_committed_tokens", "Tokens appended to slot prefixes by COMMIT."
        )
        self.reply_bytes = counter("pp1_worker_reply_bytes", "Bytes of replies sent.")
        self.failed_steps = counter(
            "pp1_worker_failed_proposals", "Replies sent with a failure status, by code.", ["code"]
        )
        self.refusals = counter(
            "pp1_worker_refusals", "Messages refused with an ERROR, by code.", ["code"]
        )
        self.propose_seconds = histogram(
            "pp1_worker_propose_seconds",
            "Time to draw one proposal block.",
            buckets=SECONDS_BUCKETS,
        )
        self.evictions = counter(
            "pp1_worker_evictions", "Connections closed to make room for a newcomer."
        )
        self.drafter_errors = counter(
            "pp1_worker_drafter_errors",
            "Draws stopped by an unexpected exception in the drafter (or a group's proposer), "
            "by exception class; answered with a COMPLETION of status internal.",
            ["error"],
        )
        self.draws_queued = gauge("pp1_worker_draws_queued", "Draws waiting for a draw thread.")
        self.prepared_blocks = counter(
            "pp1_worker_prepared_blocks",
            "Next blocks prepared while the Spark side verified (--prepare), by hypothesis.",
            ["hypothesis"],
        )
        self.prepared_used = counter(
            "pp1_worker_prepared_used",
            "Prepared blocks served to the STEP that asked for exactly them, by hypothesis.",
            ["hypothesis"],
        )


__all__ = ["SECONDS_BUCKETS", "WorkerMetrics"]
