"""The sharded kernels across gloo ranks equal single-process results at V = 129,280.

The ranks are threads of this process, each with its own gloo group over one
store (:func:`tests.groups.run_in_threads`): the same collectives as
separate processes, without starting any. Uneven splits; with three ranks the
middle one owns nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pp1wire.apps.launch import free_ports  # noqa: E402
from pp1wire.apps.models import ToyLM  # noqa: E402
from pp1wire.apps.ranks import rank_environments  # noqa: E402
from pp1wire.q import dyadic, verify  # noqa: E402
from pp1wire.q.layout import ShardLayout  # noqa: E402
from pp1wire.tp import dist_ops  # noqa: E402
from pp1wire.tp.coordinator import GroupCoordinator  # noqa: E402

from .groups import run_in_threads  # noqa: E402

V = 129_280
U53 = 1 << 53


def _compare(coord: GroupCoordinator) -> list[str]:
    assert coord.layout is not None
    lo, hi = coord.layout.range(coord.rank)
    failures = []
    drafter, target = ToyLM(V, 5, draft=True), ToyLM(V, 5)

    def piece(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a[lo:hi].copy())

    for prefix in ([1, 2, 3], [9]):
        z = drafter.logits(prefix)
        want = dyadic.counts_from_logits(z, 0.9)
        got = dist_ops.counts_from_logits(piece(z), 0.9, coord)
        if not np.array_equal(got.numpy(), want[lo:hi]):
            failures.append("dense counts")
        ids, counts = dyadic.sparse_counts_from_logits(z, 1.0, 32)
        (row,) = dist_ops.construct_rows(z[None, lo:hi], [dist_ops.RowSpec(1.0, 32)], coord)
        mine = (ids >= lo) & (ids < hi)  # this rank's part of the support
        if row.ids.tolist() != ids[mine].tolist() or row.counts.tolist() != counts[mine].tolist():
            failures.append("sparse counts")
        for u24 in (0, 1, 12_345_678, (1 << 24) - 1):
            if dist_ops.sample_counts(want[None, lo:hi], [u24], coord) != [
                dyadic.sample(want, u24)
            ]:
                failures.append(f"sample {u24}")
        raw = target.probs(prefix)
        p = verify.check_target(raw, V)
        got_p = dist_ops.normalize_targets([raw[lo:hi]], coord)
        if got_p.codes != [None] or not np.array_equal(got_p.normalized(0), p[lo:hi]):
            failures.append("normalized target")
        for u53 in (0, 1, U53 // 3, U53 // 2, U53 - 1):
            one = verify.residual_sample(p, want, u53)
            shard = dist_ops.residual_sample(piece(p), piece(want), u53, coord)
            if one != shard:
                failures.append(f"residual {u53}: {shard} != {one}")
    return failures


def _no_rank_fails(bounds: tuple[int, ...], compare) -> None:
    """Run ``compare(coord, v)`` on every rank of ``ShardLayout(bounds)`` (threads, V = v);
    each returns what it found different from one process, and must find nothing."""
    layout = ShardLayout(bounds)
    v = layout.vocab_size
    results = run_in_threads(layout.shards, lambda c: compare(c, v), layout=layout)
    for rank, result in enumerate(results):
        assert result == [], f"rank {rank}: {result}"


@pytest.mark.parametrize("cuts", [(50_001,), (70_000, 70_000)], ids=["2 ranks", "3 ranks"])
def test_gloo_ranks_equal_single_process(cuts):
    _no_rank_fails((0, *cuts, V), lambda coord, v: _compare(coord))


def test_a_kernel_refuses_a_piece_that_is_not_its_range():
    layout = ShardLayout.even(10, 2)

    def body(coord: GroupCoordinator) -> str:
        with pytest.raises(ValueError, match="range has 5"):
            dist_ops.counts_from_logits(torch.zeros(4), 1.0, coord)
        return "ok"

    assert run_in_threads(2, body, layout=layout) == ["ok", "ok"]


# -- the batched kernels: one set of collectives for many rows, each row as numpy's -------


def _logit_rows(v: int, seed: int) -> list[np.ndarray]:
    """Rows that exercise every path: smooth, spread, ties, -inf entries, refused rows."""
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal(v) * 3.0,
        rng.standard_normal(v) * 60.0,  # most weights underflow: remainders near or at 0
        np.zeros(v),  # every remainder equal: the leftover tickets are ties across ranks
        np.where(rng.random(v) < 0.5, -np.inf, rng.standard_normal(v)),
        np.full(v, -np.inf),  # ZERO_MASS
        np.where(np.arange(v) == v // 2, np.nan, 0.0),  # WEIGHT_NON_FINITE
        np.where(np.arange(v) == v - 1, np.inf, 0.0),  # WEIGHT_NON_FINITE
        np.round(rng.standard_normal(v) * 2.0),  # many equal logits: ties in the top k
    ]


def _unsharded(
    logits: np.ndarray, temperature: float, support: int, u24: int, kind: str = "logits"
):
    """What one process builds and draws: (token, dense counts over V) or the code."""
    from pp1wire.errors import Pp1Error
    from pp1wire.q.proposal import build_row

    try:
        with np.errstate(over="ignore", invalid="ignore"):
            counts, ids = build_row(logits, temperature, support or None, kind=kind)
        pick = dyadic.sample(counts, u24)
    except Pp1Error as exc:
        return exc.code
    whole = np.zeros(logits.size, dtype=np.int64)
    if ids is None:
        whole[:] = counts
        return pick, whole
    whole[ids] = counts
    return int(ids[pick]), whole


def _built(coord: GroupCoordinator, logits, specs, *, probs: bool = False) -> list:
    """Each row's (token, this rank's dense piece of q) or its code; the count at the
    token that every rank got must be the owner's."""
    from pp1wire.errors import Pp1Error

    assert coord.layout is not None
    lo, hi = coord.layout.range(coord.rank)
    out = []
    for got in dist_ops.construct_rows(logits, specs, coord, probs=probs):
        if isinstance(got, Pp1Error):
            out.append(got.code)
            continue
        piece = np.zeros(hi - lo, dtype=np.int64)
        if got.ids is None:
            piece[:] = got.counts
        else:
            assert np.all(np.diff(got.ids) > 0)
            assert np.all((got.ids >= lo) & (got.ids < hi))
            piece[got.ids.astype(np.int64) - lo] = got.counts
        if lo <= got.token < hi:
            assert got.count == piece[got.token - lo] > 0
        out.append((got.token, piece, got.count))
    return out


# The (temperature, support) of the rows built from each drafter row, by kind of drafter.
_KINDS = {
    "logits": [(1.0, 0), (0.7, 0), (1.3, 5), (1.0, 1), (0.0, 0), (0.0, 3), (0.5, 32)],
    "probs": [(1.0, 0), (1.0, 5), (0.0, 0), (0.0, 3), (0.7, 0), (1.0, 32), (1.0, 1)],
}


def _compare_construction(coord: GroupCoordinator, v: int, kind: str, seed: int) -> list[str]:
    """This rank's build of every (row, temperature, support, draw) of a ``kind`` drafter,
    against one process's; and a row whose drafter failed on rank 1 only."""
    from pp1wire.errors import ErrorCode

    assert coord.layout is not None
    lo, hi = coord.layout.range(coord.rank)
    rows = _logit_rows(v, seed) if kind == "logits" else _prob_rows(v, seed)
    rng = np.random.default_rng(seed + 1)
    cases = [(row, t, k, int(rng.integers(0, 1 << 24))) for row in rows for t, k in _KINDS[kind]]
    # The last row's drafter failed on rank 1 only: every rank gets that code for it.
    specs = [dist_ops.RowSpec(t, k, u24) for (_, t, k, u24) in cases]
    specs.append(dist_ops.RowSpec(1.0, 0, 5, drafter_code=84 if coord.rank == 1 else 0))
    pieces = np.stack([c[0][lo:hi] for c in cases] + [np.ones(hi - lo)])
    got = _built(coord, pieces, specs, probs=kind == "probs")
    failures = []
    for n, (case, mine) in enumerate(zip(cases, got[:-1], strict=True)):
        want = _unsharded(*case, kind=kind)
        if isinstance(want, ErrorCode) or isinstance(mine, ErrorCode):
            if want != mine:
                failures.append(f"case {n} (T={case[1]}, k={case[2]}): {mine} != {want}")
        elif mine[0] != want[0] or not np.array_equal(mine[1], want[1][lo:hi]):
            failures.append(f"case {n} (T={case[1]}, k={case[2]}): token {mine[0]} vs {want[0]}")
        elif mine[2] != want[1][want[0]]:
            failures.append(f"case {n}: count {mine[2]} at the token, not {want[1][want[0]]}")
    if got[-1] != ErrorCode.BAD_SHAPE:
        failures.append(f"a rank's drafter failure: {got[-1]}")
    return failures


@pytest.mark.parametrize(("kind", "seed"), [("logits", 11), ("probs", 12)], ids=["logits", "probs"])
@pytest.mark.parametrize(
    "bounds",
    [(0, 20, 37), (0, 10, 10, 37), (0, 5, 37), (0, 0, 37), (0, 999, 1000), (0, 300, 700, 1000)],
    ids=["2 ranks", "3 ranks, middle empty", "ties span ranks", "first empty", "uneven", "3 ranks"],
)
def test_a_batch_of_rows_is_built_and_drawn_as_one_process_builds_each(bounds, kind, seed):
    # Logits and a probabilities drafter's rows alike: each row is the one process's
    # row, bit for bit, on every split of the vocabulary.
    _no_rank_fails(bounds, lambda coord, v: _compare_construction(coord, v, kind, seed))


def _targets(v: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    good = rng.random(v) ** 4
    return [
        good,
        np.where(np.arange(v) % 3 == 0, 0.0, good),
        np.where(np.arange(v) == 1, np.nan, good),  # TARGET_NON_FINITE
        np.where(np.arange(v) == v - 1, -1e-9, good),  # TARGET_NEGATIVE
        np.where(np.arange(v) == v - 1, np.inf, good),  # TARGET_NON_FINITE
        np.zeros(v),  # TARGET_ZERO_MASS
        np.full(v, 1e308),  # the total overflows: TARGET_ZERO_MASS
    ]


def _compare_targets(coord: GroupCoordinator, v: int, seed: int) -> list[str]:
    from pp1wire.errors import ErrorCode, VerifyError

    assert coord.layout is not None
    lo, hi = coord.layout.range(coord.rank)
    rows = _targets(v, seed)
    got = dist_ops.normalize_targets(np.stack([r[lo:hi] for r in rows]), coord)
    failures = []
    usable = []
    for n, raw in enumerate(rows):
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                want = verify.check_target(raw, v)
        except VerifyError as exc:
            if got.codes[n] != exc.code:
                failures.append(f"target {n}: {got.codes[n]} != {exc.code}")
            continue
        if got.codes[n] is not None or not np.array_equal(got.normalized(n), want[lo:hi]):
            failures.append(f"target {n} normalized")
        if any(got.at(n, x) != want[x] for x in range(lo, hi)):
            failures.append(f"target {n}: p(x) one at a time")
        usable.append(want)
    # Draws from every usable p and from residuals against dense q (one empty: p = q).
    rng = np.random.default_rng(seed + 2)
    weights, draws, expect = [], [], []
    for p in usable:
        q = dyadic.counts_from_weights(p)
        mine = dist_ops.residual_rows(p[lo:hi], (q / dyadic.M)[lo:hi])
        if not np.array_equal(mine, verify.residual(p, q)[lo:hi]):
            failures.append("residual")
        # p itself, its residual against q, and an empty residual (p = q exactly).
        for w in (p, verify.residual(p, q), verify.residual(q / dyadic.M, q)):
            u53 = int(rng.integers(0, U53))
            weights.append(w[lo:hi])
            draws.append(u53)
            try:
                expect.append(verify.sample_weights(w, u53))
            except VerifyError as exc:
                expect.append(exc.code)
    empty = np.zeros(v)
    weights.append(empty[lo:hi])
    draws.append(7)
    expect.append(ErrorCode.EMPTY_RESIDUAL)
    picks = dist_ops.sample_weights_rows(np.stack(weights), draws, coord)
    # A row the target could not score on one rank fails on every rank; the others go on.
    both = dist_ops.normalize_targets(
        [rows[0][lo:hi], rows[0][lo:hi]], coord, [False, coord.rank == coord.world - 1]
    )
    if both.codes != [None, ErrorCode.TARGET_FAILED]:
        failures.append(f"a row lost on one rank: {both.codes}")
    if picks != expect:
        failures.append(f"draws from weights: {picks} != {expect}")
    # Counts drawn with 24-bit draws, and the refusals of a bad draw or a wrong total.
    q = dyadic.counts_from_weights(usable[0])
    bad = q.copy()
    bad[0] += 1
    u24s = [0, 1, 12_345_678, dyadic.M - 1, dyadic.M, 3]
    rows24 = np.stack([q[lo:hi]] * 5 + [bad[lo:hi]])
    want24 = [dyadic.sample(q, u) for u in u24s[:4]]
    want24 += [ErrorCode.BAD_DRAW, ErrorCode.MASS_MISMATCH]
    got24 = dist_ops.sample_counts(rows24, u24s, coord)
    if got24 != want24:
        failures.append(f"count draws: {got24} != {want24}")
    return failures


@pytest.mark.parametrize(
    "bounds",
    [(0, 20, 37), (0, 10, 10, 37), (0, 0, 37), (0, 500, 1000)],
    ids=["2 ranks", "3 ranks, middle empty", "first empty", "even"],
)
def test_batched_normalization_and_draws_equal_numpys_row_by_row(bounds):
    _no_rank_fails(bounds, lambda coord, v: _compare_targets(coord, v, 3))


def test_the_batched_kernels_run_one_set_of_collectives_whatever_the_batch():
    # Whatever the rows, a batch costs the same collectives: the count is fixed by the
    # kinds of row in it, not by their number (the point of batching a step).
    layout = ShardLayout.even(64, 2)

    def body(coord: GroupCoordinator) -> list[int]:
        counts = []
        for rows in (1, 6):
            rng = np.random.default_rng(rows)
            x = rng.standard_normal((rows, 32))
            before = coord.collectives
            dist_ops.construct_rows(x, [dist_ops.RowSpec(1.0, 0, 5)] * rows, coord)
            counts.append(coord.collectives - before)
            before = coord.collectives
            t = dist_ops.normalize_targets(np.exp(x), coord)
            dist_ops.sample_weights_rows(
                np.stack([t.normalized(i) for i in range(rows)]), [1] * rows, coord
            )
            counts.append(coord.collectives - before)
        return counts

    a, b = run_in_threads(2, body, layout=layout)
    assert a == b == [4, 3, 4, 3]


def test_the_threshold_comes_from_the_ranks_guesses_or_from_one_more_collective():
    # With its histogram each rank sends the remainders around its own guess of where
    # the leftover tickets' threshold lies. Rows whose threshold every guess covers
    # need no fifth collective; a rank whose guess misses (its shard unlike the rest)
    # or whose guessed buckets hold too many values makes the group ask for the
    # threshold's bucket. Either way each row is numpy's.
    v = 10_000
    layout = ShardLayout.even(v, 2)
    rng = np.random.default_rng(4)
    smooth = rng.standard_normal((3, v)) * 2.0
    skewed = np.concatenate([rng.standard_normal(v // 2) * 3.0, np.full(v - v // 2, -9.0)])
    uniform = np.zeros(v)

    def body(coord: GroupCoordinator) -> list:
        lo, hi = layout.range(coord.rank)
        out = []
        for rows in (smooth, skewed[None, :], uniform[None, :]):
            specs = [dist_ops.RowSpec(1.0, 0, 777 + i) for i in range(len(rows))]
            before = coord.collectives
            got = _built(coord, np.ascontiguousarray(rows[:, lo:hi]), specs)
            spent = coord.collectives - before
            for row, (token, piece, _), spec in zip(rows, got, specs, strict=True):
                want_token, want = _unsharded(row, 1.0, 0, spec.u24)
                assert token == want_token
                assert np.array_equal(piece, want[lo:hi])
            out.append(spent)
        return out

    a, b = run_in_threads(2, body, layout=layout)
    assert a == b == [4, 5, 5]


def _prob_rows(v: int, seed: int) -> list[np.ndarray]:
    """A probabilities drafter's rows: spread, sparse with zeros, tied, beyond FP32's
    precision (rounded as one process rounds them), and the refused ones."""
    rng = np.random.default_rng(seed)
    spread = rng.random(v) ** 6
    return [
        spread / spread.sum(),
        np.where(rng.random(v) < 0.7, 0.0, rng.random(v)),
        np.round(rng.random(v) * 4.0) / 8.0,  # many equal weights: ties in the top k
        rng.random(v) * (1.0 + 1e-12),  # not FP32: rounded first
        np.where(np.arange(v) == v // 2, np.nan, 0.5),  # WEIGHT_NON_FINITE
        np.where(np.arange(v) == v - 1, -0.25, 0.5),  # WEIGHT_NEGATIVE
        np.zeros(v),  # ZERO_MASS
        np.where(np.arange(v) == 0, 1e39, 0.5),  # infinite in FP32: WEIGHT_NON_FINITE
    ]


def test_each_kind_of_row_costs_only_the_collectives_its_data_need():
    # Per position, whatever its rows: greedy and sparse rows 1 (their offers ride on
    # the first collective), dense probabilities 3 (no maximum: their cover totals
    # ride on the first), dense logits 4. A sparse logits row whose offers cannot show
    # its support (here every logit equal: the weight left out ties the k-th) takes
    # one more, and is still numpy's row.
    v = 1_000
    layout = ShardLayout.even(v, 2)
    rng = np.random.default_rng(6)
    smooth = rng.standard_normal((2, v)) * 2.0
    probs = rng.random((2, v))
    cases = [
        ("greedy", smooth, [dist_ops.RowSpec(0.0, 0, 5), dist_ops.RowSpec(0.0, 4, 6)], False),
        ("sparse logits", smooth, [dist_ops.RowSpec(1.0, 8, 7)] * 2, False),
        ("sparse probabilities", probs, [dist_ops.RowSpec(1.0, 8, 7)] * 2, True),
        ("dense probabilities", probs, [dist_ops.RowSpec(1.0, 0, 8)] * 2, True),
        ("dense logits", smooth, [dist_ops.RowSpec(0.9, 0, 9)] * 2, False),
        ("sparse, ties at the k-th", np.zeros((1, v)), [dist_ops.RowSpec(1.0, 8, 3)], False),
    ]

    def body(coord: GroupCoordinator) -> dict[str, int]:
        lo, hi = layout.range(coord.rank)
        spent = {}
        for name, rows, specs, kind in cases:
            before = coord.collectives
            got = _built(coord, np.ascontiguousarray(rows[:, lo:hi]), specs, probs=kind)
            spent[name] = coord.collectives - before
            for row, (token, piece, count), spec in zip(rows, got, specs, strict=True):
                want_token, want = _unsharded(
                    row, spec.temperature, spec.support, spec.u24, "probs" if kind else "logits"
                )
                assert (token, count) == (want_token, want[want_token])
                assert np.array_equal(piece, want[lo:hi])
        return spent

    a, b = run_in_threads(2, body, layout=layout)
    assert a == b == {
        "greedy": 1,
        "sparse logits": 1,
        "sparse probabilities": 1,
        "dense probabilities": 3,
        "dense logits": 4,
        "sparse, ties at the k-th": 2,
    }


# -- joining: a device group only when every rank has a device ------------------------------

_JOIN = """
import json, os, sys
import torch
import torch.distributed as dist
from pp1wire.tp.coordinator import GroupCoordinator

built = []
def new_group(**kwargs):
    built.append(kwargs.get("backend"))
    return dist.distributed_c10d._get_default_group()
dist.new_group = new_group
torch.cuda.set_device = lambda d: None
for plan in sys.argv[1:]:  # one join per plan: CUDA, DEVICE, MASTER_PORT
    cuda, device, port = plan.split(":")
    has = cuda == "1"
    torch.cuda.is_available = lambda has=has: has
    torch.cuda.device_count = lambda has=has: 2 * int(has)
    os.environ["MASTER_PORT"] = port
    built.clear()
    coord = GroupCoordinator.join(20.0, device=device == "1")
    store = dist.distributed_c10d._get_default_store()
    print(json.dumps({"built": built, "device": str(coord.device), "count": coord.collectives}))
    coord.leave()
    # Rank 0 serves the rendezvous store: it ends last, or a rank still joining (no
    # collective follows the join when no device group is asked for) loses the store.
    if coord.rank == 0:
        store.wait([f"left {r}" for r in range(1, coord.world)])
    else:
        store.set(f"left {coord.rank}", "1")
    del store
# As a rank does (pp1wire.apps.ranks.end_process): torch's threads can abort the
# interpreter's teardown (SIGABRT, docs/tp.md section 8), so it is skipped.
sys.stdout.flush()
os._exit(0)
"""

# Each rank's CUDA, whether a device group is asked for, whether NCCL must be built.
JOINS = {
    "one rank without cuda": ((True, False), True, False),  # no rank builds a group
    "not asked": ((True, True), False, False),  # a sharded group: none built
    "every rank with cuda": ((True, True), True, True),
}


@pytest.fixture(scope="module")
def joined() -> dict[str, list[dict]]:
    """Each of ``JOINS``' joins: two real rank processes over env://, each told whether
    it has CUDA; every rank's report. The two processes join once per case, each time
    a fresh default group at a port of its own (torch imported once, not per case)."""
    names = list(JOINS)
    ports = [free_ports(1) for _ in names]
    envs = rank_environments(2, ports[0])
    procs = []
    for rank, env in enumerate(envs):
        plans = [
            f"{int(JOINS[n][0][rank])}:{int(JOINS[n][1])}:{port}"
            for n, port in zip(names, ports, strict=True)
        ]
        argv = [sys.executable, "-c", _JOIN, *plans]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    done = []
    try:
        for p in procs:
            done.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:  # every rank reaped, its pipe closed, whatever failed
            p.kill()
            p.communicate()
    assert [p.returncode for p in procs] == [0] * len(procs), done
    lines = [[json.loads(ln) for ln in out.strip().splitlines()] for out in done]
    assert all(len(ln) == len(names) for ln in lines), done
    return {n: [ln[i] for ln in lines] for i, n in enumerate(names)}


@pytest.mark.parametrize("name", list(JOINS))
def test_a_device_group_is_built_by_every_rank_or_by_none(joined, name):
    # Creating a group takes every rank: one rank building it alone would hang.
    _, _, nccl = JOINS[name]
    outs = joined[name]
    for rank, out in enumerate(outs):
        assert out["built"] == (["nccl"] if nccl else [])
        assert out["device"] == (f"cuda:{rank}" if nccl else "cpu")
        assert out["count"] == 0  # the agreement is not one of the group's collectives


def test_a_cuda_tensor_travels_on_the_device_group_and_only_where_every_rank_has_one():
    # The device group is NCCL only when every rank agreed it has CUDA at join; a host
    # tensor always travels on the control group (gloo), and a CUDA tensor on a group
    # without a device is refused before any collective (nothing would carry it).
    from types import SimpleNamespace

    coord = GroupCoordinator(
        object(), rank=0, world=1, timeout=1.0, device_group=None, layout=None
    )
    on_cuda = SimpleNamespace(device=torch.device("cuda", 0))
    assert coord._group_for(torch.zeros(1)) is coord.group
    with pytest.raises(ValueError, match="no device group"):
        coord._group_for(on_cuda)  # type: ignore[arg-type]
    nccl = object()
    coord.device_group, coord.device = nccl, torch.device("cuda", 0)
    assert coord._group_for(on_cuda) is nccl  # type: ignore[arg-type]
    assert coord._group_for(torch.zeros(1)) is coord.group
    assert coord.collectives == 0
