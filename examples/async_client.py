"""The async client: one request, proposals verified locally, target-only fallback.

Start a worker (``pp1-worker --port 7070 --vocab 4096``), then run
``python examples/async_client.py --worker 127.0.0.1:7070 --vocab 4096``.
"""

from __future__ import annotations

import argparse
import asyncio

from pp1wire.aio.client import AsyncClient, ProposalUnavailableError
from pp1wire.apps.models import ToyLM
from pp1wire.apps.settings import host_port
from pp1wire.q.rng import derive_seed
from pp1wire.q.verify import RequestVerifier
from pp1wire.wire.spark_core import SparkConfig


async def main(worker: str, vocab: int, tokens: int) -> None:
    host, port = host_port(worker)
    client = await AsyncClient.connect(host, port, SparkConfig(vocab_size=vocab))
    target = ToyLM(vocab, 0)  # the engine's target model stands here
    seed, prompt = derive_seed(0, 0), [1, 2, 3]
    generation = await client.open(0, seed=seed, prefix=prompt)
    verifier = RequestVerifier(
        session=client.session,
        seed=seed,
        vocab_size=vocab,
        prefix=prompt,
        target=target.probs,
        generation=generation,
    )
    fallbacks = 0
    while len(verifier.committed) - len(prompt) < tokens:
        try:
            proposal = await client.propose(
                0, round_id=verifier.take_round(), depth=5, temperature=1.0
            )
            result = verifier.verify(proposal)  # acceptance and correction draws are ours
            client.release(proposal, 0)  # its receive buffers can be reused
        except ProposalUnavailableError as exc:  # refused, corrupt, late, lost: fail closed
            fallbacks += 1
            print(f"no proposal this round ({exc.code.name}); decoding target-only")
            result = verifier.decode_target_only(verifier.take_round())
        client.commit(0, round_id=result.round_id, tokens=result.tokens, accepted=result.accepted)
        print(f"round {result.round_id}: accepted {result.accepted}, committed {result.tokens}")
    await client.close_slot(0)
    await client.close()
    print(f"generated {len(verifier.committed) - len(prompt)} tokens, {fallbacks} fallbacks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", default="127.0.0.1:7070")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    asyncio.run(main(args.worker, args.vocab, args.tokens))
