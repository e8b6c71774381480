"""Running ``pp1-spark`` inside the test process: one rank, or a whole group as threads.

Each rank runs :func:`pp1wire.apps.spark.run_rank` on an event loop of its own;
a group's ranks are threads with gloo groups over one in-process store
(:func:`run_in_threads`): the same collectives as rank
processes, without starting any. Process-level behaviour (the ``--tp``
launcher, torchrun, exit statuses) is tested separately with real processes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pp1wire.apps import spark
from pp1wire.apps.models import target_factory
from pp1wire.apps.settings import parse

from .test_verify import _chi_square_ok

_T = TypeVar("_T")


def run_in_threads(
    world: int, body: Callable[[Any], _T], *, timeout: float = 30.0, layout: Any = None
) -> list[_T | BaseException]:
    """Run ``body(coord)`` on every rank of a fresh in-process gloo group, one thread per
    rank (the thread of rank r is named ``rank-r``): each rank's result, or the exception
    it raised, in rank order."""
    import torch.distributed as dist

    from pp1wire.tp.coordinator import GroupCoordinator

    store = dist.HashStore()
    results: list[_T | BaseException] = [RuntimeError("rank did not finish")] * world

    def rank_main(rank: int) -> None:
        try:
            coord = GroupCoordinator.over_store(store, rank, world, timeout, layout)
            results[rank] = body(coord)
        except BaseException as exc:  # reported to the caller, per rank
            results[rank] = exc

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}", daemon=True)
        for r in range(world)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    return results


def workload(
    address: str, *extra: str, vocab: int, seed: int, requests: int, tokens: int, slots: int
) -> list[str]:
    """``pp1-spark``'s flags for ``requests`` requests of ``tokens`` new tokens on
    ``slots`` slots against the worker at ``address`` (then ``extra``)."""
    return [
        "--worker", address, "--vocab", str(vocab), "--seed", str(seed),
        "--requests", str(requests), "--max-tokens", str(tokens), "--concurrency", str(slots),
        *extra,
    ]  # fmt: skip


def args_of(*argv: str) -> Any:
    """``pp1-spark``'s settings for ``argv`` (no environment, no config file)."""
    return parse(spark.build_parser(), list(argv), environ={})


def run_one(*argv: str) -> spark.RankRun:
    """One ``pp1-spark`` rank (no group) in this process."""
    args = args_of(*argv)
    plan, world = spark.check_settings(args)
    assert world == 1
    return asyncio.run(spark.run_rank(args, plan, None))


def run_group(
    world: int, *argv: str, sharded: bool = False, faults: Any = None, timeout: float = 10.0
) -> list[spark.RankRun | BaseException]:
    """A ``pp1-spark --tp world`` group (``--vocab-shards world`` with ``sharded``) as
    threads of this process; each rank's result, or what it raised, in rank order."""
    from pp1wire.q.layout import ShardLayout

    extra = ["--tp", str(world), "--group-timeout", str(timeout)]
    # A rank's waits for its link end before the others' collective gives up (the
    # settings refuse anything else): half the group timeout unless argv chose.
    for flag, default in (("--reply-timeout", 5.0), ("--connect-timeout", 10.0)):
        if flag not in argv:
            extra += [flag, f"{min(default, timeout / 2):g}"]
    if sharded:
        extra += ["--vocab-shards", str(world)]
    args = args_of(*argv, *extra)
    layout = ShardLayout.even(args.vocab, world) if sharded else None

    def rank_main(coord: Any) -> spark.RankRun:
        rank_args = args_of(*argv, *extra)
        plan, _ = spark.check_settings(rank_args)
        return asyncio.run(spark.run_rank(rank_args, plan, coord, faults=faults))

    return run_in_threads(world, rank_main, timeout=timeout, layout=layout)


def lead(results: list[spark.RankRun | BaseException]) -> spark.RankRun:
    """Rank 0's result (every rank must have ended without raising)."""
    for rank, r in enumerate(results):
        assert isinstance(r, spark.RankRun), f"rank {rank} raised {r!r}"
    first = results[0]
    assert isinstance(first, spark.RankRun)
    return first


def summary_of(result: spark.RankRun, code: int = 0) -> dict[str, Any]:
    """Rank 0's summary, after checking the run ended with exit status ``code``."""
    assert result.code == code, result
    assert result.summary is not None
    return result.summary


def tokens(result: spark.RankRun) -> list[list[int]]:
    """Each request's tokens, in request order."""
    assert result.records is not None
    return [r.tokens for r in result.records]


def output_tokens(out: Path) -> list[list[int]]:
    """The tokens of an ``--output`` file, in request order."""
    return [json.loads(line)["tokens"] for line in out.read_text().splitlines()]


def assert_all_fell_back(result: spark.RankRun, reason: str, n: int, vocab: int, seed: int) -> None:
    """Check that every one of the ``n`` one-token requests of prompt [1, 2, 3] fell
    back for ``reason``, with no draft token: then each first token is the
    target-only draw, whose law must be p(. | prompt). Tolerance: Pearson chi-square
    at the 1 - 1e-6 quantile (tests/test_verify.py)."""
    summary = summary_of(result)
    assert summary["fallbacks_by_reason"] == {reason: n}
    assert summary["draft_tokens"] == 0
    first = Counter(t[0] for t in tokens(result))
    p = target_factory(vocab, seed)([1, 2, 3])
    law = {i: float(v) for i, v in enumerate(p)}
    assert _chi_square_ok(first, law, n), (first, law)
