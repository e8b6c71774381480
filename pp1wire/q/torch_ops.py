"""The dyadic24 kernels on torch tensors, on any device (requires the ``tp`` extra).

Each function computes exactly what its numpy counterpart in
:mod:`pp1wire.q.dyadic`, :mod:`pp1wire.q.verify` or :mod:`pp1wire.q.tree`
computes: the same IEEE operations in the same order (elementwise work, the
canonical pairwise tree of ``docs/protocol.md`` §6.6, integer sums, and a
stable sort where numpy partitions), so on the CPU the results are bit-equal
(tests check it) and on a GPU they differ only where the device's own
``exp`` does. Nothing copies to the host except a refusal's flags, the
leftover-ticket count and the drawn ID.

Errors are the same :class:`~pp1wire.errors.ConstructionError` /
:class:`~pp1wire.errors.VerifyError` codes as the numpy kernels raise.
"""

from __future__ import annotations

import torch

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error, ValidationError, VerifyError
from pp1wire.q import dyadic

M = 1 << 24
_U53 = float(1 << 53)
_MIN_NORMAL = 2.2250738585072014e-308


def tree_levels(values: torch.Tensor) -> list[torch.Tensor]:
    """Every level of the canonical tree over a 1-D float64 tensor (level 0 padded)."""
    x = values.to(torch.float64)
    size = 1 << max(0, (x.numel() - 1).bit_length())
    level = torch.zeros(size, dtype=torch.float64, device=x.device)
    level[: x.numel()] = x
    out = [level]
    while level.numel() > 1:
        level = level[0::2] + level[1::2]
        out.append(level)
    return out


def tree_total(values: torch.Tensor) -> torch.Tensor:
    """The canonical total (a 0-d float64 tensor on the values' device)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=values.device)
    return tree_levels(values)[-1][0]


def descend(levels: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """The leaf a descent with ``target`` reaches (a 0-d int64 tensor; no host sync)."""
    device = levels[0].device
    index = torch.zeros((), dtype=torch.int64, device=device)
    t = target.to(torch.float64)
    for level in range(len(levels) - 1, 0, -1):
        below = levels[level - 1]
        a, b = below[2 * index], below[2 * index + 1]
        right = (b > 0) & ((a == 0) | (t >= a))
        t = torch.where(right, t - a, t)
        index = 2 * index + right.to(torch.int64)
    return index


def _refuse_bad_values(x: torch.Tensor, nonfinite: Pp1Error, negative: Pp1Error) -> None:
    """Raise ``nonfinite`` for any NaN or infinity, else ``negative`` (one host read)."""
    flags = torch.stack([(~torch.isfinite(x)).any(), (x < 0).any()]).tolist()
    if flags[0]:
        raise nonfinite
    if flags[1]:
        raise negative


def _check_weights(w: torch.Tensor) -> torch.Tensor:
    _refuse_bad_values(
        w,
        ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "weights contain NaN or infinity"),
        ConstructionError(ErrorCode.WEIGHT_NEGATIVE, "weights contain negative values"),
    )
    total = tree_total(w)
    value = float(total)
    if not value > 0.0:
        raise ConstructionError(ErrorCode.ZERO_MASS, "weights have zero total mass")
    if value == float("inf"):
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "total weight overflows binary64")
    return total


def floors_and_remainders(
    w: torch.Tensor, total: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pp1wire.q.dyadic.floors_and_remainders` on tensors: (int64 floors, remainders)."""
    scale = total / M
    share = w / scale if float(scale) >= _MIN_NORMAL else (w / total) * M
    floors = share.to(torch.int64)  # share >= 0: truncation is the floor
    return floors, share - floors.to(torch.float64)


def allocate(w: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Floor plus the largest remainders, ties to the lowest index (int64 counts).

    Raises:
        ConstructionError: ``ALLOCATION_INCONSISTENT``.
    """
    floors, rem = floors_and_remainders(w, total)
    remaining = M - int(floors.sum())
    n = w.numel()
    if not 0 <= remaining < n:
        raise ConstructionError(
            ErrorCode.ALLOCATION_INCONSISTENT, f"{remaining} tickets left over {n} entries"
        )
    if remaining:
        # The remaining-th largest remainder, then everything above it and the
        # lowest-index ties at it (linear time; no reliance on sort tie order).
        threshold = torch.kthvalue(rem, n - remaining + 1).values
        if not float(threshold) > 0.0:
            raise ConstructionError(
                ErrorCode.ALLOCATION_INCONSISTENT, "tickets left over for zero remainders"
            )
        floors = floors + select_at_threshold(rem, threshold, remaining)
    if int(floors.sum()) != M:
        raise ConstructionError(ErrorCode.ALLOCATION_INCONSISTENT, "allocation does not sum to M")
    return floors


def select_at_threshold(rem: torch.Tensor, threshold: torch.Tensor, wanted: int) -> torch.Tensor:
    """0/1 per entry: every remainder above ``threshold``, then ties at it, lowest index first,
    ``wanted`` in all."""
    above = rem > threshold
    ties = rem == threshold
    room = wanted - int(above.sum())
    take = ties & (torch.cumsum(ties.to(torch.int64), 0) <= room)
    return (above | take).to(torch.int64)


def counts_from_weights(weights: torch.Tensor) -> torch.Tensor:
    """:func:`pp1wire.q.dyadic.counts_from_weights` on a tensor.

    Raises:
        ConstructionError: the same codes.
    """
    w = _as_weights(weights)
    return allocate(w, _check_weights(w))


def _as_weights(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 1 or x.numel() == 0:
        raise ConstructionError(
            ErrorCode.BAD_SHAPE, f"weights must be a non-empty 1-D tensor, got {tuple(x.shape)}"
        )
    return x.to(torch.float64)


def weights_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """:func:`pp1wire.q.dyadic.weights_from_logits` on a tensor.

    Raises:
        ConstructionError: the same codes.
    """
    dyadic.check_temperature(temperature)
    x = _as_weights(logits)
    top = dyadic.check_top(float(x.max()))  # NaN propagates through max
    w = x - top
    if temperature != 1.0:
        w = w / temperature
    return torch.exp(w)


def counts_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """:func:`pp1wire.q.dyadic.counts_from_logits` on a tensor.

    Raises:
        ConstructionError: the same codes.
    """
    w = weights_from_logits(logits, temperature)
    return allocate(w, tree_total(w))


def top_k_ids(w: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest positive weights' indices, ties to the lowest index, ascending."""
    order = torch.sort(w, descending=True, stable=True).indices[:k]
    order = order[w[order] > 0]
    return torch.sort(order).values


def sparse_counts_from_weights(weights: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pp1wire.q.dyadic.sparse_counts_from_weights` on a tensor: (int32 ids, int64 counts).

    Raises:
        ConstructionError: the same codes.
    """
    dyadic.check_k(k)
    w = _as_weights(weights)
    _check_weights(w)
    return _sparse(w, k)


def sparse_counts_from_logits(
    logits: torch.Tensor, temperature: float, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pp1wire.q.dyadic.sparse_counts_from_logits` on a tensor.

    Raises:
        ConstructionError: the same codes.
    """
    dyadic.check_k(k)
    return _sparse(weights_from_logits(logits, temperature), k)


def _sparse(w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = top_k_ids(w, k)
    sub = w[ids]
    counts = allocate(sub, tree_total(sub))
    keep = counts > 0
    return ids[keep].to(torch.int32), counts[keep]


def sample(counts: torch.Tensor, u24: int) -> torch.Tensor:
    """:func:`pp1wire.q.dyadic.sample` on a tensor (0-d int64 result).

    Raises:
        ValidationError: ``BAD_DRAW`` for a draw outside ``[0, 2**24)``.
    """
    if not 0 <= u24 < M:
        raise ValidationError(ErrorCode.BAD_DRAW, f"draw {u24} outside [0, 2**24)")
    cumulative = torch.cumsum(counts.to(torch.int64), 0)
    draw = torch.tensor([u24], dtype=torch.int64, device=counts.device)
    return torch.searchsorted(cumulative, draw, right=True)[0]


def check_target(p: torch.Tensor) -> torch.Tensor:
    """:func:`pp1wire.q.verify.check_target` on a tensor: p over its canonical total.

    Raises:
        VerifyError: ``TARGET_NON_FINITE``, ``TARGET_NEGATIVE`` or ``TARGET_ZERO_MASS``.
    """
    x = p.to(torch.float64)
    _refuse_bad_values(
        x,
        VerifyError(ErrorCode.TARGET_NON_FINITE, "target has NaN or infinity"),
        VerifyError(ErrorCode.TARGET_NEGATIVE, "target has a negative probability"),
    )
    total = tree_total(x)
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


def residual(p: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``max(p - counts / 2**24, 0)`` (see :func:`pp1wire.q.verify.residual`)."""
    return torch.clamp_min(p.to(torch.float64) - counts.to(torch.float64) / M, 0.0)


def residual_sample(p: torch.Tensor, counts: torch.Tensor, u53: int) -> torch.Tensor:
    """:func:`pp1wire.q.verify.residual_sample` on tensors (0-d int64 result).

    Raises:
        VerifyError: ``EMPTY_RESIDUAL`` if p <= q everywhere.
    """
    return sample_weights(residual(p, counts), u53)
