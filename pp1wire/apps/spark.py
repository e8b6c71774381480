"""``pp1-spark``: the verifier side, one rank, a replicated ``--tp`` group or a vocabulary-sharded
one: asks a worker for proposals, verifies, commits, and decodes target-only when it must
(``docs/runner.md``); a target that fails exits 4, a group that fails 3, results written first."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import ssl
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pp1wire.aio.client import ConnectionLostError, RefusedError
from pp1wire.apps import keys, metrics, ranks, settings
from pp1wire.apps.driver import (
    GROUP_FAILED_EXIT,
    TARGET_FAILED_EXIT,
    LocalStrategy,
    Plan,
    RequestRecord,
    RoundDriver,
    Strategy,
)
from pp1wire.apps.link import Link
from pp1wire.apps.metrics import SparkMetrics
from pp1wire.apps.settings import (
    MAX_RANKS,
    SettingsError,
    add_common_flags,
    count,
    host_port,
    positive,
    run_daemon,
    seconds,
    temperature,
)
from pp1wire.errors import ErrorCode, Pp1Error
from pp1wire.q.layout import ShardLayout
from pp1wire.q.proposal import MAX_DEPTH
from pp1wire.q.stoprules import STOP_RULES, DepthController, StopKind, StopRule
from pp1wire.q.verify import batched
from pp1wire.wire.messages import WIRE_VERSION
from pp1wire.wire.spark_core import SparkConfig

if TYPE_CHECKING:
    from pp1wire.tp.coordinator import GroupCoordinator
    from pp1wire.tp.group import Faults

MAX_CONCURRENCY = 0xFFFF  # the most slots a HELLO can ask for (a 16-bit field)


def read_prompts(path: str | None, vocab: int) -> list[list[int]]:
    """Prompts from a JSONL file (one JSON list of token IDs per line).

    Raises:
        SettingsError: for an unreadable file, a line that is not a list of
            token IDs in ``[0, vocab)``, or an empty file.
    """
    if not path:
        return [[1, 2, 3]]
    prompts = []
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"prompts {path}: {exc}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            tokens = json.loads(line)
        except (ValueError, RecursionError) as exc:  # bad JSON, huge integers, deep nesting
            raise SettingsError(f"prompts {path}:{n}: {str(exc)[:120]}") from None
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise SettingsError(f"prompts {path}:{n}: need a JSON list of token IDs < {vocab}")
        if not tokens:  # an OPEN's prefix holds at least one token (docs/protocol.md §4.3)
            raise SettingsError(f"prompts {path}:{n}: an empty prompt (at least one token)")
        prompts.append(tokens)
    if not prompts:
        raise SettingsError(f"prompts {path}: no prompts")
    return prompts


def tls_context(cafile: str | None) -> ssl.SSLContext | None:
    """A client TLS context trusting ``cafile`` (None: plain TCP).

    Raises:
        SettingsError: if the file is missing or holds no certificate.
    """
    if not cafile:
        return None
    try:
        return ssl.create_default_context(cafile=cafile)
    except OSError as exc:  # ssl.SSLError included
        raise SettingsError(f"--tls-ca {cafile}: {exc.strerror or exc}") from None


class Output:
    """``--output``: checked writable before any work (nothing created or truncated), then
    replaced in one rename at the end, so a run that fails leaves an earlier output as it was."""

    def __init__(self, path: str) -> None:
        """Check that ``path`` can be written, creating and changing nothing.

        Raises:
            SettingsError: as :func:`pp1wire.apps.settings.check_writable`.
        """
        self.path = Path(path)
        settings.check_writable("--output", path)

    def write(self, records: Sequence[RequestRecord]) -> None:
        """Replace the file with one JSON object per record.

        Raises:
            OSError: if the file cannot be written.
        """
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                for r in records:
                    f.write(json.dumps(r.as_json()) + "\n")
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


_HELP: dict[str, str] = {
    "--seed": "base seed: request i uses derive_seed(SEED, i)",
    "--requests": "requests to run",
    "--max-tokens": "new tokens per request (the last round is kept whole)",
    "--depth": f"drafts per proposal at most, 1..{MAX_DEPTH}; 0 decodes target-only (no worker); "
    "auto: each STEP's depth chosen per request from its verified rounds and the load "
    "(docs/runner.md)",
    "--stop": "the stop rule of every block (docs/adaptive.md): fixed (the depth, or a terminal "
    "token, ends it), confidence:TAU (draw the next draft only while the last one's q is at least "
    "TAU) or joint:TAU (only while the product of the drafts' q is at least TAU); audited on "
    "arrival",
    "--support": "the q of each row: dense or sparse:K",
    "--temperature": "proposal temperature (0: greedy)",
    "--concurrency": f"requests running at once, 1..{MAX_CONCURRENCY}: request i runs on slot "
    "i mod SLOTS",
    "--eos": "terminal token ID (default: none, requests end at --max-tokens)",
    "--audit": "recompute the worker's proposal draw and refuse drafts its q does not select",
    "--prompts": "JSONL, one JSON list of token IDs per line; request i takes line i mod lines "
    "(default: every request's prompt is [1, 2, 3])",
    "--output": "write one JSON object per request here, replacing the file at the end (default: "
    "none)",
    "--json": "print one JSON summary on stdout",
    "--target": "target plugin: factory(vocab_size=, seed=) returns prefix -> probabilities (a "
    ".batch(prefixes) method, if it has one, scores a whole step in one call)",
    "--draft-identity": "pin the drafter identity the worker must declare ('' = any)",
    "--max-prefix": "longest committed prefix this side asks the worker to hold",
    "--reply-timeout": "how long a proposal may take: at the deadline its block is cut after the "
    "rows that arrived (verified), or, with none, its round decodes target-only",
    "--connect-timeout": "how long to keep trying to reach the worker at the start",
    "--tp": f"tensor-parallel ranks, 1..{MAX_RANKS} (needs torch); above 1 this starts "
    "them on this machine; under torchrun the launcher's world size is used",
    "--group-timeout": "how long any collective of a TP group may wait for a rank before the group "
    "fails closed",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``pp1-spark`` argument parser (every flag also reads ``PP1_<FLAG>``)."""
    p = settings.parser(
        "pp1-spark", f"PP1 v{WIRE_VERSION} verifier side (the Spark rank): docs/runner.md."
    )
    settings.add_connect_flags(p)
    add = settings.adder(p, _HELP)
    add("--seed", count, 0, "SEED")
    add("--requests", count, 8, "N")
    add("--max-tokens", count, 64, "TOKENS")
    add("--depth", settings.depth_or_auto, 5, "TOKENS")
    add("--stop", None, "fixed", "RULE")
    add("--support", None, "dense", "Q")
    add("--temperature", temperature, 1.0, "T")
    add("--concurrency", positive, 4, "SLOTS")
    add("--eos", count, None, "TOKEN")
    add("--audit", action="store_true")
    add("--prompts", None, None, "FILE")
    add("--output", None, None, "FILE")
    add("--json", action="store_true")
    add("--target", None, "pp1wire.apps.models:target_factory", "MODULE:FACTORY")
    add("--draft-identity", settings.name, "", "NAME")
    add("--max-prefix", positive, 1 << 16, "TOKENS")
    add("--reply-timeout", seconds, 5.0, "SECONDS")
    add("--connect-timeout", seconds, 10.0, "SECONDS")
    add("--tp", settings.ranks, 1, "RANKS")
    add("--group-timeout", seconds, 30.0, "SECONDS")
    add_common_flags(p, log_level="warning")
    return p


def check_settings(args: argparse.Namespace) -> tuple[Plan, int]:
    """Every setting checked before anything runs (nothing is created or started); the plan,
    and the number of ranks.

    Raises:
        SettingsError: the first bad setting, in one line.
    """
    auto = args.depth == "auto"
    depth = MAX_DEPTH if auto else args.depth
    if not 0 <= depth <= MAX_DEPTH:
        raise SettingsError(f"--depth must be in 0..{MAX_DEPTH}")
    try:
        stop = StopRule.parse(args.stop)
    except ValueError as exc:
        raise SettingsError(f"--stop: {exc}") from None
    if stop.kind is not StopKind.FIXED and depth == 0:
        raise SettingsError(f"--stop {stop} needs proposals: --depth above 0")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise SettingsError(f"--concurrency must be in 1..{MAX_CONCURRENCY}")
    support = settings.parse_support(args.support)
    if support > args.vocab:
        raise SettingsError(f"--support sparse:{support} is larger than --vocab {args.vocab}")
    if args.eos is not None and args.eos >= args.vocab:
        raise SettingsError(f"--eos {args.eos} is not a token ID below --vocab {args.vocab}")
    prompts = read_prompts(args.prompts, args.vocab)
    longest = max(len(p) for p in prompts)
    if longest > args.max_prefix:
        raise SettingsError(f"a prompt of {longest} tokens is longer than --max-prefix")
    world = ranks.world_size(args)
    if args.vocab_shards not in (1, world):
        raise SettingsError(f"--vocab-shards {args.vocab_shards} needs --tp {args.vocab_shards}")
    settings.linked_address(args.worker, args.vocab_shards)
    if world > 1 and depth > 0:  # without proposals no rank waits for a link
        waits = {"--reply-timeout": args.reply_timeout, "--connect-timeout": args.connect_timeout}
        settings.check_group_waits(args.group_timeout, waits)
    if args.metrics_port is not None:
        token = bool(args.metrics_token_file)
        settings.check_listeners(
            [("--metrics-host", args.metrics_host, "--metrics-token-file", token)],
            insecure=args.insecure,
        )
        if args.metrics_token_file:
            keys.read_token(args.metrics_token_file)
    if args.vocab_shards > 1 and args.audit:
        raise SettingsError("--audit is not available with --vocab-shards (no rank holds all q)")
    tls_context(args.tls_ca)
    keys.link_fields(args)  # the key of --key-id, read
    if args.output:  # on every rank and the launcher: none starts with a bad one
        Output(args.output)
    plan = Plan(
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        depth=depth,
        support=support,
        temperature=args.temperature,
        seed=args.seed,
        eos=args.eos,
        audit=args.audit,
        vocab_size=args.vocab,
        prompts=prompts,
        stop=stop,
        controller=DepthController() if auto else None,
    )
    return plan, world


def spark_config(
    args: argparse.Namespace,
    plan: Plan,
    layout: ShardLayout | None,
    rank: int,
    group: bytes = b"",
) -> SparkConfig:
    """This rank's HELLO settings (``group``: a sharded group's nonce)."""
    return SparkConfig(
        **keys.link_fields(args),
        draft_identity=args.draft_identity,
        max_slots=plan.concurrency,
        max_depth=max(plan.depth, 1),
        max_support=min(max(plan.support, 1), args.vocab),
        max_prefix=args.max_prefix,
        reply_timeout=args.reply_timeout,
        layout=layout,
        shard=rank if layout is not None else 0,
        stop_rules="" if plan.stop.kind is StopKind.FIXED else STOP_RULES,
        group=group,
    )


@dataclass
class RankRun:
    """How one rank's run ended: its exit code, and on rank 0 the summary and records."""

    code: int
    summary: dict[str, Any] | None = None
    records: list[RequestRecord] | None = None
    warning: str | None = None  #: faults the reply timeout does not explain (rank 0)


async def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run the requests; returns the exit code (``argv``: what ``--tp N`` hands its ranks).

    Raises:
        SettingsError: a bad setting (before anything runs).
    """
    plan, world = check_settings(args)
    if world > 1 and not ranks.in_launched_rank():
        # On this (main) thread: the launcher installs signal handlers to stop its ranks.
        return ranks.launch(world, argv, module="pp1wire.spark")
    coord = None
    if world > 1:
        layout = ShardLayout.even(args.vocab, world) if args.vocab_shards > 1 else None
        # Only the replicated group's steps run on the device group.
        coord = ranks.join_group(args.group_timeout, layout, device=layout is None)
    done = await run_rank(args, plan, coord)
    if done.summary is not None:
        if args.json:
            print(json.dumps(done.summary), flush=True)
        else:
            title = f"pp1-spark: {done.summary['requests']} requests, vocab {args.vocab}, "
            metrics.print_summary(f"{title}depth {args.depth}, q {args.support}", done.summary, 22)
    if done.warning is not None:
        print(f"pp1-spark: warning: {done.warning}", file=sys.stderr, flush=True)
    return done.code


async def run_rank(
    args: argparse.Namespace,
    plan: Plan,
    coord: GroupCoordinator | None,
    *,
    faults: Faults | None = None,
) -> RankRun:
    """This process's part of the run: rank 0 (or the only rank) drives the requests and
    writes ``--output``, a replicated follower follows, every sharded rank drives
    (``coord``: its group; ``faults``: a replicated group's test hooks). Signal handlers
    go only on the main thread, so a test can run a group as threads of one process.
    """
    target = settings.make_plugin(args.target, vocab_size=args.vocab, seed=args.seed)
    m = SparkMetrics(max(plan.depth, 1))
    rank, layout = 0, None
    strategy: Strategy
    finish: Callable[[], None] | None = None  # ends a group's attempts (replicated TP)
    nonce = b""  # a sharded group's nonce, on every link's HELLO
    sharded = args.vocab_shards > 1
    if coord is not None and sharded:
        from pp1wire.apps.spark_sharded import ShardedStrategy  # noqa: PLC0415 - needs torch

        rank, layout = coord.rank, coord.layout
        strategy = ShardedStrategy(coord, batched(target))
        if plan.depth > 0:
            nonce = await asyncio.to_thread(strategy.group_nonce)
    elif coord is not None:
        from pp1wire.apps import spark_tp  # noqa: PLC0415 - needs torch
        from pp1wire.tp.group import SparkGroup  # noqa: PLC0415

        group = SparkGroup(
            coord, args.vocab, max_batch=plan.concurrency, faults=faults or spark_tp.FAULTS
        )
        if coord.rank != 0:
            # Blocking on purpose: it keeps a follower on the main thread, with its handlers.
            return RankRun(spark_tp.follow(args, group, target, plan))
        replicated = spark_tp.ReplicatedStrategy(group, m)
        strategy, finish = replicated, replicated.finish
    else:
        strategy = LocalStrategy(batched(target))
    output = Output(args.output) if args.output and rank == 0 else None
    link = None
    if plan.depth > 0:
        host, port = host_port(args.worker)
        link = Link(
            host,
            port + rank,
            spark_config(args, plan, layout, rank, nonce),
            m,
            tls=tls_context(args.tls_ca),
            reconnect=not sharded,
        )
    driver = RoundDriver(plan, strategy, target, link, m)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, driver.request_stop)
    metrics_server = None
    if args.metrics_port is not None and rank == 0:
        token = keys.read_token(args.metrics_token_file) if args.metrics_token_file else None
        metrics_server = await metrics.serve(
            m.registry, args.metrics_host, args.metrics_port, token=token
        )
        bound = metrics_server.sockets[0].getsockname()[1]
        # stderr: stdout carries the summary (--json parses it whole).
        shown = settings.address_text(args.metrics_host, bound)
        print(f"pp1-spark metrics on {shown}", file=sys.stderr, flush=True)
    try:
        stopped = False
        if link is not None:
            unreachable = 0
            try:
                stopped, _ = await driver.until_stopped(link.connect(args.connect_timeout))
            except (OSError, RefusedError, ConnectionLostError) as exc:
                where = f"{link.host}:{link.port}" + (f" (rank {rank})" if coord else "")
                print(f"pp1-spark: cannot reach the worker at {where}: {exc}", file=sys.stderr)
                unreachable = 1
            # The ranks start (or not, or stop) together: each needs its link.
            agreed = await asyncio.to_thread(strategy.agree, [unreachable, int(stopped)])
            if agreed[0] or agreed[1]:
                if finish is not None:
                    await asyncio.to_thread(finish)  # followers stop instead of timing out
                    finish = None
                if agreed[0]:
                    return RankRun(1)
                stopped = True
        records = [] if stopped else await driver.run()
        failure = driver.group_failure
        if finish is not None and failure is None:
            try:
                await asyncio.to_thread(finish)
            except Pp1Error as exc:  # the group failed while stopping
                failure = exc
    finally:
        if link is not None:
            await link.close()
        if metrics_server is not None:
            metrics_server.close()
    if output is not None:
        output.write(records)
    done = RankRun(0, records=records)
    if rank == 0:
        summary = driver.summary(records)
        if link is not None and sharded:
            summary["link_bytes_rank0"] = link.bytes_received
        if failure is not None:
            summary["tp_failure"] = str(failure)
        done.summary = summary
        done.warning = fault_warning(faults_by_row(m), driver.stepped)
        done.code = refused_by_configuration(summary, plan.depth)
    if failure is not None:
        print(f"pp1-spark: TP group failed: {failure}", file=sys.stderr, flush=True)
        done.code = GROUP_FAILED_EXIT
        return done
    if coord is not None:
        coord.leave()
    failed = sum(r.stopped == "target_failed" for r in records)
    if failed:
        print(f"pp1-spark: the target failed: {failed} request(s) stopped", file=sys.stderr)
        done.code = TARGET_FAILED_EXIT
    return done


# Fallback reasons that no retry can cure: the worker refuses what this run asks for.
CONFIGURATION_REASONS = frozenset(
    code.name.lower()
    for code in (
        ErrorCode.TOKEN_OUT_OF_RANGE,
        ErrorCode.LIMIT_EXCEEDED,
        ErrorCode.BAD_TEMPERATURE,
        ErrorCode.DEPTH_OUT_OF_RANGE,
        ErrorCode.SUPPORT_OUT_OF_RANGE,
        ErrorCode.SLOT_LIMIT,
        ErrorCode.CONTEXT_MISMATCH,
        ErrorCode.BAD_STOP_RULE,
    )
)


def refused_by_configuration(summary: dict[str, Any], depth: int) -> int:
    """1 (with one line on stderr) when no round used a proposal because the worker
    refused this run's settings; else 0."""
    reasons = set(summary["fallbacks_by_reason"]) & CONFIGURATION_REASONS
    if depth == 0 or summary["draft_tokens"] or not reasons:
        return 0
    print(
        f"pp1-spark: every round fell back; the worker refused: {', '.join(sorted(reasons))}",
        file=sys.stderr,
    )
    return 1


#: The reasons of the faults this side's own deadlines cause (``--reply-timeout``).
TIMEOUT_REASONS = frozenset(
    code.name.lower() for code in (ErrorCode.REPLY_TIMEOUT, ErrorCode.ANSWER_TIMEOUT)
)
#: Unexplained faults :func:`fault_warning` lets pass: fewer than this many, or this share.
UNEXPLAINED_FLOOR, UNEXPLAINED_SHARE = 3, 0.01


def faults_by_row(m: SparkMetrics) -> dict[tuple[int, str], int]:
    """``pp1_faults_by_row_total`` as ``{(row, reason): count}``."""
    out: dict[tuple[int, str], int] = {}
    for key, value in metrics.by_label(m.faults).items():
        row, _, reason = key.partition(",")
        out[int(row), reason] = out.get((int(row), reason), 0) + int(value)
    return out


def fault_warning(faults: dict[tuple[int, str], int], proposals: int) -> str | None:
    """The summary's warning, naming them by row, when the faults the reply timeout does not
    explain (any but :data:`TIMEOUT_REASONS`: the worker's or the path's doing, which can
    depend on the drafts, ``docs/adaptive.md`` §7) reach :data:`UNEXPLAINED_FLOOR` and
    :data:`UNEXPLAINED_SHARE` of the ``proposals``; else None.
    """
    rows: dict[int, int] = {}
    for (row, reason), n in faults.items():
        if reason not in TIMEOUT_REASONS and n:
            rows[row] = rows.get(row, 0) + n
    unexplained = sum(rows.values())
    if unexplained < max(UNEXPLAINED_FLOOR, UNEXPLAINED_SHARE * proposals):
        return None
    by_row = ", ".join(f"row {r}: {n}" for r, n in sorted(rows.items()))
    return (
        f"{unexplained} of {proposals} proposals ended by a fault the reply timeout does not "
        f"explain ({by_row}); a worker that fails the rows of drafts it dislikes biases "
        "the output: compare pp1_faults_by_row_total by row (docs/adaptive.md section 7)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``pp1-spark`` entry point."""
    line = list(sys.argv[1:] if argv is None else argv)
    code = run_daemon("pp1-spark", build_parser(), line, lambda args: run(args, line))
    return ranks.end_process(code)  # a rank process ends here


if __name__ == "__main__":
    sys.exit(main())
