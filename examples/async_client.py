"""The asyncio client: a few requests stepped together, verified locally, with fallbacks.

Start a worker (``pp1-worker --port 7070 --vocab 4096``), then run
``python examples/async_client.py --worker 127.0.0.1:7070 --vocab 4096``.

The same loop as ``examples/engine_sampler.py``, for a sampler that runs on an
event loop: ``await client.propose_many(...)`` leaves the loop free while the
worker drafts.
"""

from __future__ import annotations

import argparse
import asyncio

from pp1wire import (
    TARGET_FAILURES,
    AsyncClient,
    ProposalUnavailableError,
    RoundResult,
    SparkConfig,
    derive_seed,
    step_prefixes,
    toy_target,
    verify_step,
)


async def main(worker: str, vocab: int, tokens: int, batch: int) -> None:
    host, port = worker.rsplit(":", 1)
    model = toy_target(vocab)  # the engine's model stands here
    config = SparkConfig(vocab_size=vocab, max_slots=batch)
    async with await AsyncClient.connect(host, int(port), config) as client:
        running = [
            await client.open_request(i, seed=derive_seed(0, i), prompt=[1, 2, 3])
            for i in range(batch)
        ]
        fallback: set[int] = set()  # slots whose next round must be target-only
        fallbacks = 0
        while running:
            asking = [r for r in running if r.slot not in fallback]
            with await client.propose_many(asking, depth=5) as proposals:
                got = {r.slot: outcome for r, outcome in zip(asking, proposals, strict=True)}
                for slot, outcome in got.items():
                    if isinstance(outcome, ProposalUnavailableError):  # refused, corrupt, late
                        print(f"slot {slot}: no proposal ({outcome.code.name}), target-only")
                rounds = [r.round_for(got.get(r.slot)) for r in running]
                fallbacks += sum(proposal is None for _, proposal, _ in rounds)
                results = verify_step(rounds, model.batch(step_prefixes(rounds)))
            fallback.clear()
            for request, result in zip(running, results, strict=True):
                if isinstance(result, RoundResult):
                    client.commit_round(request, result)  # no need to await COMMITTED
                elif result.code not in TARGET_FAILURES:
                    fallback.add(request.slot)  # the proposal was refused: next round target-only
            for request in [r for r in running if len(r.tokens) >= tokens or r.verifier.poisoned]:
                await client.close_request(request)
                running.remove(request)
                print(f"slot {request.slot}: {request.tokens}")
    print(f"generated {batch} requests, {fallbacks} fallbacks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", default="127.0.0.1:7070")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.worker, args.vocab, args.tokens, args.batch))
