"""The main job: both daemons on loopback with the built-in toy models, and what happened.

``pp1-demo`` starts ``pp1-worker`` on a free loopback port, runs ``pp1-spark``
against it (dense q, then sparse top-32 q), reads the worker's Prometheus
metrics, stops the worker with SIGTERM and prints a summary of each step.
``pp1-demo --in-process`` instead runs the proposal chain and the verifier in
one process (no sockets), which is handy when debugging numerics.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from pp1wire.apps.launch import WorkerStartError, spark_command, worker_command, worker_process
from pp1wire.apps.models import DEFAULT_VOCAB, toy_drafter, toy_target
from pp1wire.q import dyadic
from pp1wire.q.proposal import QRow, propose
from pp1wire.q.rng import Role, RoundStreams, derive_seed
from pp1wire.q.verify import RequestVerifier, proposal_from_rows


def _receive(row: QRow, vocab_size: int, max_k: int) -> QRow:
    """Encode a row to its wire bytes and validate it as a receiver would."""
    assert row.counts is not None
    q = dyadic.counts_to_fp32(row.counts).tobytes()
    if row.ids is None:
        counts = dyadic.validate_dense(q, vocab_size, row.token)
        return QRow(token=row.token, counts=counts)
    ids, counts = dyadic.validate_sparse(
        row.ids.astype("<i4").tobytes(), q, vocab_size, max_k, row.token
    )
    return QRow(token=row.token, counts=counts, ids=ids)


def run_in_process(
    *,
    vocab_size: int,
    seed: int,
    requests: int,
    max_tokens: int,
    depth: int,
    support: int | None,
    temperature: float,
    prompt: Sequence[int],
) -> dict[str, Any]:
    """Generate ``requests`` sequences in one process; return the summary statistics."""
    target = toy_target(vocab_size, seed)
    drafter = toy_drafter(vocab_size, seed)
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
            target=target.probs,
        )
        round_id = 0
        while verifier.position - len(prompt) < max_tokens and not verifier.finished:
            worker = RoundStreams(Role.WORKER, request_seed, verifier.generation, round_id)
            rows = propose(
                verifier.committed,
                depth,
                drafter.logits,
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


def _print(title: str, stats: dict[str, Any]) -> None:
    print(title)
    for key, value in stats.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key:24s} {shown}")


def run_daemons(args: argparse.Namespace) -> int:
    """Start the worker, run the Spark side twice against it, stop the worker."""
    worker_cmd = worker_command("--metrics-port", "0", vocab=args.vocab, seed=args.seed)
    print("$ " + " ".join(["pp1-worker", *worker_cmd[3:]]), flush=True)
    try:
        with worker_process(command=worker_cmd) as worker:
            print(f"  worker up at {worker.address} (toy drafter, vocabulary {args.vocab})")
            for support in ("dense", "sparse:32"):
                spark_cmd = spark_command(
                    worker.address,
                    "--seed",
                    str(args.seed),
                    "--requests",
                    str(args.requests),
                    "--max-tokens",
                    str(args.max_tokens),
                    "--depth",
                    str(args.depth),
                    "--support",
                    support,
                    "--json",
                    vocab=args.vocab,
                )
                print("$ " + " ".join(["pp1-spark", *spark_cmd[3:]]), flush=True)
                done = subprocess.run(spark_cmd, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    print(done.stderr, file=sys.stderr)
                    return done.returncode
                _print(f"  q {support}:", json.loads(done.stdout))
            url = f"http://{worker.metrics}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            wanted = (
                "pp1_worker_steps_total",
                "pp1_worker_rows_total",
                "pp1_worker_replays_total",
                "pp1_worker_reply_bytes_total",
            )
            print(f"$ curl {url}")
            for metric_line in text.splitlines():
                if metric_line.startswith(wanted):
                    name, value = metric_line.rsplit(" ", 1)
                    print(f"  {name} {float(value):,.0f}")  # counters: whole numbers
    except WorkerStartError as exc:
        print(f"pp1-demo: {exc}", file=sys.stderr)
        return 1
    print(f"  worker stopped on SIGTERM, exit code {worker.returncode}")
    return 0 if worker.returncode == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="pp1-demo", description=__doc__)
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--in-process", action="store_true", help="no daemons, no sockets")
    parser.add_argument("--support", default="dense", help="with --in-process: dense or sparse:K")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    if not args.in_process:
        return run_daemons(args)
    support = None if args.support == "dense" else int(args.support.split(":", 1)[1])
    stats = run_in_process(
        vocab_size=args.vocab,
        seed=args.seed,
        requests=args.requests,
        max_tokens=args.max_tokens,
        depth=args.depth,
        support=support,
        temperature=args.temperature,
        prompt=[1, 2, 3],
    )
    _print(f"pp1wire in-process round trip: vocab {args.vocab}, depth {args.depth}", stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
