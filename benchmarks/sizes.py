"""Encoded size of one depth-5 reply (REPLY rows + COMPLETION) against its q payload.

Run: ``python benchmarks/sizes.py [--json]``. Field values are set high on
purpose (round 70,000, position 100,000, token 129,279, session 1,000) so the
msgpack integers take their wider encodings; every sparse row carries exactly
k entries.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from pp1wire.q import dyadic
from pp1wire.q.proposal import QRow
from pp1wire.wire.messages import Step
from pp1wire.wire.replies import build_reply

VOCAB = 129_280
DEPTH = 5


def reply_size(support: int | None) -> tuple[int, int]:
    """(encoded bytes of the whole reply, q payload bytes) for one request."""
    step = Step(
        session=1000,
        slot=3,
        generation=2,
        round=70_000,
        position=100_000,
        digest=2**64 - 1,
        depth=DEPTH,
        temperature=1.0,
        support=support or 0,
        context=2**40,
    )
    rows = []
    for _ in range(DEPTH):
        if support is None:
            counts = dyadic.point_mass(VOCAB, VOCAB - 1)
            rows.append(QRow(token=VOCAB - 1, counts=counts))
        else:
            ids = np.arange(VOCAB - support, VOCAB, dtype=np.int32)
            counts = np.full(support, dyadic.M // support, dtype=np.int64)
            counts[0] += dyadic.M - int(counts.sum())
            rows.append(QRow(token=VOCAB - 1, counts=counts, ids=ids))
    payload = DEPTH * (4 * VOCAB if support is None else 8 * support)
    return len(build_reply(1000, step, tuple(rows), VOCAB)), payload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    table = {}
    for name, support in [
        ("dense", None),
        ("sparse16", 16),
        ("sparse32", 32),
        ("sparse64", 64),
        ("sparse256", 256),
    ]:
        total, payload = reply_size(support)
        table[name] = {
            "encoded": total,
            "payload": payload,
            "overhead": (total - payload) / payload,
        }
    if args.json:
        print(json.dumps(table))
        return 0
    print(f"depth-{DEPTH} reply, vocabulary {VOCAB}")
    print(f"{'layout':10s} {'payload B':>12s} {'encoded B':>12s} {'overhead':>10s}")
    for name, row in table.items():
        print(f"{name:10s} {row['payload']:12,d} {row['encoded']:12,d} {row['overhead']:10.4%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
