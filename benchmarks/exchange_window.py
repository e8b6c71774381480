"""How long a legitimate STEP of a sharded worker group waits behind STEPs that cannot match.

Run from the repository root: ``python benchmarks/exchange_window.py [--unmatched N ...]
[--reps R] [--json]``.

Two worker ranks (``pp1wire.tp.shard_worker.ShardedDrafting``, threads of this
process over one in-process gloo store, vocabulary 16) serve three group
sessions. Rank 0 first holds N STEPs of a session whose link exists on rank 0
only (they can never match) and N STEPs of a session that has a link on both
ranks but sends only on rank 0 (they could match, and never will); then the
legitimate session sends one STEP on each rank. Printed, per N: how long,
from its STEPs' submission, the legitimate STEP took to be answered on both
ranks (median, min-max over ``--reps``), its status (0: rows drawn), and how
many repetitions it was not answered within ``ANSWER_TIMEOUT`` (a failure:
those are left out of the times).
Before each exchange's window held only keys that can match, shared fairly
between sessions, 100 such STEPs delayed it by seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from extras import require

VOCAB = 16
MATCH_TIMEOUT = 5.0  # the worker's default: the unmatched STEPs outlive every measurement
SETTLE_TIMEOUT = 5.0  # twenty of the group's 0.25 s beats, each of which carries an exchange
ANSWER_TIMEOUT = MATCH_TIMEOUT + 5  # past it, the legitimate STEP counts as not answered


class _Slot:
    """What a draw reads of its slot."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.prefix = [1, 2, 3]
        self.eos = None


@contextmanager
def worker_ranks(match_timeout: float = MATCH_TIMEOUT) -> Iterator[list[Any]]:
    """Two ranks of a sharded worker group (threads), started; stopped at the end."""
    import torch.distributed as dist

    from pp1wire.apps.models import drafter_factory
    from pp1wire.q.layout import ShardLayout
    from pp1wire.tp.coordinator import GroupCoordinator
    from pp1wire.tp.shard_worker import ShardedDrafting

    store = dist.HashStore()  # type: ignore[attr-defined]
    layout = ShardLayout.even(VOCAB, 2)
    coords: list[Any] = [None, None]

    def join(rank: int) -> None:
        coords[rank] = GroupCoordinator.over_store(store, rank, 2, 10.0, layout)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    drafter = drafter_factory(VOCAB, 0)
    ranks = [ShardedDrafting(c, drafter, match_timeout=match_timeout) for c in coords]
    for r in ranks:
        r.start()
    try:
        yield ranks
    finally:
        stoppers = [threading.Thread(target=r.stop) for r in ranks]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(30)


def step_job(slot: int, seed: int = 7) -> Any:
    """A STEP (depth 2, dense) on ``slot``, as the server hands it to the group."""
    from pp1wire.wire.messages import Step
    from pp1wire.wire.replies import ReplyEncoder
    from pp1wire.wire.worker_events import DrawJob

    step = Step(
        session=1, slot=slot, generation=0, round=0, position=3, digest=0, depth=2,
        temperature=1.0, support=0, context=0,
    )  # fmt: skip
    return DrawJob(
        _Slot(seed), step, drafter=lambda _p: [], proposer=None, encoder=ReplyEncoder(1, step, 8)
    )


def legitimate_wait(ranks: list[Any], unmatched: int) -> tuple[float | None, list[int]]:
    """Seconds until the legitimate STEP is answered on both ranks, behind ``unmatched``
    STEPs of each hostile session on rank 0 (None: not within ``ANSWER_TIMEOUT``); the
    statuses it got.

    Raises:
        RuntimeError: if no exchange carries the hostile sessions within ``SETTLE_TIMEOUT``.
    """
    from pp1wire.tp.shard_worker import nonce_words

    tag = time.monotonic_ns().to_bytes(8, "little")
    lone, greedy, legit = (tag + bytes([k]) * 8 for k in (1, 2, 3))
    ranks[0].join(("lone", tag), lone)  # a session with a link on rank 0 only
    for r, rank in enumerate(ranks):
        rank.join(("greedy", tag, r), greedy)  # links on both ranks, STEPs on rank 0 only
        rank.join(("legit", tag, r), legit)
    for slot in range(unmatched):
        ranks[0].submit(("lone", tag), step_job(slot), lambda _res: None)
        ranks[0].submit(("greedy", tag, 0), step_job(slot), lambda _res: None)
    # The hostile STEPs are held (and older) once submit returns; what the legitimate
    # STEP must meet is the steady state, in which an exchange has carried the
    # one-link session and found it cannot match (the group's private record of it).
    settled = time.monotonic() + SETTLE_TIMEOUT
    while ranks[0]._matchable.get(nonce_words(lone)) is not False:
        if time.monotonic() >= settled:
            raise RuntimeError(f"no exchange carried the one-link session in {SETTLE_TIMEOUT} s")
        time.sleep(0.01)
    answered = threading.Event()
    statuses: list[int] = []
    lock = threading.Lock()

    def done(result: Any) -> None:
        with lock:
            statuses.append(result.status)
            if len(statuses) == len(ranks):
                answered.set()

    started = time.monotonic()
    for r, rank in enumerate(ranks):
        rank.submit(("legit", tag, r), step_job(0, seed=11), done)
    took = time.monotonic() - started if answered.wait(ANSWER_TIMEOUT) else None
    for r, rank in enumerate(ranks):  # the hostile STEPs go with their links
        for name in ("lone", "greedy", "legit"):
            rank.leave((name, tag) if name == "lone" else (name, tag, r))
    return took, statuses


def main() -> None:
    """Measure and print."""
    require("torch")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unmatched", type=int, nargs="+", default=[0, 100, 250])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out: dict[str, Any] = {}
    with worker_ranks() as ranks:
        for n in args.unmatched:
            waits, statuses, timeouts = [], [], 0
            for _ in range(args.reps):
                took, got = legitimate_wait(ranks, n)
                if took is None:
                    timeouts += 1
                else:
                    waits.append(took)
                statuses += got
            out[str(n)] = {
                "median_s": statistics.median(waits) if waits else None,
                "min_s": min(waits, default=None),
                "max_s": max(waits, default=None),
                "statuses": sorted(set(statuses)),
                "timeouts": timeouts,
            }
            if not args.json:
                w = out[str(n)]
                answered = (
                    f"answered in {w['median_s'] * 1e3:.1f} ms (min {w['min_s'] * 1e3:.1f}, "
                    f"max {w['max_s'] * 1e3:.1f})"
                    if waits
                    else "never answered"
                )
                failed = (
                    f", FAILED: not answered within {ANSWER_TIMEOUT:g} s in {timeouts} of "
                    f"{args.reps}"
                    if timeouts
                    else ""
                )
                print(
                    f"{n:5d} unmatched STEPs x 2 sessions: legitimate STEP {answered}, "
                    f"status {w['statuses']}{failed}"
                )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
