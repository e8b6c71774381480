"""The worker's device path: host CPU per row with a CUDA probabilities drafter, and bit-equality.

Run: ``python benchmarks/gpu_worker_check.py [--vocab V] [--steps N] [--json] [--out FILE]``
(``--json``: one JSON object on the last line; ``--out``: the same object to a file).

A probabilities drafter (``kind = "probs"``) whose ``batch`` returns a torch
tensor on a CUDA device has each position's rows built and drawn there, in
one batched call (``pp1wire.q.torch_ops.build_position``), then copied once
to page-locked host buffers that the replies are sent from. This script:

1. checks that ``propose_batch`` over that drafter gives, for every job, the
   rows the host path gives for the same FP32 probabilities (tokens, the wire
   values of dense rows, sparse IDs and counts, refusals): bit for bit, for a
   step of 8 slots x depth 5 with dense, sparse:32 and greedy rows;
2. measures the host CPU per drafted row of the worker's step with that
   drafter (``propose_batch`` and the reply frames, the process's CPU time
   over ``--steps`` steps): the goal is at most 0.05 ms, the host only sends.

Without CUDA, part 1 runs on CPU tensors (the same kernels) and part 2 is
skipped with one line. Exit status 0 when bit-equal (and, with CUDA, the
figures printed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from extras import require

try:
    import torch
except ImportError:  # the tp extra
    require("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pp1wire.apps.models import ToyLM
from pp1wire.errors import Pp1Error
from pp1wire.q.batch import propose_batch
from pp1wire.q.proposal import DraftJob, QRow
from pp1wire.wire.messages import Step
from pp1wire.wire.replies import reply_frames

SLOTS, DEPTH, CONTEXTS = 8, 5, 64
GOAL_MS_PER_ROW = 0.05


class TableDrafter:
    """The toy drafter's FP32 probabilities for 64 contexts, served from ``device``."""

    kind = "probs"

    def __init__(self, vocab: int, device: str) -> None:
        rows = ToyLM(vocab, 0, draft=True).probs_batch([[t] for t in range(CONTEXTS)])
        self.host = rows.astype(np.float32)
        self.table = torch.from_numpy(self.host).to(device)
        self.device = device

    def _at(self, prefixes: Any) -> list[int]:
        return [(int(p[-1]) if len(p) else 0) % CONTEXTS for p in prefixes]

    def __call__(self, prefix: Any) -> np.ndarray:
        return self.host[self._at([prefix])[0]]

    def batch(self, prefixes: Any) -> torch.Tensor:
        """The rows on the device: one gather, no host copy."""
        at = torch.tensor(self._at(prefixes), dtype=torch.int64, device=self.device)
        return self.table.index_select(0, at)

    def host_batch(self, prefixes: Any) -> np.ndarray:
        """The same rows as a host array (the host path)."""
        return self.host[self._at(prefixes)]


def jobs_for(round_id: int) -> list[DraftJob]:
    return [
        DraftJob(seed=7 * s + 1, generation=1, round_id=round_id, prefix=[s + 1, 3 * s + 2],
                 depth=DEPTH, temperature=[1.0, 1.0, 1.0, 0.0][s % 4],
                 support=[0, 0, 32, 0, 0, 32, 0, 0][s])
        for s in range(SLOTS)
    ]  # fmt: skip


def same(a: tuple[QRow, ...] | Pp1Error, b: tuple[QRow, ...] | Pp1Error) -> bool:
    """The same rows (bit for bit) or the same refusal."""
    if isinstance(a, Pp1Error) or isinstance(b, Pp1Error):
        return isinstance(a, Pp1Error) and isinstance(b, Pp1Error) and a.code == b.code
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.token != y.token:
            return False
        for name in ("counts", "ids", "q32"):
            u, v = getattr(x, name), getattr(y, name)
            if (u is None) != (v is None):
                return False
            if u is not None and (u.dtype != v.dtype or u.tobytes() != v.tobytes()):
                return False
    return True


def encode(rows_by_job: list[tuple[QRow, ...] | Pp1Error], round_id: int, entries: int) -> int:
    sent = 0
    for slot, rows in enumerate(rows_by_job):
        if isinstance(rows, Pp1Error):
            continue
        step = Step(session=1, slot=slot, generation=1, round=round_id, position=2, digest=0,
                    depth=DEPTH, temperature=1.0, support=0, context=0)  # fmt: skip
        reply_frames(1, step, rows, entries)
        sent += len(rows)
    return sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=129_280)
    parser.add_argument("--steps", type=int, default=20, help="steps timed for the CPU per row")
    parser.add_argument("--json", action="store_true", help="print one JSON object, last")
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    vocab, entries = args.vocab, args.vocab
    drafter = TableDrafter(vocab, device)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA)",
        "torch": torch.__version__,
        "vocab": vocab,
    }
    # 1. Bit-equality with the host path, over a step and a second one.
    equal = 0
    compared = 0
    for round_id in (1, 2):
        jobs = jobs_for(round_id)
        got = propose_batch(drafter.batch, jobs, vocab, row_entries=entries, kind="probs")
        want = propose_batch(drafter.host_batch, jobs, vocab, row_entries=entries, kind="probs")
        equal += sum(same(g, w) for g, w in zip(got, want, strict=True))
        compared += len(jobs)
        dense = [
            r for rows in got if not isinstance(rows, Pp1Error) for r in rows if r.q32 is not None
        ]
        if cuda:  # the rows were copied to page-locked buffers, and are sent from there
            report["dense_rows_pinned"] = bool(dense) and all(
                torch.from_numpy(r.q32).is_pinned() for r in dense
            )
    report["jobs_bit_equal"] = f"{equal}/{compared}"
    ok = equal == compared
    print(f"bit-equal to the host path: {equal}/{compared} jobs")
    # 2. Host CPU per row with the CUDA drafter.
    if not cuda:
        print("CUDA is not available: skipped the host-CPU-per-row measurement")
    else:
        propose_batch(drafter.batch, jobs_for(3), vocab, row_entries=entries, kind="probs")
        torch.cuda.synchronize()
        rows = 0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for step in range(args.steps):
            got = propose_batch(
                drafter.batch, jobs_for(10 + step), vocab, row_entries=entries, kind="probs"
            )
            rows += encode(got, 10 + step, entries)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        per_row = 1e3 * cpu / max(1, rows)
        report.update(
            host_cpu_ms_per_row=per_row,
            wall_ms_per_row=1e3 * wall / max(1, rows),
            rows=rows,
            goal_ms_per_row=GOAL_MS_PER_ROW,
            goal_met=per_row <= GOAL_MS_PER_ROW,
        )
        print(f"host CPU per row: {per_row:.4f} ms (goal <= {GOAL_MS_PER_ROW} ms) over {rows} rows")
    text = json.dumps(report)
    print(text if args.json else json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
