"""``pp1-spark --tp N --vocab-shards N``: the Spark ranks of a vocabulary-sharded pipeline.

Every rank runs this same program on the same requests (``docs/protocol.md``
§6.7): rank r connects to the worker address's port + r, declares shard r of
the even layout in HELLO, and sends the same OPEN, STEP and COMMIT on its link
as every other rank. Each round: every rank awaits its link's shard of the
proposal (checked on arrival by the shard contract), the group checks what no
shard can alone, verifies with the sharded kernels or falls back to
target-only, votes, and only then commits on every link. Requests go in waves
of ``--concurrency`` slots (request i on slot i mod C), so the ranks stay in
step without a leader: every decision comes from a collective.

A link that is lost stays lost (its rank reports every later round as
``CONNECTION_LOST``, so the group decodes target-only; no reconnection in this
mode). A vote that disagrees fails the group closed: nothing of that round is
committed anywhere, exit 3.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pp1wire.aio.client import AsyncClient, ClientClosedError
from pp1wire.apps import spark_tp
from pp1wire.apps.settings import (
    SettingsError,
    host_port,
    load_factory,
    read_psk,
    row_entries,
)
from pp1wire.errors import ErrorCode, Pp1Error, VerifyError
from pp1wire.q.layout import ShardLayout
from pp1wire.q.proposal import Proposal
from pp1wire.q.rng import derive_seed
from pp1wire.q.verify import Outcome, TargetFn
from pp1wire.wire.spark_core import SparkConfig


@dataclass
class _Request:
    index: int
    slot: int
    seed: int
    prompt: list[int]
    committed: list[int]
    generation: int = 0
    last_round: int = -1
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallbacks: int = 0
    fallback_reasons: Counter[str] = field(default_factory=Counter)
    finished: bool = False

    def record(self) -> dict[str, Any]:
        """The ``--output`` record, in pp1-spark's one format."""
        from pp1wire.apps.spark import RequestResult  # noqa: PLC0415 - spark imports this module

        return RequestResult(
            request=self.index,
            seed=self.seed,
            prompt=self.prompt,
            tokens=self.committed[len(self.prompt) :],
            rounds=self.rounds,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            fallbacks=self.fallbacks,
            fallback_reasons=self.fallback_reasons,
            finished=self.finished,
        ).as_json()


def _layout(args: argparse.Namespace, world: int) -> ShardLayout:
    if args.vocab_shards != world:
        raise SettingsError(f"--vocab-shards {args.vocab_shards} needs --tp {args.vocab_shards}")
    if args.depth == 0:
        raise SettingsError("--vocab-shards needs --depth 1..5 (depth 0 uses no worker)")
    if args.audit:
        raise SettingsError("--audit is not available with --vocab-shards")
    return ShardLayout.even(args.vocab, world)


class ShardedRun:
    """One rank's run of every request."""

    def __init__(self, args: argparse.Namespace, prompts: list[list[int]]) -> None:
        """Join the group (gloo, ``--group-timeout``) and prepare this rank's link.

        Raises:
            SettingsError: for flags the sharded mode cannot honour, or without torch.
        """
        try:
            import torch.distributed as dist  # noqa: PLC0415

            from pp1wire.tp.shard_spark import ShardedVerifyGroup  # noqa: PLC0415
        except ImportError:
            raise SettingsError("--vocab-shards needs torch: pip install 'pp1wire[tp]'") from None
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.group_timeout))
        self.dist = dist
        self.layout = _layout(args, dist.get_world_size())
        self.group = ShardedVerifyGroup(self.layout)
        self.rank = self.group.rank
        self.args = args
        self.prompts = prompts
        self.target: TargetFn = load_factory(args.target)(vocab_size=args.vocab, seed=args.seed)
        support = args.support
        self.support = 0 if support == "dense" else int(support.split(":", 1)[1])
        self.config = SparkConfig(
            vocab_size=args.vocab,
            vocab_hash=args.vocab_hash,
            draft_identity=args.draft_identity,
            target_identity=args.target_identity,
            max_slots=args.concurrency,
            max_depth=args.depth,
            max_support=min(max(self.support, 1), args.vocab),
            max_prefix=args.max_prefix,
            row_entries=row_entries(args),
            psk=read_psk(args.psk_file),
            reply_timeout=args.reply_timeout,
            layout=self.layout,
            shard=self.rank,
        )
        host, port = host_port(args.worker)
        self.host, self.port = host, port + self.rank
        self.client: AsyncClient | None = None

    async def connect(self) -> None:
        """Connect this rank's link, retrying until ``--connect-timeout``.

        Raises:
            ClientClosedError, OSError: the last failure, if no attempt succeeded.
        """
        deadline = time.monotonic() + self.args.connect_timeout
        while True:
            try:
                self.client = await AsyncClient.connect(self.host, self.port, self.config)
                return
            except (OSError, ClientClosedError) as exc:
                if isinstance(exc, ClientClosedError) and exc.code not in (
                    ErrorCode.CONNECTION_LOST,
                    ErrorCode.HANDSHAKE_TIMEOUT,
                ):
                    raise
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Off the event loop: the link keeps reading while the group waits.
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def run(self) -> list[_Request]:
        """Every request, in waves of ``--concurrency`` slots.

        Raises:
            Pp1Error: ``GROUP_FAILED`` if a vote disagrees (nothing of that round committed).
        """
        args, done = self.args, []
        for first in range(0, args.requests, args.concurrency):
            wave = [
                _Request(
                    i,
                    i - first,
                    derive_seed(args.seed, i),
                    list(self.prompts[i % len(self.prompts)]),
                    list(self.prompts[i % len(self.prompts)]),
                )
                for i in range(first, min(first + args.concurrency, args.requests))
            ]
            await self._open(wave)
            for r in wave:  # a rank whose link is down opened nothing: take the group's
                r.generation = await self._collective(self.group.common_round, r.generation)
            await self._rounds(wave)
            for r in wave:
                r.finished = r.finished or self._full(r)
                if self.client is not None and not self.client.closed:
                    await self.client.close_slot(r.slot)
            done.extend(wave)
        return done

    async def _rounds(self, wave: list[_Request]) -> None:
        """Every round of a wave, the slots taken in turn (the same order on every rank).

        A slot's next STEP goes out as soon as its round is committed, so the
        worker group draws it while this group decides the other slots' rounds.
        """
        turns = collections.deque(r for r in wave if not r.finished and not self._full(r))
        steps = {r.slot: asyncio.ensure_future(self._propose(r)) for r in turns}
        try:
            while turns:
                r = turns.popleft()
                await self._round(r, await steps.pop(r.slot))
                if not r.finished and not self._full(r):
                    steps[r.slot] = asyncio.ensure_future(self._propose(r))
                    turns.append(r)
        finally:
            for step in steps.values():
                step.cancel()

    def _full(self, r: _Request) -> bool:
        return len(r.committed) - len(r.prompt) >= int(self.args.max_tokens)

    async def _open(self, wave: list[_Request]) -> None:
        for r in wave:
            client = self.client
            if client is None or client.closed:
                continue
            with contextlib.suppress(Pp1Error):
                r.generation = await client.open(
                    r.slot, seed=r.seed, prefix=r.committed, eos=self.args.eos
                )

    async def _propose(self, r: _Request) -> Proposal | ErrorCode:
        client = self.client
        if client is None or client.closed:
            return ErrorCode.CONNECTION_LOST
        try:
            return await client.propose(
                r.slot,
                depth=self.args.depth,
                temperature=self.args.temperature,
                support=self.support,
            )
        except Pp1Error as exc:
            return exc.code

    async def _round(self, r: _Request, got: Proposal | ErrorCode) -> None:
        from pp1wire.tp.shard_spark import Decided, ShardReport  # noqa: PLC0415

        g = self.group
        report = ShardReport(got) if isinstance(got, ErrorCode) else ShardReport.of(got)
        reason: ErrorCode | None = await self._collective(g.check, report)
        decided: Decided | None = None
        if reason is None:
            assert isinstance(got, Proposal)
            try:
                decided = await self._collective(
                    g.verify,
                    seed=r.seed,
                    committed=r.committed,
                    eos=self.args.eos,
                    proposal=got,
                    target=self.target,
                )
            except VerifyError as exc:
                if exc.code is not ErrorCode.EMPTY_RESIDUAL:
                    raise
                reason = exc.code
        if isinstance(got, Proposal) and self.client is not None:
            self.client.release(got, r.slot)
        if decided is None:
            decided = await self._fallback(r)
            r.fallbacks += 1
            name = reason.name.lower() if reason is not None else "unknown"
            r.fallback_reasons[name] += 1
        elif isinstance(got, Proposal):
            r.draft_tokens += len(got.rows)
            r.accepted_tokens += decided.accepted
        agreed: bool = await self._collective(g.agree, decided)
        if not agreed:
            raise Pp1Error(ErrorCode.GROUP_FAILED, f"rank {self.rank}: the ranks' outcomes differ")
        r.rounds += 1
        r.last_round = decided.round_id
        r.committed.extend(decided.tokens)
        eos = self.args.eos
        r.finished = eos is not None and decided.tokens[-1] == eos
        if decided.outcome is Outcome.EOS:
            r.finished = True
        client = self.client
        if client is not None and not client.closed:
            with contextlib.suppress(Pp1Error):
                client.commit(
                    r.slot,
                    round_id=decided.round_id,
                    tokens=decided.tokens,
                    accepted=decided.accepted,
                )

    async def _fallback(self, r: _Request) -> Any:
        local = r.last_round + 1
        client = self.client
        if client is not None and not client.closed:
            with contextlib.suppress(Pp1Error):
                local = max(local, client.new_round(r.slot))
        round_id = await self._collective(self.group.common_round, local)
        return await self._collective(
            self.group.target_only,
            seed=r.seed,
            generation=r.generation,
            round_id=round_id,
            committed=r.committed,
            target=self.target,
        )


async def run(args: argparse.Namespace, prompts: list[list[int]]) -> int:
    """This rank's whole run; rank 0 writes ``--output`` and the summary. Returns the exit code.

    Raises:
        SettingsError: for flags the sharded mode cannot honour.
    """
    runner = ShardedRun(args, prompts)
    output = None
    if runner.rank == 0 and args.output:
        from pp1wire.apps.spark import open_output  # noqa: PLC0415

        output = open_output(args.output)
    try:
        await runner.connect()
    except (OSError, ClientClosedError) as exc:
        print(
            f"pp1-spark rank {runner.rank}: cannot reach worker rank {runner.rank} at "
            f"{runner.host}:{runner.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    started = time.perf_counter()
    failure: Pp1Error | None = None
    results: list[_Request] = []
    try:
        results = await runner.run()
    except Pp1Error as exc:
        failure = exc
    seconds = time.perf_counter() - started
    client = runner.client
    link_bytes = client.core.decoder.bytes_received if client is not None else 0
    if client is not None:
        await client.close()
    if failure is not None:
        print(f"pp1-spark: TP group failed: {failure}", file=sys.stderr, flush=True)
        return spark_tp.GROUP_FAILED_EXIT
    if runner.rank == 0:
        if output is not None:
            with output:
                for r in results:
                    output.write(json.dumps(r.record()) + "\n")
        tokens = sum(len(r.committed) - len(r.prompt) for r in results)
        drafts = sum(r.draft_tokens for r in results)
        accepted = sum(r.accepted_tokens for r in results)
        summary = {
            "requests": len(results),
            "finished": sum(r.finished for r in results),
            "tokens": tokens,
            "rounds": sum(r.rounds for r in results),
            "draft_tokens": drafts,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "fallbacks": sum(r.fallbacks for r in results),
            "fallbacks_by_reason": dict(sum((r.fallback_reasons for r in results), Counter())),
            "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else 0.0,
            "tp": runner.group.world,
            "vocab_shards": runner.layout.shards,
            "shard_ranges": [list(runner.layout.range(i)) for i in range(runner.layout.shards)],
            "link_bytes_rank0": link_bytes,
        }
        print(json.dumps(summary) if args.json else summary, flush=True)
    runner.dist.destroy_process_group()
    return 0


__all__ = ["ShardedRun", "run"]
