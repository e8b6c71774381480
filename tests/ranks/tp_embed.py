"""Run under torchrun (2 ranks): an engine's own process group drives a SparkGroup.

The "engine" makes a subgroup of its own and passes it in; rank 0 draws
proposals in-process (dense and sparse:4, no worker), publishes each through
the group, and checks that every committed round equals what a single-process
``RequestVerifier.verify`` of the same proposal commits. Every rank checks that
the ranks ran the same number of collectives and hold the same prefixes.
Exit code 0 only if all of it holds on this rank.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from pp1wire.apps.models import drafter_factory, target_factory
from pp1wire.q.proposal import propose
from pp1wire.q.rng import Role, RoundStreams, derive_seed
from pp1wire.q.verify import RequestVerifier, proposal_from_rows
from pp1wire.tp.fanout import Header
from pp1wire.tp.group import SparkGroup

V = 64
REQUESTS = 4
ROUNDS = 6
PROMPT = [1, 2, 3]


def verifier(request: int) -> RequestVerifier:
    return RequestVerifier(
        session=7,
        seed=derive_seed(11, request),
        vocab_size=V,
        prefix=PROMPT,
        target=target_factory(V, 11),
    )


def main() -> int:
    dist.init_process_group("gloo")
    engine_group = dist.new_group([0, 1])
    group = SparkGroup(V, group=engine_group)
    failures = []
    if group.rank == 0:
        drafter = drafter_factory(V, 11)
        mine = {r: verifier(r) for r in range(REQUESTS)}
        alone = {r: verifier(r) for r in range(REQUESTS)}
        for round_id in range(ROUNDS):
            for r in range(REQUESTS):
                v = mine[r]
                if v.finished:
                    continue
                streams = RoundStreams(Role.WORKER, v.seed, v.generation, round_id)
                rows = propose(v.committed, 3, drafter, streams, support=4 if r % 2 else None)
                proposal = proposal_from_rows(v, rows, round_id, 3)
                decision = group.lead_proposal(r, v, proposal)
                want = alone[r].verify(proposal_from_rows(alone[r], rows, round_id, 3))
                if decision.result is None or decision.result.tokens != want.tokens:
                    failures.append(f"request {r} round {round_id}: {decision} vs {want}")
        reports = group.lead_stop()
        if any(mine[r].committed != alone[r].committed for r in range(REQUESTS)):
            failures.append("committed prefixes differ from the single-process run")
    else:

        def verifier_for(header: Header) -> RequestVerifier:
            return group.held.get(header.request) or verifier(header.request)

        reports = group.follow(verifier_for)
    if len({r.collectives for r in reports}) != 1 or len({r.prefixes_digest for r in reports}) != 1:
        failures.append(f"ranks disagree: {reports}")
    attempts = reports[0].attempts
    if reports[0].collectives != 3 * (attempts - 1) + reports[0].bulk + 2:
        failures.append(f"{reports[0].collectives} collectives for {attempts} attempts")
    dist.destroy_process_group()
    for f in failures:
        print(f"rank {group.rank}: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
