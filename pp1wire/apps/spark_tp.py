"""``pp1-spark --tp N``: a replicated Spark TP group's strategy, run by rank 0 over the worker
connection (each step one attempt of the group, ``docs/tp.md``), and the followers of the other
ranks; torch is imported by the caller only when ``--tp`` asks for ranks."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from pp1wire.apps.driver import GROUP_FAILED_EXIT, Plan, Round, Verdict, decide_scored
from pp1wire.apps.metrics import SparkMetrics
from pp1wire.errors import Pp1Error
from pp1wire.q.verify import RequestVerifier, TargetFn
from pp1wire.tp.fanout import Header, Item
from pp1wire.tp.group import Faults, RankReport, SparkGroup

FAULTS: Faults | None = None  # test hooks, set by pp1wire.testing.tp_faults (never a flag)


class ReplicatedStrategy:
    """Rank 0's strategy: each step is one attempt of the group (docs/tp.md)."""

    collective = False  # agree returns its argument: no hop off the event loop

    def __init__(self, group: SparkGroup, metrics: SparkMetrics) -> None:
        """Lead ``group``; count failed votes and the fan-out in ``metrics``."""
        self.group = group
        self.metrics = metrics
        self.reports: list[RankReport] = []

    def agree(self, local: list[int]) -> list[int]:
        """Rank 0 alone talks to the worker: nothing to agree on."""
        return local

    def decide(self, rounds: list[Round]) -> list[Verdict]:
        """One attempt for the step's rounds (:func:`decide_scored`).

        Raises:
            GroupFailedError: a collective failed or a target-only round was voted
                down for another reason than its target's failure.
        """
        return decide_scored(rounds, self._lead)

    def _lead(self, scored: list[Round]) -> list[Verdict]:
        stats, m = self.group.stats, self.metrics
        before = (stats.fanout_bytes, stats.fanout_seconds)
        items = [Item(r.state.index, r.state.verifier, r.proposal, r.round_id) for r in scored]
        decisions = self.group.lead(items) if items else []
        m.tp_fanout_bytes.inc(stats.fanout_bytes - before[0])
        m.tp_fanout_seconds.inc(stats.fanout_seconds - before[1])
        out = []
        for d in decisions:
            if d.result is not None:
                out.append(Verdict(d.result))
                continue
            m.tp_votes_failed.labels(reason=d.reason).inc()
            out.append(Verdict(None, d.failures[0][1], stop=d.target_failed))
        return out

    def finish(self) -> None:
        """End the group's attempts; keeps every rank's report for the summary.

        Raises:
            GroupFailedError: a collective failed.
        """
        self.reports = self.group.lead_stop()

    def summary(self) -> dict[str, Any]:
        """The ``tp_*`` keys of rank 0's summary."""
        group, reports = self.group, self.reports
        return {
            "tp": group.world,
            "tp_attempts": group.stats.attempts,
            "tp_votes_failed_by_reason": dict(group.stats.votes_failed),
            "tp_fanout_bytes": group.stats.fanout_bytes,
            "tp_fanout_seconds": group.stats.fanout_seconds,
            "tp_rounds_per_attempt": group.stats.entries / max(group.stats.attempts - 1, 1),
            # None when the group failed before it could compare.
            "tp_prefixes_agree": (
                len({r.prefixes_digest for r in reports}) == 1 if reports else None
            ),
            "tp_ranks": [{k: getattr(r, k) for k in _RANK_KEYS} for r in reports],
        }


#: What rank 0's summary says of each rank's report.
_RANK_KEYS = ("rank", "collectives", "attempts", "fanout_bytes", "fanout_seconds", "bulk")


def follow(args: argparse.Namespace, group: SparkGroup, target: TargetFn, plan: Plan) -> int:
    """A rank other than 0: follow rank 0's attempts until it stops; returns the exit code
    (signal handlers only on the main thread, not in a group of threads under test)."""

    def verifier_for(header: Header) -> RequestVerifier:
        verifier = group.held.get(header.request)
        if verifier is None:
            verifier = plan.verifier(
                header.request, target, session=header.session, generation=header.generation
            )
        elif (verifier.session, verifier.generation) != (header.session, header.generation):
            # Rank 0 rebuilt its verifier when it (re)opened the slot under this generation.
            verifier.rebuild(verifier.committed, header.generation)
            verifier.session = header.session
        return verifier

    # Rank 0 drives shutdown, so a signal only starts a grace period: leaving at once would
    # fail the group's clean stop, never leaving could outlive a dead rank 0.
    grace = args.group_timeout + 1.0

    def stop_later(signum: int, _frame: object) -> None:
        timer = threading.Timer(grace, os._exit, [GROUP_FAILED_EXIT])
        timer.daemon = True
        timer.start()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop_later)
    try:
        group.follow(verifier_for)
    except Pp1Error as exc:
        print(f"pp1-spark rank {group.rank}: {exc}", file=sys.stderr, flush=True)
        return GROUP_FAILED_EXIT
    group.coord.leave()
    return 0
