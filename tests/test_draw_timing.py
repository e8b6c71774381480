"""The proposal draw does the same work whatever the index it draws (``docs/adaptive.md`` §7).

A row's draw must not take a time that depends on its own token, or a deadline
could fall between rows by that token. Timing is not tested (it would only be
noise); the work is: on the numpy, torch and sharded paths the same calls on the
same shapes for a token at the start, in the middle and at the end of a row, none
of them a search that stops where the token is; in the compiled path, the draw
``u`` is read only by code with no branch (``_fastq.c``: ``draw_mask``,
``draw_index``), and the mask made from it is used only to mask. The draws
themselves are checked against the numpy rule at every chunk boundary of the
compiled pass.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pp1wire.q import dyadic, rows

SOURCE = Path(__file__).resolve().parent.parent / "pp1wire" / "q" / "_fastq.c"
CHUNK = 128  # the compiled draw's chunk (_fastq.c)

# numpy functions whose work is fixed by the shapes of their arguments.
FIXED_WORK = {
    "asarray", "ndarray.min", "_amin", "ufunc.reduce", "_cumsum_dispatcher", "cumsum",
    "_wrapfunc", "getattr", "ndarray.cumsum", "_count_nonzero_dispatcher", "count_nonzero",
    "min", "int", "sum", "len", "zip", "_sum_dispatcher", "_wrapreduction",
    "_wrapreduction_any_all", "dict.items", "setprofile",
}  # fmt: skip


def calls(fn: Callable[[], object]) -> list[str]:
    """Every Python and C function ``fn`` calls, in order (``fn``'s own frame left out)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_qualname)
        elif event == "c_call":
            seen.append(getattr(arg, "__qualname__", repr(arg)))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen[1:]


def counts_row(n: int, seed: int) -> np.ndarray:
    gen = np.random.default_rng(seed)
    w = gen.random(n) ** 4 * (gen.random(n) < 0.7)  # zeros among them
    w[0] = w[-1] = 1.0
    return dyadic.counts_from_weights(w)


def edge_draws(counts: np.ndarray) -> list[int]:
    """Draws that pick the first entry, one in the middle, and the last."""
    cum = np.cumsum(counts)
    return [0, int(cum[counts.size // 2]), dyadic.M - 1]


@pytest.mark.parametrize("n", [5, 4096, 129_280])
def test_the_numpy_draw_calls_the_same_fixed_work_whatever_the_token(monkeypatch, n):
    monkeypatch.setattr(dyadic, "_fastq", None)
    counts = counts_row(n, n)
    draws = edge_draws(counts)
    tokens = [dyadic.sample(counts, u) for u in draws]
    assert tokens[0] == 0  # the two ends of the row
    assert tokens[-1] == n - 1
    traces = [calls(lambda u=u: dyadic.sample(counts, u)) for u in draws]
    assert traces[0] == traces[1] == traces[2]
    assert set(traces[0]) - {"sample"} <= FIXED_WORK, traces[0]


def test_the_torch_draw_runs_the_same_kernels_on_the_same_shapes_whatever_the_token():
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    from pp1wire.q import torch_ops

    class Record(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, tuple[object, ...]]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
            self.seen.append((getattr(func, "__name__", str(func)), shapes))
            return func(*args, **(kwargs or {}))

    counts = counts_row(129_280, 3)
    batch = torch.from_numpy(np.stack([counts, counts]))
    traces = []
    for u in edge_draws(counts):
        draws = torch.tensor([u, dyadic.M - 1 - u])
        with Record() as rec:
            got = torch_ops.draw_rows(batch, draws)
        assert got.tolist() == [dyadic.sample(counts, u), dyadic.sample(counts, dyadic.M - 1 - u)]
        traces.append(rec.seen)
    assert traces[0] == traces[1] == traces[2]
    assert not any("search" in name or "nonzero" in name for name, _ in traces[0]), traces[0]


def test_every_rank_counts_its_slice_of_the_draw_owner_or_not():
    from pp1wire.q.layout import ShardLayout
    from pp1wire.tp.dist_common import pick
    from pp1wire.tp.shard_tree import TreePlan

    layout = ShardLayout((0, 300, 700, 1000))
    counts = counts_row(1000, 7)
    plans = [TreePlan(layout, rank) for rank in range(3)]
    per_rank = [int(counts[p.start : p.stop].sum()) for p in plans]
    for u in edge_draws(counts):
        traces, found = [], []
        for plan in plans:
            piece = counts[plan.start : plan.stop]
            traces.append(calls(lambda p=piece, pl=plan, u=u: pick(p, per_rank, u, pl)))
            found.append(pick(piece, per_rank, u, plan))
        assert traces[0] == traces[1] == traces[2]  # the owner's work is every rank's
        owned = [f for f in found if f != (-1, -1)]
        token = dyadic.sample(counts, u)
        assert owned == [(token, int(counts[token]))]


def _functions(source: str) -> dict[str, str]:
    """The C source's functions (and function-like macros' bodies), by name."""
    out = {}
    for m in re.finditer(r"^static [^;{]*?\b(\w+)\(([^)]*)\)\s*\{(.*?)^\}", source, re.S | re.M):
        out[m.group(1)] = m.group(3)
    return out


def test_only_branch_free_code_reads_the_compiled_draw():
    source = SOURCE.read_text()
    functions = _functions(source)
    readers = {name for name, body in functions.items() if re.search(r"->u\b|\.u\b", body)}
    assert readers == {"draw_start", "draw_mask", "draw_index"}, readers
    for name in ("draw_mask", "draw_index"):
        body = re.sub(r"/\*.*?\*/", "", functions[name], flags=re.S)
        # No branch, early exit or conditional value; loops only over the fixed chunk.
        assert set(re.findall(r"\bfor \(([^)]*)\)", body)) <= {"int j = 0; j < CHUNK; j++"}, name
        for word in (r"\bif\b", r"\bwhile\b", r"\bbreak\b", r"\bgoto\b", r"\?", r"\|\|", r"&&"):
            assert not re.search(word, body), (name, word)
        assert len(re.findall(r"\breturn\b", body)) <= 1, name
    # The mask chooses what is kept by and-masks only, never by a branch.
    macro = source[source.index("#define DRAW_COUNTS") : source.index("#undef DRAW_COUNTS")]
    for body in (functions["assign_chunk"], macro):
        for line in re.sub(r"/\*.*?\*/", "", body, flags=re.S).splitlines():
            if not re.search(r"\bm\b", line) or re.search(r"int32_t m\b", line):
                continue  # the mask's own declaration
            assert len(re.findall(r"\bm\b", line)) == len(re.findall(r"&=?\s*~?m\b", line)), line
            assert "?" not in line, line
    assert f"#define CHUNK {CHUNK}" in source


fastq = pytest.importorskip("pp1wire.q._fastq")


@pytest.mark.parametrize("n", [1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 7])
def test_the_compiled_draw_at_every_chunk_boundary(n):
    gen = np.random.default_rng(n)
    w = gen.random(n) * (gen.random(n) < 0.5)
    w[gen.integers(0, n)] = 1.0
    if n > 2 * CHUNK:
        w[CHUNK : 2 * CHUNK] = 0.0  # a whole chunk without mass
    counts = dyadic.counts_from_weights(w)
    cum = np.cumsum(counts)
    draws = sorted(
        {0, dyadic.M - 1, *(int(c) + d for c in cum for d in (-1, 0) if 0 <= c + d < dyadic.M)}
    )
    want = [int(np.searchsorted(cum, u, side="right")) for u in draws]  # the rule's own words
    for dtype in (np.int32, np.int64):
        c = counts.astype(dtype)
        assert [dyadic.sample(c, u) for u in draws] == want
    w32 = w.astype(np.float32)
    _, picks = rows.construct_rows([w32] * len(draws), draws, n)
    assert picks == [dyadic.sample(dyadic.counts_from_fp32(w32), u) for u in draws]
