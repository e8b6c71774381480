"""The dyadic24 kernels on torch tensors, on any device (the ``tp`` extra): each the same IEEE
operations in the same order as its numpy counterpart, so the results are bit-equal (tests
check it), with the same error codes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Final, cast

import numpy as np
import torch

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error, ValidationError, VerifyError
from pp1wire.q import dyadic
from pp1wire.q.proposal import QRow, greedy_counts
from pp1wire.q.rows import PerSize
from pp1wire.q.walk import Draw

M = 1 << 24
_U53 = float(1 << 53)


def tree_levels(values: torch.Tensor) -> list[torch.Tensor]:
    """Every level of the canonical tree over a 1-D float64 tensor (level 0 padded)."""
    return [level[0] for level in row_levels(values.reshape(1, -1))]


def descend(levels: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """The leaf a descent with ``target`` reaches (a 0-d int64 tensor; no host sync)."""
    rows = [level[None] for level in levels]
    return descend_rows(rows, target.to(levels[0].device).reshape(1))[0]


def check_target(p: torch.Tensor) -> torch.Tensor:
    """:func:`pp1wire.q.verify.check_target` on a tensor: p over its canonical total.

    Raises:
        VerifyError: ``TARGET_NON_FINITE``, ``TARGET_NEGATIVE`` or ``TARGET_ZERO_MASS``.
    """
    x = p.to(torch.float64)
    flags = torch.stack([(~torch.isfinite(x)).any(), (x < 0).any()]).tolist()  # one host read
    if flags[0]:
        raise VerifyError(ErrorCode.TARGET_NON_FINITE, "target has NaN or infinity")
    if flags[1]:
        raise VerifyError(ErrorCode.TARGET_NEGATIVE, "target has a negative probability")
    total = tree_levels(x)[-1][0]
    value = float(total)
    if not (value > 0 and value != float("inf")):
        raise VerifyError(ErrorCode.TARGET_ZERO_MASS, "target has no usable mass")
    return x / total


def sample_weights(weights: torch.Tensor, u53: int) -> torch.Tensor:
    """:func:`pp1wire.q.verify.sample_weights` on a tensor (0-d int64 result).

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` if the weights have no mass.
    """
    levels = tree_levels(weights)
    total = levels[-1][0]
    if not float(total) > 0:
        raise VerifyError(ErrorCode.EMPTY_RESIDUAL, "distribution has no mass")
    return descend(levels, (u53 / _U53) * total)


def residual_sample(p: torch.Tensor, counts: torch.Tensor, u53: int) -> torch.Tensor:
    """:func:`pp1wire.q.verify.residual_sample` on tensors (0-d int64 result): a draw from
    ``max(p - counts / 2**24, 0)``.

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` if p <= q everywhere.
    """
    residual = torch.clamp_min(p.to(torch.float64) - counts.to(torch.float64) / M, 0.0)
    return sample_weights(residual, u53)


def row_levels(rows: torch.Tensor) -> list[torch.Tensor]:
    """Every row's canonical tree at once: level ``l`` of row ``i`` is, bit for bit,
    level ``l`` of :func:`pp1wire.q.tree.levels` of that row."""
    x = rows.to(torch.float64)
    size = 1 << max(0, (x.shape[1] - 1).bit_length())
    level = torch.zeros((x.shape[0], size), dtype=torch.float64, device=x.device)
    level[:, : x.shape[1]] = x
    out = [level]
    while level.shape[1] > 1:
        pairs = level.view(level.shape[0], -1, 2)  # (left, right) children side by side
        level = pairs[:, :, 0] + pairs[:, :, 1]
        out.append(level)
    return out


def row_totals(rows: torch.Tensor) -> torch.Tensor:
    """Every row's canonical total (float64, on the rows' device)."""
    return row_levels(rows)[-1][:, 0]


def descend_rows(levels: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """:func:`pp1wire.q.tree.descend` of each row of :func:`row_levels` with its own
    target (int64, no host sync; meaningless for a row without mass)."""
    t = target.to(torch.float64)
    index = torch.zeros(levels[0].shape[0], dtype=torch.int64, device=t.device)
    for level in range(len(levels) - 1, 0, -1):
        below = levels[level - 1]
        a = below.gather(1, (2 * index)[:, None])[:, 0]
        b = below.gather(1, (2 * index + 1)[:, None])[:, 0]
        right = (b > 0) & ((a == 0) | (t >= a))
        t = torch.where(right, t - a, t)
        index = 2 * index + right.to(torch.int64)
    return index


class DeviceStep:
    """The walk's row operations (:class:`pp1wire.q.walk.RowOps`) on one step's target rows,
    kept on their device: the totals, checks and each draft's ``v[x]`` leave it in one
    transfer, the drawn IDs in another; the decisions are bit for bit the host's.
    """

    eager_draws = False

    def __init__(self, probs: torch.Tensor, drafts: list[tuple[int, int]]) -> None:
        """Total and check every row of ``probs`` (rows x V) and read ``v[x]`` at each
        ``(row, x)`` of ``drafts``."""
        self.width = int(probs.shape[1])
        x = probs.to(torch.float64)
        self._x = x
        totals = row_totals(x)
        ok = (x >= 0).all(dim=1) & torch.isfinite(totals) & (totals > 0)
        device = x.device
        rows = torch.tensor([r for r, _ in drafts], dtype=torch.int64, device=device)
        xs = torch.tensor([t for _, t in drafts], dtype=torch.int64, device=device)
        self._totals_dev = totals
        host = torch.cat([totals, ok.to(torch.float64), x[rows, xs]]).cpu().tolist()
        n = len(totals)
        self._totals, self._ok = host[:n], [bool(o) for o in host[n : 2 * n]]
        self._values = dict(zip(drafts, host[2 * n :], strict=True))

    def check(self, rows: Sequence[tuple[int, int]]) -> list[bool]:
        """Whether each (row, vocabulary size) passed its checks (read with the totals)."""
        return [self._ok[r] and v == self.width for r, v in rows]

    def p_at(self, asks: Sequence[tuple[int, int]]) -> list[float]:
        """``v[x] / total`` of each (row, x) (read with the totals)."""
        return [float(self._values[(r, x)]) / self._totals[r] for r, x in asks]

    def draw(self, draws: Sequence[Draw]) -> list[int]:
        """Each draw from ``max(v / total - q, 0)`` (or from ``v / total``), batched
        on the device; -1 where that has no mass."""
        device = self._x.device
        rows = torch.tensor([d.row for d in draws], dtype=torch.int64, device=device)
        p = self._x[rows] / self._totals_dev[rows][:, None]
        q = torch.zeros_like(p)
        for i, d in enumerate(draws):
            if d.q is not None:
                q[i] = _device_q(d.q, d.vocab, device)
        w = torch.clamp_min(p - q, 0.0)
        levels = row_levels(w)
        roots = levels[-1][:, 0]
        u = torch.tensor([d.u53 / _U53 for d in draws], dtype=torch.float64, device=device)
        drawn = descend_rows(levels, u * roots)
        drawn = torch.where(roots > 0, drawn, torch.full_like(drawn, -1))
        return [int(d) for d in drawn.cpu().tolist()]


def _device_q(row: QRow, vocab: int, device: torch.device) -> torch.Tensor:
    """q of a proposal row over the vocabulary as float64 on ``device`` (a dense row widened
    there, a sparse one spread on the host first)."""
    if row.ids is not None:
        return torch.from_numpy(row.dense_q(vocab)).to(device)
    if row.counts is not None:
        counts = torch.from_numpy(np.ascontiguousarray(row.counts[:vocab])).to(device)
        return counts.to(torch.float64) / M
    assert row.q32 is not None
    return torch.from_numpy(np.ascontiguousarray(row.q32[:vocab])).to(device).to(torch.float64)


class _DeviceRows:
    """:func:`pp1wire.q.dyadic.allocate_with`'s pieces for ``[R, n]`` FP32 weights widened to
    float64, on their device with no host sync: the threshold off a descending sort, ties in
    ID order by a running count. Only the one-division share: an FP32 total is never
    subnormal over M (a row without a positive total is refused before its status is read).
    """

    @staticmethod
    def where(cond: torch.Tensor, yes: torch.Tensor | int, no: torch.Tensor | int) -> torch.Tensor:
        return torch.where(cond, yes, no)

    def __init__(self, w: torch.Tensor, totals: torch.Tensor) -> None:
        self.n = int(w.shape[1])
        self.w = w
        self.totals = totals.to(torch.float64)

    def floors(self) -> torch.Tensor:
        share = self.w / (self.totals / M)[:, None]
        self.counts = share.to(torch.int64)  # share >= 0: truncation is the floor
        # + 0.0: a -0.0 weight's remainder is +0.0, which orders with the zeros
        self.rem = (share - self.counts.to(torch.float64)) + 0.0
        return self.counts.sum(dim=1)

    def threshold(self, left: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        ranked = torch.sort(self.rem, dim=1, descending=True).values
        at = (left - 1).clamp(0, self.n - 1)[:, None]
        return ranked.gather(1, at)[:, 0]

    def above(self, threshold: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        self.over = (self.rem > threshold[:, None]) & live[:, None]
        return self.over.sum(dim=1)

    def assign(
        self, threshold: torch.Tensor, ties: torch.Tensor, live: torch.Tensor
    ) -> torch.Tensor:
        at = (self.rem == threshold[:, None]) & live[:, None]
        first = at & (torch.cumsum(at.to(torch.int64), dim=1) <= ties[:, None])
        self.counts = self.counts + self.over + first
        return self.counts.sum(dim=1)


def allocate_rows(w: torch.Tensor, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pp1wire.q.dyadic.allocate_with` of every row of ``w`` with its total, batched on
    the rows' device: (int64 counts ``[R, n]``, int64 status ``[R]``: 0, or 1 to 3 of
    :data:`pp1wire.q.dyadic.ROW_STATUS_ERRORS`)."""
    rows = _DeviceRows(w, totals)
    status = dyadic.allocate_with(rows)
    return rows.counts, status


def draw_rows(counts: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """:func:`pp1wire.q.dyadic.sample` of each row of counts with its 24-bit draw (int64
    indices; no host sync), counted over the whole row."""
    cumulative = torch.cumsum(counts, dim=1)
    return (cumulative <= draws[:, None].to(torch.int64)).sum(dim=1)


class StagingBuffers:
    """Recycled host buffers (page-locked for CUDA) of rows of ``entries`` FP32 values that a
    position's rows reach in one copy and are sent from; as
    :class:`pp1wire.q.rows.RowBuffers`, one is reused only when nothing else refers to it.
    """

    def __init__(self, entries: int, pinned: bool, limit: int = 64) -> None:
        """A pool of buffers for rows of one length padded to ``entries``."""
        self.entries = entries
        self.pinned = pinned
        self.limit = limit
        self._buffers: list[tuple[np.ndarray, torch.Tensor]] = []
        self._lock = threading.Lock()
        self._probe = np.empty(0, dtype="<f4")

    def take(self, rows: int) -> tuple[np.ndarray, torch.Tensor]:
        """A buffer of at least ``rows`` rows nothing else refers to: its array and tensor."""
        capacity = 1 << max(0, (rows - 1).bit_length())
        with self._lock:
            probes = [self._probe]
            idle = sys.getrefcount(probes[0]) - 1
            for array, tensor in self._buffers:
                if array.shape[0] == capacity and sys.getrefcount(array) == idle + 1:
                    return array, tensor
            tensor = torch.zeros((capacity, self.entries), dtype=torch.float32,
                                 pin_memory=self.pinned)  # fmt: skip
            array = tensor.numpy()
            if len(self._buffers) < self.limit:
                self._buffers.append((array, tensor))
            return array, tensor


def _staging_pool(shape: tuple[int, int, bool]) -> StagingBuffers:
    # The row length is part of the key though no buffer records it: a buffer's
    # padding past its rows is zeroed only when it is made, and rows of another
    # length would leave their values there.
    _, entries, pinned = shape
    return StagingBuffers(entries, pinned)


_staging: Final = PerSize(_staging_pool)


def staging_buffers(vocab: int, entries: int, pinned: bool) -> StagingBuffers:
    """The process's pool of staging buffers for rows of this shape."""
    return _staging((vocab, entries, pinned))


def build_position(
    probs: torch.Tensor, specs: list[tuple[float, int]], draws: list[int], row_entries: int | None
) -> list[QRow | Pp1Error]:
    """One position of a worker's step from a probabilities drafter's ``[N, V]`` tensor, built
    and drawn on its device: per row, what :func:`pp1wire.q.proposal.build_row`
    (``kind="probs"``) and :func:`pp1wire.q.dyadic.sample` give on the host, bit for bit.

    ``specs``: each row's (temperature, support: 0 dense); ``draws``: its 24-bit draw. With
    ``row_entries`` a dense row's :attr:`QRow.q32` is its wire payload in a staging buffer
    (:func:`staging_buffers`). Refusals, per row, in the host's order: ``BAD_TEMPERATURE``,
    ``BAD_SHAPE``, ``WEIGHT_NON_FINITE``, ``WEIGHT_NEGATIVE``, ``ZERO_MASS``,
    ``ALLOCATION_INCONSISTENT``, ``BAD_DRAW``.
    """
    x = probs.detach().to(torch.float32)
    n = int(x.shape[1])
    device = x.device
    out: list[QRow | Pp1Error | None] = [None] * len(specs)
    greedy: list[int] = []
    dense: list[int] = []
    sparse: dict[int, list[int]] = {}
    for r, (temperature, support) in enumerate(specs):
        try:
            if temperature == 0:
                greedy.append(r)
                continue
            dyadic.check_probs_temperature(temperature)
            if support:
                dyadic.check_k(support)
        except Pp1Error as exc:
            out[r] = exc
            continue
        if support:
            sparse.setdefault(support, []).append(r)
        else:
            dense.append(r)
    # A draw outside [0, M) is refused after the row's own checks (as sample does).
    u = torch.tensor([v if 0 <= v < M else 0 for v in draws], dtype=torch.int64, device=device)
    # The checks of every row: a NaN or infinity, a negative weight, no positive one.
    flags = torch.stack([~torch.isfinite(x).all(dim=1), (x < 0).any(dim=1), ~(x > 0).any(dim=1)])
    refused = torch.where(flags[0], 5, torch.where(flags[1], 6, torch.where(flags[2], 7, 0)))
    pieces: list[torch.Tensor] = [refused, torch.argmax(x, dim=1)]
    q32 = None
    if dense:
        at = torch.tensor(dense, dtype=torch.int64, device=device)
        w = x[at].to(torch.float64)
        counts, status = allocate_rows(w, row_totals(w))
        pieces += [status, draw_rows(counts, u[at])]
        if row_entries is not None:
            q32 = counts.to(torch.float32) * (1.0 / M)  # exact: c <= 2**24
        else:
            pieces.append(counts.reshape(-1))
    for k, group in sparse.items():
        at = torch.tensor(group, dtype=torch.int64, device=device)
        ids, counts, status = _sparse_rows(x[at], k)
        pieces += [status, ids.reshape(-1), counts.reshape(-1), draw_rows(counts, u[at])]
    staged = None
    if q32 is not None:
        assert row_entries is not None
        pool = staging_buffers(n, row_entries, device.type == "cuda")
        staged, tensor = pool.take(len(dense))
        tensor[: len(dense), :n].copy_(q32, non_blocking=tensor.is_pinned())
    host = torch.cat([p.reshape(-1).to(torch.int64) for p in pieces]).cpu().numpy()
    rows = len(specs)
    refused_h, argmax_h = host[:rows], host[rows : 2 * rows]
    pos = 2 * rows
    for r in greedy:
        code = int(refused_h[r])
        token = int(argmax_h[r])
        if code:
            out[r] = ConstructionError(*dyadic.ROW_STATUS_ERRORS[code])
        else:
            mass, at_token = greedy_counts(n, token, bool(specs[r][1]))
            out[r] = QRow(token, counts=mass, ids=at_token)
    if dense:
        d = len(dense)
        status_h, tokens_h = host[pos : pos + d], host[pos + d : pos + 2 * d]
        pos += 2 * d
        counts_h = None
        if q32 is None:
            # astype makes a fresh block: each row's counts view their own part of it.
            counts_h = host[pos : pos + d * n].reshape(d, n).astype(np.int32)
            pos += d * n
        for j, r in enumerate(dense):
            refusal = _refusal(int(refused_h[r]) or int(status_h[j]), draws[r])
            if refusal is not None:
                out[r] = refusal
            elif staged is not None:
                out[r] = QRow(int(tokens_h[j]), q32=staged[j])
            else:
                assert counts_h is not None
                out[r] = QRow(int(tokens_h[j]), counts=counts_h[j])
    for k, group in sparse.items():
        g = len(group)
        width = min(k, n)
        status_h = host[pos : pos + g]
        ids_h = host[pos + g : pos + g + g * width].reshape(g, width)
        counts_h = host[pos + g + g * width : pos + g + 2 * g * width].reshape(g, width)
        picks_h = host[pos + g + 2 * g * width : pos + 2 * g + 2 * g * width]
        pos += 2 * g + 2 * g * width
        for j, r in enumerate(group):
            out[r] = _refusal(int(refused_h[r]) or int(status_h[j]), draws[r])
            if out[r] is not None:
                continue
            keep = counts_h[j] > 0
            token = int(ids_h[j][int(picks_h[j])])
            out[r] = QRow(token, counts=counts_h[j][keep].astype(np.int64),
                          ids=ids_h[j][keep].astype(np.int32))  # fmt: skip
    assert all(o is not None for o in out)
    return cast("list[QRow | Pp1Error]", out)


def _refusal(code: int, u: int) -> Pp1Error | None:
    """A built row's refusal: its status's error, else one for a draw outside [0, M)."""
    if code:
        return ConstructionError(*dyadic.ROW_STATUS_ERRORS[code])
    if not 0 <= u < M:
        return ValidationError(ErrorCode.BAD_DRAW, f"draw {u} outside [0, 2**24)")
    return None


def _sparse_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse top-k rows of FP32 weights ``[R, V]``: (ids, counts, status), ``[R, min(k, V)]``,
    the support ascending then any non-positive picks with count 0 (zero weights at the end
    of a tree change no node of it, §6.6)."""
    n = int(x.shape[1])
    width = min(k, n)
    top = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :width]
    positive = x.gather(1, top) > 0
    order = torch.sort(torch.where(positive, top, top + n), dim=1).indices
    ids = top.gather(1, order)
    w = torch.where(positive.gather(1, order), x.gather(1, ids), 0.0).to(torch.float64)
    counts, status = allocate_rows(w, row_totals(w))
    return ids, counts, status
