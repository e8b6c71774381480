"""What frame integrity (protocol §5.1) costs on the benchmark's rounds.

Run: ``python benchmarks/integrity_cost.py [--rounds N] [--reps N]``.

Two workers in the same run, one plain and one with ``--psk-file`` (every frame
after the handshake tagged with HMAC-SHA256 on the worker and checked on the
Spark side), each answering the benchmark's rounds from its replay cache: the
4-request x depth-5 dense round at vocabulary 129,280 (10.3 MB of q) and the
one-request depth-5 sparse k = 32 round. Variants are interleaved round by
round; the figure is the median of the per-round ratios keyed / plain, with
the min-max across rounds beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import DENSE_SLOTS, SPARSE_SLOT, VOCAB, Pp1, ratio, summarize, timed  # noqa: E402

from pp1wire.apps.launch import worker_process  # noqa: E402
from pp1wire.apps.settings import install_uvloop  # noqa: E402

KEY = b"an integrity benchmark key"


async def measure(rounds: int, reps: int) -> dict[str, dict[str, float]]:
    """Per-round medians of both variants, dense and sparse; returns the ratio summaries."""
    with tempfile.TemporaryDirectory() as tmp:
        key_file = Path(tmp) / "psk"
        key_file.write_bytes(KEY)
        with (
            worker_process("--max-slots", "8", vocab=VOCAB) as plain_worker,
            worker_process("--max-slots", "8", "--psk-file", str(key_file), vocab=VOCAB) as keyed,
        ):
            plain = await Pp1.setup(plain_worker.port)
            tagged = await Pp1.setup(keyed.port, psk=KEY)
            cases = {
                "plain_dense": lambda: plain.replay(DENSE_SLOTS),
                "keyed_dense": lambda: tagged.replay(DENSE_SLOTS),
                "plain_sparse": lambda: plain.replay([SPARSE_SLOT]),
                "keyed_sparse": lambda: tagged.replay([SPARSE_SLOT]),
            }
            for fn in cases.values():
                await timed(fn, 3)
            samples: dict[str, list[float]] = {n: [] for n in cases}
            names = list(cases)
            for r in range(rounds):
                for name in names[r % 4 :] + names[: r % 4]:
                    n = reps if name.endswith("dense") else reps * 20
                    samples[name].append(await timed(cases[name], n))
            await plain.client.close()
            await tagged.client.close()
    out = {}
    for kind in ("dense", "sparse"):
        out[f"{kind}_ms_plain"] = summarize([x * 1e3 for x in samples[f"plain_{kind}"]])
        out[f"{kind}_ms_keyed"] = summarize([x * 1e3 for x in samples[f"keyed_{kind}"]])
        out[f"{kind}_keyed_over_plain"] = summarize(
            ratio(samples[f"keyed_{kind}"], samples[f"plain_{kind}"])
        )
    return out


def main() -> None:
    """Measure and print one line per figure."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    install_uvloop()
    figures = asyncio.run(measure(args.rounds, args.reps))
    for name, s in figures.items():
        print(f"{name:28s} median {s['median']:.3f}  (min {s['min']:.3f}, max {s['max']:.3f})")


if __name__ == "__main__":
    main()
