"""``pp1-spark``: the verifier side. Asks a worker for proposals, verifies, commits, falls back.

Runs ``--requests`` requests over up to ``--concurrency`` slots of one
connection. Each round asks for one fixed-depth proposal; a proposal that
arrives whole and valid is verified with :class:`pp1wire.q.verify.RequestVerifier`
(acceptance and correction draws are this side's own), and its outcome is
committed. A missing, corrupt, refused or timed-out proposal is discarded whole
and the round is decoded target-only from the committed prefix. If the worker
goes away, requests continue target-only and the connection is retried; on
reconnect each slot is reopened with its committed prefix under a new
generation. ``--depth 0`` decodes target-only throughout with the same
per-request seeds.

SIGTERM or SIGINT: every request finishes its current round, the results so far
(``finished: false`` for cut ones) are written, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import ssl
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

import prometheus_client as prom

from pp1wire.aio.client import AsyncClient, ClientClosedError
from pp1wire.aio.server import SECONDS_BUCKETS
from pp1wire.apps import metrics, spark_sharded, spark_tp
from pp1wire.apps.settings import (
    SettingsError,
    add_common_flags,
    count,
    host_port,
    load_factory,
    positive,
    read_psk,
    row_entries,
    run_daemon,
    seconds,
    temperature,
)
from pp1wire.errors import ErrorCode, Pp1Error, VerifyError
from pp1wire.q.rng import derive_seed
from pp1wire.q.verify import RequestVerifier, RoundResult, TargetFn
from pp1wire.tp.batch import Batcher, Leader, LocalStep
from pp1wire.tp.fanout import Item
from pp1wire.wire import spark_events
from pp1wire.wire.spark_core import SparkConfig

if TYPE_CHECKING:
    from pp1wire.tp.group import Decision, SparkGroup

log = logging.getLogger("pp1wire.apps.spark")


class SparkMetrics:
    """Every metric the Spark side exposes, in a registry of its own."""

    def __init__(self, max_depth: int) -> None:
        """Register the metrics."""
        r = self.registry = prom.CollectorRegistry()
        self.drafts = prom.Counter(
            "pp1_spec_decode_draft_tokens", "Draft tokens verified.", registry=r
        )
        self.accepted = prom.Counter(
            "pp1_spec_decode_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.num_drafts = prom.Counter(
            "pp1_spec_decode_num_drafts", "Proposals verified (rounds).", registry=r
        )
        per_position = prom.Counter(
            "pp1_spec_decode_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the block (0-based).",
            ["position"],
            registry=r,
        )
        # Children made once: every position is exported from the start, and the
        # per-round path skips the label lookup.
        self.per_position = [per_position.labels(position=str(i)) for i in range(max_depth)]
        self.tokens = prom.Counter("pp1_tokens", "Tokens committed.", registry=r)
        self.requests = prom.Counter("pp1_requests", "Requests completed.", registry=r)
        self.fallbacks = prom.Counter(
            "pp1_fallbacks", "Rounds decoded target-only, by reason.", ["reason"], registry=r
        )
        self.rejected = prom.Counter(
            "pp1_frames_rejected", "Frames that failed validation, by code.", ["code"], registry=r
        )
        self.dropped = prom.Counter(
            "pp1_frames_dropped", "Late or duplicate frames dropped, by code.", ["code"], registry=r
        )
        self.reconnects = prom.Counter("pp1_reconnects", "Reconnections.", registry=r)
        self.audit_failures = prom.Counter(
            "pp1_audit_failures",
            "Proposals whose drafts are not what the worker's own draw selects from its q.",
            registry=r,
        )
        self.tp_votes_failed = prom.Counter(
            "pp1_tp_votes_failed",
            "TP group attempts voted down, by the reason each no-vote gave.",
            ["reason"],
            registry=r,
        )
        self.tp_fanout_bytes = prom.Counter(
            "pp1_tp_fanout_bytes", "Proposal bytes this rank fanned out to the group.", registry=r
        )
        self.tp_fanout_seconds = prom.Counter(
            "pp1_tp_fanout_seconds", "Seconds spent broadcasting proposals.", registry=r
        )
        self.rtt = prom.Histogram(
            "pp1_proposal_round_trip_seconds",
            "STEP sent to proposal validated, seconds.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )


@dataclass
class RequestResult:
    """What one request produced."""

    request: int
    seed: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallbacks: int = 0
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    finished: bool = False

    def as_json(self) -> dict[str, Any]:
        """The JSONL record."""
        return {
            "request": self.request,
            "seed": self.seed,
            "prompt": self.prompt,
            "tokens": self.tokens,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "fallbacks": self.fallbacks,
            "fallback_reasons": dict(self.fallback_reasons),
            "finished": self.finished,
        }


class Runner:
    """Drives many requests through one (re)connecting client."""

    def __init__(
        self,
        args: argparse.Namespace,
        target: TargetFn,
        prompts: list[list[int]],
        group: SparkGroup | None = None,
    ):
        """Prepare a run from parsed settings; ``group``: rank 0 of a Spark TP group."""
        self.args = args
        self.group = group
        # Rounds go to the group in batches, on a thread of its own.
        # Rounds are decided in batches off the event loop: by the TP group, or here
        # as one engine step (every queued round scored by one target call).
        leader: Leader[Any] = group if group is not None else LocalStep(target, args.concurrency)
        self.batcher = Batcher(leader)
        self.group_failure: Pp1Error | None = None
        self.target = target
        self.prompts = prompts
        self.support = parse_support(args.support)
        self.metrics = SparkMetrics(max(args.depth, 1))
        self.round_trips: list[float] = []  # the first 100,000, for the summary's median
        self.client: AsyncClient | None = None
        self._lock = asyncio.Lock()
        self._retry_at = 0.0
        self._backoff = 0.05
        self.stopping = False
        host, port = host_port(args.worker)
        self.host, self.port = host, port
        self.ssl = tls_context(args.tls_ca)
        self.config = SparkConfig(
            vocab_size=args.vocab,
            vocab_hash=args.vocab_hash,
            draft_identity=args.draft_identity,
            target_identity=args.target_identity,
            max_slots=args.concurrency,
            max_depth=max(args.depth, 1),
            max_support=min(max(self.support or 0, 1), args.vocab),
            max_prefix=args.max_prefix,
            row_entries=row_entries(args),
            psk=read_psk(args.psk_file),
            reply_timeout=args.reply_timeout,
        )

    # -- connection ------------------------------------------------------------

    async def connect_initial(self, timeout: float) -> None:
        """Connect, retrying until ``timeout`` seconds have passed.

        Raises:
            ClientClosedError, OSError: the last failure, if no attempt succeeded.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client = await AsyncClient.connect(
                    self.host, self.port, self.config, ssl=self.ssl
                )
                self.client.observer = self.observe
                return
            except (OSError, ClientClosedError) as exc:
                if isinstance(exc, ssl.SSLError):
                    raise  # a certificate or TLS-versus-plain mismatch: certain, not transient
                if isinstance(exc, ClientClosedError) and exc.code not in (
                    ErrorCode.CONNECTION_LOST,
                    ErrorCode.HANDSHAKE_TIMEOUT,
                    ErrorCode.SHUTTING_DOWN,
                ):
                    raise
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def live_client(self) -> AsyncClient | None:
        """The connected client, reconnecting (with backoff) if it died; None if down."""
        async with self._lock:
            if self.client is not None and not self.client.closed:
                return self.client
            now = time.monotonic()
            if now < self._retry_at:
                return None
            try:
                self.client = await AsyncClient.connect(
                    self.host, self.port, self.config, ssl=self.ssl, timeout=2.0
                )
            except (OSError, ClientClosedError) as exc:
                self.client = None
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, 2.0)
                log.info("reconnect failed", extra={"error": repr(exc)})
                return None
            self._backoff = 0.05
            self.client.observer = self.observe
            self.metrics.reconnects.inc()
            log.info("reconnected", extra={"session": self.client.session})
            return self.client

    def observe(self, event: spark_events.SparkEvent) -> None:
        """Count rejected and dropped frames as the client sees them."""
        if isinstance(event, spark_events.FrameRejected):
            self.metrics.rejected.labels(code=event.code.name.lower()).inc()
        elif isinstance(event, spark_events.FrameDropped):
            self.metrics.dropped.labels(code=event.code.name.lower()).inc()

    # -- requests -----------------------------------------------------------------

    async def run(self) -> list[RequestResult]:
        """Run every request; returns the results in request order."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(self.args.requests):
            queue.put_nowait(i)
        results: dict[int, RequestResult] = {}

        async def slot_loop(slot: int) -> None:
            while not self.stopping:
                try:
                    index = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results[index] = await self.request(slot, index)

        await asyncio.gather(*(slot_loop(s) for s in range(self.args.concurrency)))
        return [results[i] for i in sorted(results)]

    async def request(self, slot: int, index: int) -> RequestResult:
        """Generate one request to ``--max-tokens`` tokens (or its terminal token)."""
        args = self.args
        seed = derive_seed(args.seed, index)
        prompt = list(self.prompts[index % len(self.prompts)])
        result = RequestResult(request=index, seed=seed, prompt=prompt)
        verifier = RequestVerifier(
            session=0,
            seed=seed,
            vocab_size=args.vocab,
            prefix=prompt,
            target=self.target,
            eos=args.eos,
            audit=args.audit,
        )
        try:
            await self._rounds(slot, index, verifier, prompt, result)
        except Pp1Error as exc:
            if exc.code is not ErrorCode.GROUP_FAILED:
                raise
            # Nothing of the failed round was committed on any rank or sent to the worker.
            self.group_failure = exc
            self.stopping = True
        result.finished = verifier.finished or (
            len(verifier.committed) - len(prompt) >= args.max_tokens
        )
        result.tokens = list(verifier.committed[len(prompt) :])
        if result.finished:
            self.metrics.requests.inc()
        return result

    async def _rounds(
        self,
        slot: int,
        index: int,
        verifier: RequestVerifier,
        prompt: list[int],
        result: RequestResult,
    ) -> None:
        args = self.args
        opened: AsyncClient | None = None
        generation: int | None = None
        refused: str | None = None  # the worker's refusal of our last OPEN, if any
        try:
            while (
                len(verifier.committed) - len(prompt) < args.max_tokens
                and not verifier.finished
                and not self.stopping
            ):
                if args.depth == 0:
                    res = await self._target_only(index, verifier, verifier.last_round + 1)
                    self._record(result, res, None, 0)
                    continue
                client = await self.live_client()
                if client is not None and opened is not client:
                    try:
                        # Every (re)open moves to a higher generation, so nothing of an
                        # earlier instance (or connection) can match the new fencing.
                        generation = await client.open(
                            slot,
                            seed=verifier.seed,
                            prefix=verifier.committed,
                            eos=args.eos,
                            at_least=0 if generation is None else generation + 1,
                        )
                        verifier.rebuild(verifier.committed, generation)
                        verifier.session = client.session
                        opened = client
                    except Pp1Error as exc:
                        log.warning("open failed", extra={"slot": slot, "error": repr(exc)})
                        refused = exc.code.name.lower()
                        opened = None
                        client = None
                if client is None or opened is not client:
                    res = await self._target_only(index, verifier, verifier.last_round + 1)
                    self._record(result, res, refused or "connection_lost", 0)
                    await asyncio.sleep(0)
                    continue
                res, reason, drafted = await self._round(client, slot, index, verifier)
                self._record(result, res, reason, drafted)
                try:
                    client.commit(
                        slot, round_id=res.round_id, tokens=res.tokens, accepted=res.accepted
                    )
                except Pp1Error as exc:
                    # The worker side is out of step (or gone): reopen next round.
                    log.info("commit not sent", extra={"slot": slot, "error": repr(exc)})
                    opened = None
                    await self._close_slot(client, slot)
        finally:
            if opened is not None and not opened.closed:
                await self._close_slot(opened, slot)

    async def _close_slot(self, client: AsyncClient, slot: int) -> None:
        with contextlib.suppress(Pp1Error):
            await client.close_slot(slot)

    async def _in_group(self, item: Item) -> Decision:
        """The group's decision on ``item``; the event loop keeps serving meanwhile."""
        try:
            decision = cast("Decision", await self.batcher.submit(item))
        finally:
            self._count_fanout()
        if decision.failures:
            self.metrics.tp_votes_failed.labels(reason=decision.reason).inc()
        return decision

    def _count_fanout(self) -> None:
        if self.group is None:
            return
        m, stats = self.metrics, self.group.stats
        m.tp_fanout_bytes.inc(stats.fanout_bytes - metrics.total(m.tp_fanout_bytes))
        m.tp_fanout_seconds.inc(stats.fanout_seconds - metrics.total(m.tp_fanout_seconds))

    async def _step(self, item: Item) -> RoundResult:
        """This process's decision on ``item``, taken with the other queued rounds.

        Raises:
            VerifyError: the round's own failure (as ``verify`` raises it).
        """
        decided = await self.batcher.submit(item)
        if isinstance(decided, VerifyError):
            raise decided
        return cast(RoundResult, decided)

    async def _target_only(
        self, index: int, verifier: RequestVerifier, round_id: int
    ) -> RoundResult:
        """Decode ``round_id`` target-only: here, or on the request's owner in the group."""
        if self.group is None:
            return await self._step(Item(index, verifier, None, round_id))
        decision = await self._in_group(Item(index, verifier, None, round_id))
        assert decision.result is not None  # a voted-down target-only attempt raises
        return decision.result

    async def _round(
        self, client: AsyncClient, slot: int, index: int, verifier: RequestVerifier
    ) -> tuple[RoundResult, str | None, int]:
        """One round: a verified proposal, or a target-only token and the reason."""
        started = time.perf_counter()
        args = self.args
        try:
            proposal = await client.propose(
                slot, depth=args.depth, temperature=args.temperature, support=self.support or 0
            )
        except Pp1Error as exc:  # unavailable, refused locally, or connection gone
            reason = exc.code.name.lower()
        else:
            rtt = time.perf_counter() - started
            self.metrics.rtt.observe(rtt)
            if len(self.round_trips) < 100_000:
                self.round_trips.append(rtt)
            try:
                if self.group is not None:
                    decision = await self._in_group(Item(index, verifier, proposal))
                    if decision.result is not None:
                        return decision.result, None, len(proposal.rows)
                    if any(c is ErrorCode.AUDIT_MISMATCH for _, c in decision.failures):
                        self.metrics.audit_failures.inc()
                    raise _VotedDownError(decision.reason)
                return await self._step(Item(index, verifier, proposal)), None, len(proposal.rows)
            except _VotedDownError as exc:
                reason = str(exc)
            except VerifyError as exc:
                if exc.code is ErrorCode.AUDIT_MISMATCH:
                    self.metrics.audit_failures.inc()
                elif exc.code is not ErrorCode.EMPTY_RESIDUAL:
                    raise
                reason = exc.code.name.lower()
            finally:
                client.release(proposal, slot)
        try:
            round_id = client.new_round(slot)
        except Pp1Error:
            round_id = verifier.last_round + 1
        res = await self._target_only(index, verifier, max(round_id, verifier.last_round + 1))
        return res, reason, 0

    def _record(
        self, result: RequestResult, res: RoundResult, reason: str | None, drafted: int
    ) -> None:
        m = self.metrics
        result.rounds += 1
        m.tokens.inc(len(res.tokens))
        if reason is not None:
            result.fallbacks += 1
            result.fallback_reasons[reason] += 1
            m.fallbacks.labels(reason=reason).inc()
            return
        if not drafted:
            return
        result.draft_tokens += drafted
        result.accepted_tokens += res.accepted
        m.num_drafts.inc()
        m.drafts.inc(drafted)
        m.accepted.inc(res.accepted)
        for child in m.per_position[: res.accepted]:
            child.inc()


class _VotedDownError(Exception):
    """The TP group discarded a proposal; the message is the first no-vote's reason."""


def parse_support(text: str) -> int | None:
    """``dense`` → None; ``sparse:K`` → K.

    Raises:
        SettingsError: for anything else.
    """
    if text == "dense":
        return None
    kind, sep, k = text.partition(":")
    if kind == "sparse" and sep and k.isdigit() and int(k) > 0:
        return int(k)
    raise SettingsError(f"--support {text!r}: use dense or sparse:K")


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


def build_parser() -> argparse.ArgumentParser:
    """The ``pp1-spark`` argument parser (every flag also reads ``PP1_<FLAG>``)."""
    p = argparse.ArgumentParser(
        prog="pp1-spark", description="pp1 wire v2 verifier side (the Spark rank)."
    )
    p.add_argument("--worker", default="127.0.0.1:7070", help="worker HOST:PORT")
    p.add_argument(
        "--seed", type=count, default=0, help="base seed; request i uses derive(seed, i)"
    )
    p.add_argument("--requests", type=count, default=8)
    p.add_argument("--max-tokens", type=count, default=64)
    p.add_argument("--depth", type=count, default=5, help="fixed depth 1..5; 0 = target-only")
    p.add_argument("--support", default="dense", help="dense or sparse:K")
    p.add_argument("--temperature", type=temperature, default=1.0, help="proposal temperature")
    p.add_argument("--concurrency", type=positive, default=4, help="concurrent requests (slots)")
    p.add_argument("--eos", type=count, default=None, help="terminal token ID")
    p.add_argument(
        "--audit",
        action="store_true",
        help="recompute the worker's proposal draw and refuse drafts its q does not select",
    )
    p.add_argument("--prompts", default=None, help="JSONL: one JSON list of token IDs per line")
    p.add_argument("--output", default=None, help="write one JSON object per request here")
    p.add_argument("--json", action="store_true", help="print one JSON summary on stdout")
    p.add_argument(
        "--target",
        default="pp1wire.apps.models:target_factory",
        help="target plugin, module:factory; factory(vocab_size=, seed=) -> prefix -> probs",
    )
    p.add_argument("--draft-identity", default="", help="pin the drafter identity ('' = any)")
    p.add_argument("--max-prefix", type=positive, default=1 << 16)
    p.add_argument("--reply-timeout", type=seconds, default=5.0, help="seconds per proposal")
    p.add_argument("--connect-timeout", type=seconds, default=10.0)
    p.add_argument("--tls-ca", default=None, help="CA / certificate file: connect with TLS")
    p.add_argument(
        "--tp",
        type=positive,
        default=1,
        help="tensor-parallel ranks (needs torch); above 1 this starts them with torch's "
        "elastic launcher; under torchrun the launcher's world size is used",
    )
    p.add_argument(
        "--group-timeout",
        type=seconds,
        default=30.0,
        help="seconds any TP collective may wait for a rank before the group fails closed",
    )
    add_common_flags(p, log_level="warning")
    return p


def summarize(results: list[RequestResult], runner: Runner, seconds: float) -> dict[str, Any]:
    """The run's summary object."""
    m = runner.metrics
    drafts = sum(r.draft_tokens for r in results)
    accepted = sum(r.accepted_tokens for r in results)
    tokens = sum(len(r.tokens) for r in results)
    rounds = int(metrics.total(m.num_drafts))
    return {
        "requests": len(results),
        "finished": sum(r.finished for r in results),
        "tokens": tokens,
        "rounds": sum(r.rounds for r in results),
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_accepted_length": accepted / rounds if rounds else 0.0,
        "fallbacks": sum(r.fallbacks for r in results),
        "fallbacks_by_reason": metrics.by_label(m.fallbacks),
        "frames_rejected": metrics.by_label(m.rejected),
        "frames_dropped": metrics.by_label(m.dropped),
        "reconnects": int(metrics.total(m.reconnects)),
        "round_trip_ms_median": (
            statistics.median(runner.round_trips) * 1e3 if runner.round_trips else None
        ),
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
    }


async def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run the requests; returns the exit code.

    ``argv`` (the command line) is what ``--tp N`` hands to the ranks it starts.
    """
    if not 0 <= args.depth <= 5:
        raise SettingsError("--depth must be in 0..5")
    if args.concurrency < 1 or args.requests < 0 or args.max_tokens < 0:
        raise SettingsError("--concurrency >= 1, --requests >= 0, --max-tokens >= 0 required")
    prompts = read_prompts(args.prompts, args.vocab)
    if args.eos is not None and args.eos >= args.vocab:
        raise SettingsError(f"--eos {args.eos} is not a token ID below --vocab {args.vocab}")
    longest = max(len(p) for p in prompts)
    if longest > args.max_prefix:
        raise SettingsError(f"a prompt of {longest} tokens is longer than --max-prefix")
    world = spark_tp.world_size(args)
    if args.vocab_shards not in (1, world):
        raise SettingsError(f"--vocab-shards {args.vocab_shards} needs --tp {args.vocab_shards}")
    if world > 1 and not spark_tp.in_launched_rank():
        # On this (main) thread: the launcher installs signal handlers to stop its ranks.
        return spark_tp.launch(world, argv)
    if args.vocab_shards > 1:
        return await spark_sharded.run(args, prompts)
    group = spark_tp.join(args, args.vocab) if world > 1 else None
    target = load_factory(args.target)(vocab_size=args.vocab, seed=args.seed)
    if group is not None and group.rank != 0:
        return spark_tp.follow(args, group, target, prompts)  # only rank 0 writes --output
    output = open_output(args.output)
    runner = Runner(args, target, prompts, group)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        runner.stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    metrics_server = None
    if args.metrics_port is not None:
        metrics_server = await metrics.serve(
            runner.metrics.registry, args.metrics_host, args.metrics_port
        )
        bound = metrics_server.sockets[0].getsockname()[1]
        # stderr: stdout carries the summary (--json parses it whole).
        print(f"pp1-spark metrics on {args.metrics_host}:{bound}", file=sys.stderr, flush=True)
    if args.depth > 0:
        try:
            await runner.connect_initial(args.connect_timeout)
        except (OSError, ClientClosedError) as exc:
            print(f"pp1-spark: cannot reach the worker at {args.worker}: {exc}", file=sys.stderr)
            if output is not None:
                output.close()
            return 1
    started = time.perf_counter()
    results = await runner.run()
    seconds = time.perf_counter() - started
    reports = None
    if group is not None and runner.group_failure is None:
        try:
            assert runner.batcher is not None
            reports = await runner.batcher.call(group.lead_stop)
        except Pp1Error as exc:
            runner.group_failure = exc
    if runner.client is not None:
        await runner.client.close()
    if metrics_server is not None:
        metrics_server.close()
    if output is not None:
        with output:
            for r in results:
                output.write(json.dumps(r.as_json()) + "\n")
    summary = summarize(results, runner, seconds)
    if group is not None:
        summary.update(spark_tp.summary(reports or [], group))
        if runner.group_failure is not None:
            summary["tp_failure"] = str(runner.group_failure)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary, args)
    if runner.group_failure is not None:
        print(f"pp1-spark: TP group failed: {runner.group_failure}", file=sys.stderr, flush=True)
        return spark_tp.GROUP_FAILED_EXIT
    if group is not None:
        spark_tp.leave()
    return refused_by_configuration(summary, args.depth)


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


def open_output(path: str | None) -> TextIO | None:
    """``--output`` opened for writing before any work, so a bad path loses nothing.

    Raises:
        SettingsError: if it cannot be created.
    """
    if not path:
        return None
    try:
        return Path(path).open("w")
    except OSError as exc:
        raise SettingsError(f"--output {path}: {exc.strerror or exc}") from None


def print_summary(summary: dict[str, Any], args: argparse.Namespace) -> None:
    """Human-readable summary."""
    print(
        f"pp1-spark: {summary['requests']} requests, vocab {args.vocab}, depth {args.depth}, "
        f"q {args.support}"
    )
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key:22s} {shown}")


def main(argv: Sequence[str] | None = None) -> int:
    """``pp1-spark`` entry point."""
    line = list(sys.argv[1:] if argv is None else argv)
    return run_daemon("pp1-spark", build_parser(), line, lambda args: run(args, line))


if __name__ == "__main__":
    sys.exit(main())
