"""Many requests' blocks drawn together, the worker's engine step (:func:`propose_batch`): one
drafter call per position, the rows built together (compiled, threaded, or on a tensor's
device), each job's rows exactly :func:`pp1wire.q.proposal.propose`'s for it alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error
from pp1wire.q import dyadic
from pp1wire.q import rows as rows_
from pp1wire.q.proposal import (
    DRAFTER_KINDS,
    MAX_DEPTH,
    BatchDrafterFn,
    DrafterKind,
    DraftJob,
    ExtendedPrefix,
    QRow,
    _greedy_row,
    _greedy_weights,
    _host,
    _is_tensor,
    stopped_by,
)
from pp1wire.q.rng import Domain, Role, RoundStreams
from pp1wire.q.stoprules import admits_next


class _Draft:
    """One job's state while the batch is drafted."""

    __slots__ = ("context", "drawn", "index", "job", "rows", "streams")

    def __init__(self, index: int, job: DraftJob, streams: RoundStreams) -> None:
        self.index = index
        self.job = job
        self.streams = streams
        self.context = ExtendedPrefix(job.prefix)
        self.rows: list[QRow] = []
        self.drawn: list[int] = []  # each row's count at its token (the stop rule's input)


# The threads that build q rows, one pool per thread count.
_pool: Final[rows_.PerSize[int, ThreadPoolExecutor]] = rows_.PerSize(
    lambda workers: ThreadPoolExecutor(workers, thread_name_prefix="pp1-q")
)


def propose_batch(
    drafter: BatchDrafterFn,
    jobs: Sequence[DraftJob],
    vocab_size: int,
    *,
    threads: int = 2,
    row_entries: int | None = None,
    kind: DrafterKind = "logits",
    on_position: Callable[[int, list[tuple[int, QRow]]], None] | None = None,
) -> list[tuple[QRow, ...] | Pp1Error]:
    """Draw many requests' blocks together, as an engine's step does.

    Per position, **one** call of ``drafter`` over every job still drafting, then every
    row built and sampled together on ``threads`` threads. Each job gets exactly
    :func:`propose`'s result for it alone, or the :class:`~pp1wire.errors.Pp1Error` it
    raises (``INTERNAL`` for another exception, its ``__cause__``); a call that fails for
    several prefixes is asked again per prefix, so a failure is its own job's. A row that
    is not 1-D of ``vocab_size`` values is its job's ``BAD_SHAPE``.

    ``kind``: logits or probabilities (:func:`drafter_kind`); a probabilities tensor is
    built where it lives (:func:`pp1wire.q.torch_ops.build_position`). With
    ``row_entries`` each dense row of a positive temperature is its wire payload
    (:attr:`QRow.q32`, ``counts`` None). ``on_position(i, rows)`` gets each position's
    rows as ``(job index, row)`` as soon as they are drawn (``docs/adaptive.md`` §7).

    Raises:
        ValueError: for ``vocab_size`` or ``threads`` below 1, ``row_entries`` below ``vocab_size``,
            or an unknown ``kind`` (a job's failure is returned, never raised).
    """
    if vocab_size < 1 or threads < 1:
        raise ValueError("vocab_size and threads must be at least 1")
    if row_entries is not None and row_entries < vocab_size:
        raise ValueError(f"row_entries {row_entries} below the vocabulary {vocab_size}")
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"a drafter's kind is 'logits' or 'probs', not {kind!r}")
    results: list[tuple[QRow, ...] | Pp1Error | None] = [None] * len(jobs)
    live: list[_Draft] = []
    for index, job in enumerate(jobs):
        try:
            streams = RoundStreams(Role.WORKER, job.seed, job.generation, job.round_id)
            if not 1 <= job.depth <= MAX_DEPTH:
                raise ConstructionError(
                    ErrorCode.BAD_SHAPE, f"depth {job.depth} outside 1..{MAX_DEPTH}"
                )
        except Pp1Error as exc:
            results[index] = exc
            continue
        live.append(_Draft(index, job, streams))
    for i in range(MAX_DEPTH):
        if not live:
            break
        rows = _draft_rows(drafter, [d.context for d in live], vocab_size, kind)
        if isinstance(rows, Pp1Error) and len(live) > 1:
            # One prefix may have failed the whole call: ask for each alone, so that
            # a failure is its own job's and the others go on as they would alone.
            rows = [_row_alone(drafter, d.context, vocab_size, kind) for d in live]
        if isinstance(rows, Pp1Error):
            for d in live:
                results[d.index] = cast(Pp1Error, stopped_by(rows, d.rows))
            break
        going: list[_Draft] = []
        drawn_now: list[tuple[int, QRow]] = []
        built = (
            _device_position(live, rows, i, row_entries)
            if isinstance(rows, _DeviceRows)
            else _build_position(live, rows, i, threads, row_entries, kind)
        )
        for d, got in zip(live, built, strict=True):
            if isinstance(got, Pp1Error):
                results[d.index] = cast(Pp1Error, stopped_by(got, d.rows))
                continue
            d.rows.append(got)
            drawn_now.append((d.index, got))
            d.context.append(got.token)
            d.drawn.append(got.count_at(got.token))
            job = d.job
            if admits_next(job.stop, job.depth, d.drawn, d.context.tail, job.eos):
                going.append(d)
            else:
                results[d.index] = tuple(d.rows)
        if on_position is not None and drawn_now:
            on_position(i, drawn_now)
        live = going
    assert all(r is not None for r in results)
    return cast("list[tuple[QRow, ...] | Pp1Error]", results)


def _row_alone(
    drafter: BatchDrafterFn, prefix: ExtendedPrefix, vocab_size: int, kind: DrafterKind
) -> _Drafted:
    """One prefix's row from a call of its own (a tensor read to the host), or its error."""
    got = _draft_rows(drafter, [prefix], vocab_size, kind)
    if isinstance(got, Pp1Error):
        return got
    if isinstance(got, _DeviceRows):
        host: npt.NDArray[np.float32] = np.asarray(_host(got.tensor), dtype=np.float32)
        return cast(npt.NDArray[np.float32], host[0])
    return got[0]


@dataclass(frozen=True, slots=True)
class _DeviceRows:
    """A probabilities drafter's ``[N, V]`` torch tensor, left where it lives."""

    tensor: Any


_Drafted = npt.NDArray[np.float64] | npt.NDArray[np.float32] | Pp1Error


def _draft_rows(
    drafter: BatchDrafterFn, prefixes: list[ExtendedPrefix], vocab_size: int, kind: DrafterKind
) -> list[_Drafted] | _DeviceRows | Pp1Error:
    """One drafter call: a row per prefix (float64 logits, or FP32 weights for a
    probabilities drafter; or that row's error), a probabilities tensor to build on its
    device, or the call's error."""
    dtype = np.float32 if kind == "probs" else np.float64
    try:
        out: Any = drafter(prefixes)
        if _is_tensor(out):
            shape = tuple(cast(Any, out).shape)
            if len(shape) != 2 or shape != (len(prefixes), vocab_size):
                return ConstructionError(
                    ErrorCode.BAD_SHAPE,
                    f"drafter gave rows of shape {shape} for {len(prefixes)} prefixes",
                )
            if kind == "probs":
                return _DeviceRows(out)
            out = _host(out)
        if isinstance(out, np.ndarray):
            with np.errstate(over="ignore"):  # beyond FP32: infinite, and refused
                x = np.asarray(out, dtype=dtype)
            if x.ndim != 2 or x.shape != (len(prefixes), vocab_size):
                return ConstructionError(
                    ErrorCode.BAD_SHAPE,
                    f"drafter gave rows of shape {x.shape} for {len(prefixes)} prefixes",
                )
            return list(x)
        if len(out) != len(prefixes):
            return ConstructionError(
                ErrorCode.BAD_SHAPE, f"drafter gave {len(out)} rows for {len(prefixes)} prefixes"
            )
        rows: list[_Drafted] = []
        for item in out:
            try:
                with np.errstate(over="ignore"):
                    row = np.asarray(_host(item), dtype=dtype)
            except Exception as exc:  # a plugin's odd row, as propose meets it
                rows.append(_internal(exc))
                continue
            if row.ndim != 1 or row.size == 0:
                what = "weights" if kind == "probs" else "logits"
                rows.append(
                    ConstructionError(ErrorCode.BAD_SHAPE, f"{what} must be a non-empty 1-D row")
                )
            elif row.size != vocab_size:
                rows.append(
                    ConstructionError(
                        ErrorCode.BAD_SHAPE, f"{row.size} values for a vocabulary of {vocab_size}"
                    )
                )
            else:
                rows.append(cast(_Drafted, row))
        return rows
    except Pp1Error as exc:
        return exc
    except Exception as exc:  # a drafter plugin failure fails its jobs, not the caller
        return _internal(exc)


def _internal(exc: Exception) -> Pp1Error:
    err = Pp1Error(ErrorCode.INTERNAL, f"drafting failed: {exc!r}")
    err.__cause__ = exc
    return err


@dataclass(slots=True, eq=False)
class _Row:
    """One position of one job on its way through construction."""

    at: int  # the job's place in the position's list
    values: npt.NDArray[np.float64] | npt.NDArray[np.float32]  # logits, or FP32 weights
    temperature: float
    support: int
    top: float
    draw: int
    draw_error: Pp1Error | None
    probs: bool = False  # the values are a probabilities drafter's FP32 weights


def _position_draws(drafts: list[_Draft], i: int) -> list[tuple[int, Pp1Error | None]]:
    """Each draft's proposal draw at position ``i``, or the error drawing it raised (which
    counts only after the row's own, in propose's order)."""
    out: list[tuple[int, Pp1Error | None]] = []
    for d in drafts:
        try:
            out.append((d.streams.u24(Domain.PROPOSAL, len(d.job.prefix) + i), None))
        except Pp1Error as exc:
            out.append((0, exc))
    return out


def _build_position(
    drafts: list[_Draft],
    rows: list[_Drafted],
    i: int,
    threads: int,
    row_entries: int | None,
    kind: DrafterKind,
) -> list[QRow | Pp1Error]:
    """Position ``i`` of every draft: its q row and token, or its error."""
    out: list[QRow | Pp1Error | None] = [None] * len(drafts)
    dense: list[_Row] = []
    sparse: list[_Row] = []
    probs = kind == "probs"
    for at, (d, values) in enumerate(zip(drafts, rows, strict=True)):
        if isinstance(values, Pp1Error):
            out[at] = values
            continue
        job = d.job
        ((draw, draw_error),) = _position_draws([d], i)
        try:
            if job.temperature == 0:
                counts, ids, token = (
                    _greedy_weights(cast("npt.NDArray[np.float32]", values), job.support or None)
                    if probs
                    else _greedy_row(values, job.support or None)
                )
                out[at] = draw_error or QRow(token=token, counts=counts, ids=ids)
                continue
            if probs:
                dyadic.check_probs_temperature(job.temperature)
                if job.support:
                    dyadic.check_k(job.support)
                top = 0.0  # unused: weights need no shift
            else:
                if job.support:
                    dyadic.check_k(job.support)
                dyadic.check_temperature(job.temperature)
                top = dyadic.check_top(float(values.max()))
        except Pp1Error as exc:
            out[at] = exc
            continue
        row = _Row(at, values, job.temperature, job.support, top, draw, draw_error, probs)
        (sparse if job.support else dense).append(row)
    parts = min(threads, max(len(dense), len(sparse) // 4, 1))
    if parts == 1:
        done = _construct(dense, sparse, row_entries)
    else:
        chunks = [(dense[p::parts], sparse[p::parts], row_entries) for p in range(parts)]
        futures = [_pool(parts - 1).submit(_construct, *c) for c in chunks[1:]]
        done = _construct(*chunks[0])
        for f in futures:
            done += f.result()
    for at, got in done:
        out[at] = got
    assert all(r is not None for r in out)
    return cast("list[QRow | Pp1Error]", out)


def _construct(
    dense: list[_Row], sparse: list[_Row], row_entries: int | None
) -> list[tuple[int, QRow | Pp1Error]]:
    """Build and sample rows whose checks passed (on any thread); an unexpected
    failure fails these rows with ``INTERNAL`` rather than the whole batch."""
    try:
        # A logit far below the top over a small temperature overflows to -inf,
        # whose weight is 0 as intended: nothing to warn about.
        with np.errstate(over="ignore"):
            return _construct_rows(dense, sparse, row_entries)
    except Exception as exc:
        return [(r.at, _internal(exc)) for r in (*dense, *sparse)]


def _construct_rows(
    dense: list[_Row], sparse: list[_Row], row_entries: int | None
) -> list[tuple[int, QRow | Pp1Error]]:
    done: list[tuple[int, QRow | Pp1Error]] = []
    probs = any(r.probs for r in (*dense, *sparse))  # one kind per position
    if dense:
        draws = [r.draw for r in dense]
        built: list[QRow | Pp1Error] = []
        weights: Any = [r.values for r in dense]
        if not probs:
            weights = rows_.weights_rows(
                [cast("npt.NDArray[np.float64]", r.values) for r in dense],
                [r.top for r in dense],
                [r.temperature for r in dense],
            )
        if row_entries is not None:
            # One compiled pass per row: checks, total, allocation, draw, wire values.
            payloads, picks = rows_.construct_rows(list(weights), draws, row_entries)
            for payload, pick in zip(payloads, picks, strict=True):
                built.append(pick if isinstance(pick, Pp1Error) else QRow(pick, q32=payload))
        elif probs:
            for r in dense:
                try:
                    counts = dyadic.counts_from_fp32(r.values)
                    built.append(QRow(dyadic.sample(counts, r.draw), counts=counts))
                except Pp1Error as exc:
                    built.append(exc)
        else:
            counts, picks = rows_.allocate_rows(weights, draws)
            for j, pick in enumerate(picks):
                built.append(pick if isinstance(pick, Pp1Error) else QRow(pick, counts=counts[j]))
        for r, row in zip(dense, built, strict=True):
            done.append((r.at, row if isinstance(row, Pp1Error) else r.draw_error or row))
    for r in sparse:
        try:
            if probs:
                ids, sparse_counts = dyadic.sparse_counts_from_fp32(r.values, r.support)
            else:
                ids, sparse_counts = dyadic.sparse_row_from_logits(
                    cast("npt.NDArray[np.float64]", r.values), r.top, r.temperature, r.support
                )
            token = int(ids[dyadic.sample(sparse_counts, r.draw)])
        except Pp1Error as exc:
            done.append((r.at, exc))
            continue
        done.append((r.at, r.draw_error or QRow(token=token, counts=sparse_counts, ids=ids)))
    return done


def _device_position(
    drafts: list[_Draft], rows: _DeviceRows, i: int, row_entries: int | None
) -> list[QRow | Pp1Error]:
    """Position ``i`` of every draft from a probabilities tensor, built on its device."""
    from pp1wire.q import torch_ops  # noqa: PLC0415 - torch is optional; a tensor means it is here

    draws = _position_draws(drafts, i)
    specs = [(d.job.temperature, d.job.support) for d in drafts]
    built = torch_ops.build_position(rows.tensor, specs, [u for u, _ in draws], row_entries)
    return [
        got if isinstance(got, Pp1Error) else (error or got)
        for got, (_, error) in zip(built, draws, strict=True)
    ]


__all__ = ["propose_batch"]
