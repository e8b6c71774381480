"""In-process round trip: toy draft logits → dyadic q → sampled block → verification.

Runs the worker's proposal chain and the Spark side's verifier in one process,
with every q row encoded to its FP32 wire form and validated on "receipt" the
way the transport will, and prints acceptance statistics.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from pp1wire import dyadic
from pp1wire.models import DEFAULT_VOCAB, toy_drafter, toy_target
from pp1wire.proposal import QRow, propose
from pp1wire.rng import Role, RoundStreams, derive_seed
from pp1wire.verify import RequestVerifier, proposal_from_rows


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


def run(
    *,
    vocab_size: int,
    seed: int,
    requests: int,
    max_tokens: int,
    depth: int,
    support: int | None,
    temperature: float,
    prompt: Sequence[int],
) -> dict[str, float | int]:
    """Generate ``requests`` sequences and return the summary statistics."""
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
        "tokens_per_round": tokens / rounds if rounds else 0.0,
        "accepted_per_position": per_position,  # type: ignore[dict-item]
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="pp1-demo", description=__doc__)
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--support", default="dense", help="dense or sparse:K")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    support = None if args.support == "dense" else int(args.support.split(":", 1)[1])
    stats = run(
        vocab_size=args.vocab,
        seed=args.seed,
        requests=args.requests,
        max_tokens=args.max_tokens,
        depth=args.depth,
        support=support,
        temperature=args.temperature,
        prompt=[1, 2, 3],
    )
    if args.json:
        print(json.dumps(stats))
        return 0
    print(
        f"pp1wire in-process round trip: vocab {args.vocab}, depth {args.depth}, q {args.support}"
    )
    for key, value in stats.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key:24s} {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
