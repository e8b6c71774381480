"""Check verify_step on a CUDA device against the host (CPU) results, and time both.

Run on a machine with a GPU: ``python benchmarks/gpu_verify_check.py [--json] [--vocab V]``.

The target rows of each step go to the device as an engine would hold them
(FP32 and FP64); :func:`pp1wire.q.verify.verify_step` then keeps them there:
every row's canonical total and check and each draft's ``v[x]`` come back in
one transfer, the drawn IDs in another (only a refused row is copied whole,
to say why). Every round must end exactly as on the host: the same tokens,
the same error code, the same state afterwards; the IEEE additions,
divisions and comparisons are the same operations in the same order on any
device. Cases: 8 rounds x depth 5, 8 target-only rounds, and a step with a
NaN row, a row without mass and a negative one (each fails its own round only).

Without CUDA it says so, and checks the same device code on CPU tensors
against the host path instead (exit 0 when they agree, 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from extras import require

try:
    import torch
except ImportError:  # the tp extra
    require("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verify_batch import Step

from pp1wire.errors import VerifyError
from pp1wire.q import targetrows


def _outcomes(results: list[Any]) -> list[Any]:
    return [
        (r.code.name,)
        if isinstance(r, VerifyError)
        else (r.round_id, r.accepted, r.tokens, r.extra, r.outcome, r.finished, r.new_position)
        for r in results
    ]


def _timed(fn: Callable[[], list[Any]], cuda: bool) -> tuple[list[Any], float]:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _spoiled(rows: np.ndarray, per_round: int) -> np.ndarray:
    """Rows whose first row of rounds 1, 3 and 5 is NaN, all zeros, negative."""
    out = rows.copy()
    out[1 * per_round, 7] = np.nan
    out[3 * per_round] = 0.0
    out[5 * per_round, 2] = -1e-6
    return out


def check(vocab: int, reps: int, device: torch.device, cuda: bool) -> dict[str, Any]:
    """Each case: the device path's outcomes against the host's, and both times."""
    verified, target_only = Step(vocab, False), Step(vocab, True)
    cases = {
        "verified_f32": (verified, verified.rows32),
        "verified_f64": (verified, verified.rows64),
        "target_only_f32": (target_only, target_only.rows32),
        "refusals_f32": (verified, _spoiled(verified.rows32, verified.per_round)),
    }
    report: dict[str, Any] = {}
    for name, (step, rows) in cases.items():
        on_device = torch.from_numpy(rows).to(device)
        host_ms, device_ms, agree = [], [], True
        for _ in range(reps + 1):  # the first repetition warms up
            want, host_s = _timed(lambda step=step, rows=rows: step.step(rows), False)
            got, device_s = _timed(lambda step=step, t=on_device: step.step(t), cuda)
            agree &= _outcomes(got) == _outcomes(want)
            host_ms.append(host_s * 1e3)
            device_ms.append(device_s * 1e3)
        report[name] = {
            "agree": bool(agree),
            "host_ms": float(np.median(host_ms[1:])),
            "device_ms": float(np.median(device_ms[1:])),
            "errors": sorted({str(o[0]) for o in _outcomes(want) if len(o) == 1}),
        }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--vocab", type=int, default=129_280)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        # The same device code, on CPU tensors: what can be checked here.
        targetrows._on_device = lambda x: isinstance(x, torch.Tensor)  # type: ignore[assignment]
    report = {
        "cuda": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA device)",
        "torch": torch.__version__,
        "vocab": args.vocab,
        "cases": check(args.vocab, args.reps, device, cuda),
    }
    ok = all(c["agree"] for c in report["cases"].values())
    if args.json:
        print(json.dumps(report))
    else:
        if not cuda:
            print(
                "no CUDA device here: the CUDA path is NOT checked; the device code ran "
                "on CPU tensors against the host path instead"
            )
        print(f"device: {report['device']}, torch {report['torch']}, V = {args.vocab}")
        for name, c in report["cases"].items():
            print(
                f"  {name:16s} {'agree' if c['agree'] else 'DIFFER'}  host {c['host_ms']:.2f} ms"
                f"  device {c['device_ms']:.2f} ms  errors {c['errors']}"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
