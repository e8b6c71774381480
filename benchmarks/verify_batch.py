"""Spark-side verification of one engine step: the whole step at once against per request.

Run: ``python benchmarks/verify_batch.py [--smoke] [--json] [--reps N] [--vocab V]``.

A step is 8 rounds x depth 5 (48 target rows, already scored: the target's
cost is not in these figures) or 8 target-only rounds (8 rows). Each case is
decided two ways, interleaved and in alternating order in every repetition
(the machines are shared and noisy):

* ``per-request``: today's path per round, :meth:`RequestVerifier.verify`
  with ``scores=`` (or :meth:`~RequestVerifier.decode_target_only` with
  ``score=``), 8 calls;
* ``step``: one :func:`pp1wire.q.verify.verify_step` over the 8 rounds with
  the rows as one ``(N, V)`` array (the compiled row operations when built, on
  their default threads: 2, or 1 in a process pinned to one core);
* ``step_1thread``: the same on one thread.

Every repetition checks that both commit the same tokens (exit 1 otherwise).
The q rows are dense FP32, as they arrive from the worker; the target rows
are FP32 (an engine's probabilities) or FP64, and a torch CPU tensor (viewed
through DLPack) for the ``torch`` case. The drafter's logits are the target's
plus noise, so about 0.6 of the drafts are accepted.

Figures, each the median (min..max) over the repetitions: wall ms per step,
CPU ms per committed token (verified tokens, or target-only tokens; CPU is the
process's, every thread), and the ratio of each way to per-request within each
repetition (wall and CPU). ``verified_f32_numpy_only`` runs both ways without
any compiled code (the fallback install): the numpy walk against numpy per
request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pp1wire.errors import VerifyError
from pp1wire.q import dyadic, targetrows, tree, walk
from pp1wire.q.proposal import Proposal, QRow, propose
from pp1wire.q.rng import Role, RoundStreams
from pp1wire.q.verify import RequestVerifier, RoundResult, proposal_from_rows, verify_step

ROUNDS = 8
DEPTH = 5
NOISE = 0.5  # draft logits = target logits + NOISE * N(0, 1): acceptance about 0.65


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class Step:
    """One step's rounds, proposals and target rows (rebuilt verifiers each repetition)."""

    def __init__(self, vocab: int, target_only: bool, seed: int = 1) -> None:
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.target_only = target_only
        per_round = 1 if target_only else DEPTH + 1
        logits = rng.standard_normal((ROUNDS * per_round, vocab)) * 3.0
        self.rows64 = np.stack([_softmax(row) for row in logits])
        self.rows32 = self.rows64.astype(np.float32)
        self.proposals: list[Proposal | None] = []
        for k in range(ROUNDS):
            if target_only:
                self.proposals.append(None)
                continue
            v = self.verifier(k)
            base = len(v.committed)
            noise = rng.standard_normal(vocab) * NOISE

            def drafter(
                prefix: Sequence[int], k: int = k, base: int = base, noise: np.ndarray = noise
            ) -> np.ndarray:
                return logits[k * per_round + len(prefix) - base] + noise

            streams = RoundStreams(Role.WORKER, v.seed, v.generation, 0)
            rows = propose(v.committed, DEPTH, drafter, streams)
            wire = [QRow(r.token, q32=dyadic.counts_to_fp32(np.asarray(r.counts))) for r in rows]
            self.proposals.append(proposal_from_rows(v, wire, 0, DEPTH))
        self.per_round = per_round

    def verifier(self, k: int) -> RequestVerifier:
        return RequestVerifier(
            session=1, seed=1000 + k, vocab_size=self.vocab, prefix=[1, 2, 3 + k], target=_unused
        )

    def per_request(self, rows: np.ndarray) -> list[RoundResult | VerifyError]:
        out: list[RoundResult | VerifyError] = []
        for k, proposal in enumerate(self.proposals):
            v = self.verifier(k)
            mine = rows[k * self.per_round : (k + 1) * self.per_round]
            if proposal is None:
                out.append(v.decode_target_only(0, score=mine[0]))
            else:
                out.append(v.verify(proposal, scores=list(mine)))
        return out

    def step(self, rows: Any, threads: int | None = None) -> list[RoundResult | VerifyError]:
        rounds = [(self.verifier(k), p, 0) for k, p in enumerate(self.proposals)]
        return verify_step(rounds, rows, threads=threads)


def _unused(prefix: Sequence[int]) -> np.ndarray:
    raise AssertionError("the rows are scored before verification")


def _timed(fn: Callable[[], list[Any]]) -> tuple[list[Any], float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def _tokens(results: list[Any]) -> list[tuple[int, ...]]:
    if any(isinstance(r, VerifyError) for r in results):
        raise SystemExit(f"a round failed: {results}")
    return [r.tokens for r in results]


def measure(step: Step, ways: dict[str, Callable[[], list[Any]]], reps: int) -> dict[str, Any]:
    """Per repetition: every way (``per_request`` first among them: the baseline), in an
    order that rotates from one repetition to the next."""
    names = list(ways)
    figures: dict[str, list[float]] = {}
    tokens = accepted = rejected = 0
    for rep in range(reps + 1):  # the first repetition warms up and is not counted
        order = names[rep % len(names) :] + names[: rep % len(names)]
        got = {name: _timed(ways[name]) for name in order}
        want = _tokens(got["per_request"][0])
        for name in names:
            if _tokens(got[name][0]) != want:
                raise SystemExit(f"{name} and per-request committed different tokens")
        if rep == 0:
            continue
        tokens = sum(len(t) for t in want)
        accepted = sum(r.accepted for r in got["per_request"][0])
        rejected = sum(r.outcome.value == "correction" for r in got["per_request"][0])
        base = got["per_request"]
        for name in names:
            _, cpu, wall = got[name]
            figures.setdefault(f"{name}_wall_ms", []).append(wall * 1e3)
            figures.setdefault(f"{name}_cpu_ms", []).append(cpu * 1e3)
            figures.setdefault(f"{name}_cpu_ms_per_token", []).append(cpu * 1e3 / tokens)
            if name != "per_request":
                figures.setdefault(f"{name}_ratio_wall", []).append(wall / base[2])
                figures.setdefault(f"{name}_ratio_cpu", []).append(cpu / base[1])
    out: dict[str, Any] = {
        key: {"median": statistics.median(v), "min": min(v), "max": max(v)}
        for key, v in figures.items()
    }
    out["tokens_per_step"] = tokens
    if not step.target_only:  # accepted drafts / drafts tested
        out["acceptance"] = accepted / (accepted + rejected)
    return out


def _ways(step: Step, rows: np.ndarray, engine_rows: Any) -> dict[str, Callable[[], list[Any]]]:
    return {
        "per_request": lambda: step.per_request(rows),
        "step": lambda: step.step(engine_rows),
        "step_1thread": lambda: step.step(engine_rows, threads=1),
    }


def run(vocab: int, reps: int) -> dict[str, Any]:
    verified, target_only = Step(vocab, False), Step(vocab, True)
    cases: dict[str, Any] = {
        "verified_f32": measure(verified, _ways(verified, verified.rows32, verified.rows32), reps),
        "verified_f64": measure(verified, _ways(verified, verified.rows64, verified.rows64), reps),
        "target_only_f32": measure(
            target_only, _ways(target_only, target_only.rows32, target_only.rows32), reps
        ),
    }
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        tensor = torch.from_numpy(verified.rows32)  # an engine's CPU tensor, viewed not copied
        cases["verified_torch_cpu_f32"] = measure(
            verified, _ways(verified, verified.rows32, tensor), reps
        )
    compiled = targetrows._fastq
    if compiled is not None:
        # Without any compiled code (both ways): the numpy walk against numpy per request.
        targetrows._fastq = tree._fastq = walk._fastq = None
        try:
            cases["verified_f32_numpy_only"] = measure(
                verified,
                {
                    "per_request": lambda: verified.per_request(verified.rows32),
                    "step": lambda: verified.step(verified.rows32),
                },
                max(3, reps // 4),
            )
        finally:
            targetrows._fastq = tree._fastq = walk._fastq = compiled
    return {
        "vocab": vocab,
        "rounds": ROUNDS,
        "depth": DEPTH,
        "reps": reps,
        "compiled": compiled is not None,
        "threads": targetrows.step_threads(),
        "cases": cases,
    }


def _cell(f: dict[str, float], digits: int = 3) -> str:
    return f"{f['median']:.{digits}f} ({f['min']:.{digits}f}..{f['max']:.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="a short run at V = 4096")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--vocab", type=int, default=129_280)
    args = parser.parse_args()
    vocab, reps = (4096, 3) if args.smoke else (args.vocab, args.reps)
    result = run(vocab, reps)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"V = {vocab}, {ROUNDS} rounds x depth {DEPTH}, {reps} repetitions (compiled step: "
        f"{result['compiled']}, {result['threads']} threads by default); median (min..max)"
    )
    for name, c in result["cases"].items():
        print(f"\n{name}: {c['tokens_per_step']} tokens per step", end="")
        print(f", acceptance {c['acceptance']:.2f}" if "acceptance" in c else "")
        ways = [k[: -len("_wall_ms")] for k in c if k.endswith("_wall_ms")]
        for way in ways:
            print(
                f"  {way:13s} wall ms/step {_cell(c[way + '_wall_ms'])}"
                f"   CPU ms/token {_cell(c[way + '_cpu_ms_per_token'])}"
            )
        for way in ways[1:]:
            print(
                f"  {way} / per_request: wall {_cell(c[way + '_ratio_wall'])}"
                f"  CPU {_cell(c[way + '_ratio_cpu'])}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
