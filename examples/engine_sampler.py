"""An engine's sampler loop on pp1wire's public API: a batch of requests, one call per stage.

Start a worker (``pp1-worker --port 7070 --vocab 4096``), then run
``python examples/engine_sampler.py --worker 127.0.0.1:7070 --vocab 4096``.

Each engine step, for every running request at once:

1. ``propose_many``: one STEP per request, sent in one write; each request gets
   its proposal or the reason it has none.
2. The engine's forward pass scores every prefix of the step in one batched
   call (the toy target stands in for the engine's model).
3. ``verify_step`` decides every round from those rows in one call.
4. ``commit_round`` tells the worker what each request committed.

A request whose proposal is missing decodes that round target-only; one whose
proposal was refused decodes its next round target-only; one whose target failed
stops. A proposal that is late is never dropped: when the step's deadline
(``--step-timeout``, else the reply timeout) passes, it is **cut** at the rows
that arrived, and those rows are verified like any block (``docs/adaptive.md``
§7) — dropping them, with ``round_for(None)``, would keep exactly the blocks
that were quick to draw, which biases the output whenever drafting time
depends on what was drafted. Request i has seed ``derive_seed(--seed, i)`` and runs on slot
``i mod --concurrency``, so with the same flags and worker this emits exactly the
tokens ``pp1-spark`` emits (``docs/runner.md``).
"""

from __future__ import annotations

import argparse
import json
from collections import deque

from pp1wire import (
    TARGET_FAILURES,
    ConnectionLostError,
    RefusedError,
    Request,
    RoundResult,
    SparkConfig,
    SyncClient,
    derive_seed,
    step_prefixes,
    toy_target,
    verify_step,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--worker", default="127.0.0.1:7070", help="HOST:PORT")
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--depth", type=int, default=5, help="drafts per proposal, 1..5")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--support", type=int, default=0, help="sparse top-k, up to 256 (0: dense)")
    p.add_argument("--eos", type=int, default=None)
    p.add_argument("--output", default=None, help="JSONL: one record per request")
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        help="seconds a step waits for its proposals; a late one is cut at the rows that "
        "arrived (default: the client's reply timeout)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    host, port = args.worker.rsplit(":", 1)
    model = toy_target(args.vocab, args.seed)  # the engine's model: .batch(prefixes) -> [N, V]
    prompt = [1, 2, 3]
    queues = [deque(range(s, args.requests, args.concurrency)) for s in range(args.concurrency)]
    config = SparkConfig(vocab_size=args.vocab, max_slots=args.concurrency)
    running: dict[int, tuple[int, Request]] = {}  # slot -> (request index, request)
    fallback: set[int] = set()  # slots whose next round must be target-only
    done: dict[int, Request] = {}  # request index -> its ended request
    fallbacks = cuts = 0

    with SyncClient(host, int(port), config) as client:
        while True:
            for slot, queue in enumerate(queues):  # continuous batching: fill free slots
                if slot not in running and queue:
                    i = queue.popleft()
                    seed = derive_seed(args.seed, i)
                    request = client.open_request(slot, seed=seed, prompt=prompt, eos=args.eos)
                    running[slot] = (i, request)
            if not running:
                break
            step = [request for _, request in running.values()]
            asking = [r for r in step if r.slot not in fallback]
            with client.propose_many(
                asking,
                depth=args.depth,
                temperature=args.temperature,
                support=args.support,
                timeout=args.step_timeout,  # late proposals come back cut, not missing
            ) as batch:
                got = {r.slot: outcome for r, outcome in zip(asking, batch, strict=True)}
                # A missing proposal (or a planned fallback) makes the round target-only;
                # a cut one (a fault ended its block early) is verified as it is.
                rounds = [r.round_for(got.get(r.slot)) for r in step]
                fallbacks += sum(proposal is None for _, proposal, _ in rounds)
                cuts += sum(p is not None and p.cut is not None for _, p, _ in rounds)
                probs = model.batch(step_prefixes(rounds))  # the engine's forward pass
                results = verify_step(rounds, probs)  # every round of the step, one call
            fallback.clear()
            for request, result in zip(step, results, strict=True):
                if not isinstance(result, RoundResult):
                    if result.code not in TARGET_FAILURES:
                        fallback.add(request.slot)  # proposal refused: next round target-only
                    continue  # a target failure poisons the request: it stops below
                try:
                    client.commit_round(request, result)
                except RefusedError:  # the worker refused this slot earlier: open it again
                    client.reopen(request)
                except ConnectionLostError:
                    pass  # no worker any more: every later round falls back to target-only
            for slot, (i, request) in list(running.items()):
                v = request.verifier
                if v.finished or v.poisoned or len(request.tokens) >= args.max_tokens:
                    client.close_request(request)
                    done[i] = request
                    del running[slot]
                    fallback.discard(slot)

    if args.output:
        with open(args.output, "w") as f:
            for i, request in sorted(done.items()):
                record = {"request": i, "seed": request.verifier.seed, "tokens": request.tokens}
                f.write(json.dumps(record) + "\n")
    tokens = sum(len(r.tokens) for r in done.values())
    print(
        f"{len(done)} requests, {tokens} tokens, {fallbacks} target-only rounds, "
        f"{cuts} cut blocks"
    )


if __name__ == "__main__":
    main()
