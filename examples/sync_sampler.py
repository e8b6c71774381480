"""Embedding pp1wire in a plain synchronous sampler loop (vLLM/SGLang-style layout).

Start a worker first (``pp1-worker --port 7070 --vocab 4096``), then run
``python examples/sync_sampler.py --worker 127.0.0.1:7070 --vocab 4096``.

Each step the "engine" asks the worker for a proposal per request, lays the
drafts out flat (``draft_token_ids[num_tokens]``, ``num_draft_tokens[batch]``),
computes target probabilities for every draft position plus one bonus position
(``[num_tokens + batch, V]``), verifies, and gets accepted tokens out as
``[batch, k + 1]`` padded with -1. A request with no usable proposal decodes
that step target-only.
"""

from __future__ import annotations

import argparse

import numpy as np

from pp1wire.aio.client import (
    ProposalUnavailableError,
    SyncClient,
    flatten_drafts,
    pack_outputs,
    target_rows,
)
from pp1wire.apps.models import ToyLM
from pp1wire.apps.settings import host_port
from pp1wire.q.rng import derive_seed
from pp1wire.q.verify import RequestVerifier
from pp1wire.wire.spark_core import SparkConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", default="127.0.0.1:7070")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    host, port = host_port(args.worker)
    model = ToyLM(args.vocab, 0)  # stands in for the engine's target forward pass
    prompts = [[1, 2, 3], [4, 5], [6]]
    with SyncClient(host, port, SparkConfig(vocab_size=args.vocab, max_depth=args.depth)) as client:
        verifiers = []
        for slot in range(args.batch):
            seed = derive_seed(0, slot)
            prompt = prompts[slot % len(prompts)]
            client.open(slot, seed=seed, prefix=prompt)
            verifiers.append(
                RequestVerifier(
                    session=client.session,
                    seed=seed,
                    vocab_size=args.vocab,
                    prefix=prompt,
                    target=model.probs,
                )
            )
        for step in range(args.steps):
            proposals = []
            for slot in range(args.batch):
                try:
                    proposals.append(
                        client.propose(
                            slot, round_id=verifiers[slot].take_round(), depth=args.depth
                        )
                    )
                except ProposalUnavailableError:
                    proposals.append(None)
            draft_ids, draft_counts = flatten_drafts(proposals)
            # The engine's forward pass: p for each draft position and the bonus position.
            rows = []
            for slot, proposal in enumerate(proposals):
                ctx = list(verifiers[slot].committed)
                drafts = [] if proposal is None else list(proposal.tokens)
                for j in range(len(drafts) + 1):
                    rows.append(model.probs(ctx + drafts[:j]))
            target_probs = np.stack(rows)
            blocks = target_rows(target_probs, draft_counts)
            outputs = []
            for slot, (proposal, block) in enumerate(zip(proposals, blocks, strict=True)):
                v = verifiers[slot]
                base = len(v.committed)
                # The verifier reads p from the engine's rows by position in the block.
                v.target = lambda prefix, block=block, base=base: block[len(prefix) - base]
                if proposal is None:
                    result = v.decode_target_only(v.take_round())
                else:
                    result = v.verify(proposal)
                    client.release(proposal, slot)
                client.commit(
                    slot, round_id=result.round_id, tokens=result.tokens, accepted=result.accepted
                )
                outputs.append(result.tokens)
            out = pack_outputs(outputs, args.depth)
            print(f"step {step}: drafts {draft_ids.tolist()} counts {draft_counts.tolist()}")
            print(f"         accepted tokens [batch, k+1]:\n{out}")
        for slot in range(args.batch):
            client.close_slot(slot)


if __name__ == "__main__":
    main()
