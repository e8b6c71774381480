"""The main job: ``pp1-worker`` on loopback and ``pp1-spark`` against it, target-only, then dense q,
then sparse top-32 q, with a paced model pair (the n-gram pair, or the toy pair), printing what
speculation buys; ``--in-process``: the chain and verifier in one process, no sockets."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from pp1wire.apps import metrics, ngram, settings
from pp1wire.apps.launch import (
    WorkerStartError,
    pinned,
    spark_command,
    split_cores,
    worker_command,
    worker_process,
)
from pp1wire.apps.models import DEFAULT_VOCAB, toy_drafter, toy_target
from pp1wire.apps.paced import DRAFTER_MS_ENV, TARGET_MS_ENV
from pp1wire.q import dyadic, validate
from pp1wire.q.proposal import DrafterFn, QRow, propose
from pp1wire.q.rng import Role, RoundStreams, derive_seed
from pp1wire.q.verify import RequestVerifier, TargetFn, proposal_from_rows

#: The model pairs: name -> (its title, its paced drafter plugin of each kind, its target's).
PAIRS = {
    "ngram": (
        "n-gram pair",
        {
            "probs": "pp1wire.apps.ngram:paced_probs_drafter_factory",
            "logits": "pp1wire.apps.ngram:paced_drafter_factory",
        },
        "pp1wire.apps.ngram:paced_target_factory",
    ),
    "toy": (
        "toy pair",
        {
            "probs": "pp1wire.apps.paced:probs_drafter_factory",
            "logits": "pp1wire.apps.paced:drafter_factory",
        },
        "pp1wire.apps.paced:target_factory",
    ),
}


def models(name: str, vocab_size: int, seed: int) -> tuple[DrafterFn, TargetFn]:
    """The pair ``name``'s drafter (prefix -> logits) and target (prefix -> p), unpaced.

    Raises:
        ngram.CorpusMissingError: for the n-gram pair on a Python without its text.
    """
    if name == "ngram":
        return ngram.ngram_drafter(vocab_size).logits, ngram.ngram_target(vocab_size).probs
    return toy_drafter(vocab_size, seed).logits, toy_target(vocab_size, seed).probs


def _receive(row: QRow, vocab_size: int, max_k: int) -> QRow:
    """Encode a row to its wire bytes and validate it as a receiver would."""
    assert row.counts is not None
    q = dyadic.counts_to_fp32(row.counts).tobytes()
    if row.ids is None:
        counts = validate.validate_dense(q, vocab_size, row.token)
        return QRow(token=row.token, counts=counts)
    ids, counts = validate.validate_sparse(
        row.ids.astype("<i4").tobytes(), q, vocab_size, max_k, row.token
    )
    return QRow(token=row.token, counts=counts, ids=ids)


def run_in_process(
    *,
    pair: str = "toy",
    vocab_size: int,
    seed: int,
    requests: int,
    max_tokens: int,
    depth: int,
    support: int | None,
    temperature: float,
    prompt: Sequence[int],
) -> dict[str, Any]:
    """Generate ``requests`` sequences in one process with the pair ``pair``; their summary.

    Raises:
        ngram.CorpusMissingError: for the n-gram pair on a Python without its text.
    """
    drafter, target = models(pair, vocab_size, seed)
    per_position = [0] * depth
    drafts = accepted = tokens = rounds = 0
    started = time.perf_counter()
    for index in range(requests):
        request_seed = derive_seed(seed, index)
        verifier = RequestVerifier(
            session=index,
            seed=request_seed,
            vocab_size=vocab_size,
            prefix=prompt,
            target=target,
        )
        round_id = 0
        while verifier.position - len(prompt) < max_tokens and not verifier.finished:
            worker = RoundStreams(Role.WORKER, request_seed, verifier.generation, round_id)
            rows = propose(
                verifier.committed,
                depth,
                drafter,
                worker,
                temperature=temperature,
                support=support,
            )
            received = tuple(_receive(r, vocab_size, support or vocab_size) for r in rows)
            result = verifier.verify(proposal_from_rows(verifier, received, round_id, depth))
            rounds += 1
            round_id += 1
            drafts += len(rows)
            accepted += result.accepted
            tokens += len(result.tokens)
            for i in range(result.accepted):
                per_position[i] += 1
    seconds = time.perf_counter() - started
    return {
        "requests": requests,
        "rounds": rounds,
        "tokens": tokens,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_accepted_length": accepted / rounds if rounds else 0.0,
        "accepted_per_position": per_position,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
    }


#: The runs of the daemon demo: (title, --depth, --support); depth None: the demo's --depth.
RUNS = (
    ("target-only", 0, "dense"),
    ("speculative, dense q", None, "dense"),
    ("speculative, sparse:32 q", None, "sparse:32"),
)


def _shown(env: dict[str, str], cmd: Sequence[str], program: str, on: Sequence[int] | None) -> str:
    """``cmd`` (``python -m module ...``) as the user would type it, with its pace and cores."""
    pin = [] if on is None else ["taskset", "-c", ",".join(map(str, on))]
    return "$ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *pin, program, *cmd[3:]])


def _side_by_side(args: argparse.Namespace, runs: list[tuple[str, dict[str, Any]]]) -> None:
    plain = runs[0][1]["tokens_per_second"]
    print(
        f"\ntarget {args.target_ms:g} ms per call (one call scores a whole step), drafter "
        f"{args.drafter_ms:g} ms per call, {args.requests} requests x {args.max_tokens} tokens:"
    )
    print(f"  {'':26s} {'tokens/s':>10s} {'vs target-only':>15s} {'mean accepted length':>21s}")
    for title, summary in runs:
        rate = summary["tokens_per_second"]
        length = f"{summary['mean_accepted_length']:.2f}" if summary["draft_tokens"] else ""
        print(f"  {title:26s} {rate:10.1f} {rate / plain:14.2f}x {length:>21s}")


def run_daemons(args: argparse.Namespace) -> int:
    """Start the worker, run the Spark side target-only and speculative, stop the worker."""
    drafter_env = {DRAFTER_MS_ENV: f"{args.drafter_ms:g}"}
    target_env = {TARGET_MS_ENV: f"{args.target_ms:g}"}
    title, drafters, target_plugin = PAIRS[args.models]
    drafter_plugin = drafters[args.drafter_kind]
    drafter_flags: list[str] = []
    target_flags: list[str] = []
    if args.models == "ngram":
        # The tables are built (or read from the cache) here, once: the daemons only load them.
        try:
            drafter_id, target_id = ngram.identities()
        except ngram.CorpusMissingError as exc:
            print(f"pp1-demo: {exc} (or pp1-demo --models toy)", file=sys.stderr)
            return 1
        target_flags = ["--target-identity", target_id]
        drafter_flags = ["--draft-identity", drafter_id, *target_flags]
    worker_cmd = worker_command(
        "--drafter", drafter_plugin, *drafter_flags, "--max-slots", str(args.requests),
        "--metrics-port", "0", vocab=args.vocab, seed=args.seed,
    )  # fmt: skip
    halves = split_cores() if args.pin else None
    worker_on, spark_on = (None, None) if halves is None else halves
    print(_shown(drafter_env, worker_cmd, "pp1-worker", worker_on), flush=True)
    runs: list[tuple[str, dict[str, Any]]] = []
    try:
        env = {**os.environ, **drafter_env}
        with worker_process(command=pinned(worker_cmd, worker_on), env=env) as worker:
            print(
                f"  worker up at {worker.address} ({title}, drafter hands over "
                f"{args.drafter_kind}, vocabulary {args.vocab})"
            )
            for title, depth, support in RUNS:
                spark_cmd = spark_command(
                    worker.address,
                    "--target", target_plugin,
                    *target_flags,
                    "--seed", str(args.seed),
                    "--requests", str(args.requests),
                    "--concurrency", str(args.requests),
                    "--max-tokens", str(args.max_tokens),
                    "--depth", str(args.depth if depth is None else depth),
                    "--support", support,
                    "--temperature", repr(args.temperature),
                    "--json",
                    vocab=args.vocab,
                )  # fmt: skip
                print(_shown(target_env, spark_cmd, "pp1-spark", spark_on), flush=True)
                done = subprocess.run(
                    pinned(spark_cmd, spark_on),
                    capture_output=True,
                    text=True,
                    check=False,
                    env={**os.environ, **target_env},
                )
                if done.returncode != 0:
                    print(done.stderr, file=sys.stderr)
                    return done.returncode
                summary = json.loads(done.stdout)
                runs.append((title, summary))
                metrics.print_summary(f"  {title}:", summary, 24)
            _side_by_side(args, runs)
            assert worker.metrics is not None  # started with --metrics-port 0
            text = metrics.scrape_page(worker.metrics)
            wanted = (
                "pp1_worker_steps_total",
                "pp1_worker_rows_total",
                "pp1_worker_replays_total",
                "pp1_worker_reply_bytes_total",
            )
            print(f"$ curl http://{worker.metrics}/metrics")
            for metric_line in text.splitlines():
                if metric_line.startswith(wanted):
                    name, value = metric_line.rsplit(" ", 1)
                    print(f"  {name} {float(value):,.0f}")  # counters: whole numbers
    except WorkerStartError as exc:
        print(f"pp1-demo: {exc}", file=sys.stderr)
        return 1
    print(f"  worker stopped on SIGTERM, exit code {worker.returncode}")
    return 0 if worker.returncode == 0 else 1


_HELP: dict[str, str] = {
    "--models": "the model pair: ngram (learned from the English text that ships with Python: the "
    "statistics of real language) or toy (the exactness tests' pair)",
    "--drafter-kind": "what the paced drafter hands over (daemons only): its FP32 probabilities, "
    "as a draft head on a device does (q built with no exponential), or its logits",
    "--vocab": "vocabulary size, in token IDs (the n-gram pair has about 3,700 tokens: IDs beyond "
    "them have probability zero; a smaller vocabulary keeps its most frequent)",
    "--seed": "toy model family seed",
    "--requests": "requests per run, all in one step (the daemons run target-only, dense q, then "
    "sparse top-32 q)",
    "--max-tokens": "tokens generated per request",
    "--depth": "draft tokens per proposal, 1..5",
    "--target-ms": "what one target call costs (a prefix or a whole step's batch), in milliseconds",
    "--drafter-ms": "what one drafter call costs (a prefix or a batch), in milliseconds",
    "--no-pin": "leave both daemons unpinned (by default, with two or more cores, pp1-worker runs "
    "on the first half of this process's cores and pp1-spark on the other half, as if on machines "
    "of their own)",
    "--in-process": "no daemons, no sockets: the proposal chain and the verifier in one process",
    "--support": "with --in-process: dense or sparse top-K q (default: dense; the daemons run "
    "both)",
    "--temperature": "proposal temperature (0: greedy)",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``pp1-demo`` argument parser."""
    p = settings.parser("pp1-demo", __doc__)
    add = settings.adder(p, _HELP)
    add("--models", None, "ngram", "ngram|toy", choices=tuple(PAIRS))
    add("--drafter-kind", None, "probs", "probs|logits", choices=("probs", "logits"))
    add("--vocab", settings.vocabulary, DEFAULT_VOCAB, "TOKENS")
    add("--seed", settings.count, 0, "N")
    add("--requests", settings.positive, 8, "N")
    add("--max-tokens", settings.positive, 64, "TOKENS")
    add("--depth", settings.depth, 5, "N")
    add("--target-ms", settings.pace_ms, 20.0, "MS")
    add("--drafter-ms", settings.pace_ms, 0.5, "MS")
    add("--no-pin", dest="pin", action="store_false")
    add("--in-process", action="store_true")
    add("--support", None, None, "dense|sparse:K")
    add("--temperature", settings.temperature, 1.0, "T")
    return p


def _support(text: str | None, vocab: int) -> int | None:
    """``--support`` as a sparse K, or None for dense.

    Raises:
        settings.SettingsError: for anything but ``dense`` or ``sparse:K``, K in 1..vocab.
    """
    if text is None:
        return None
    try:
        k = settings.parse_support(text)
    except settings.SettingsError:
        k = vocab + 1
    if k > vocab:
        raise settings.SettingsError(
            f"--support {text!r} is not dense or sparse:K with K in 1..{vocab}"
        )
    return k or None


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2, with one line, for a bad flag)."""
    parser = build_parser()
    settings.one_line_errors(parser)
    try:
        args = parser.parse_args(argv)
        support = _support(args.support, args.vocab)
        if not args.in_process and args.support is not None:
            raise settings.SettingsError(
                "--support applies only with --in-process (the daemons run dense and sparse:32)"
            )
    except settings.SettingsError as exc:
        print(f"pp1-demo: {exc}", file=sys.stderr)
        return 2
    if not args.in_process:
        return run_daemons(args)
    try:
        stats = run_in_process(
            pair=args.models,
            vocab_size=args.vocab,
            seed=args.seed,
            requests=args.requests,
            max_tokens=args.max_tokens,
            depth=args.depth,
            support=support,
            temperature=args.temperature,
            prompt=[1, 2, 3],
        )
    except ngram.CorpusMissingError as exc:
        print(f"pp1-demo: {exc} (or pp1-demo --models toy)", file=sys.stderr)
        return 1
    title = f"pp1wire in-process round trip ({PAIRS[args.models][0]}): vocab {args.vocab}, "
    metrics.print_summary(f"{title}depth {args.depth}", stats, 24)
    return 0


if __name__ == "__main__":
    sys.exit(main())
