"""Proposal chains, the worker's side of a round: each position's q built from the drafter's
row after the actual earlier draws and sampled with the PROPOSAL draw, the block ended by its
depth, a terminal token or its stop rule, never by a look at a draw (``docs/adaptive.md``).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast, overload

import numpy as np
import numpy.typing as npt
import xxhash

from pp1wire.errors import ConstructionError, ErrorCode, Pp1Error, ProposalReleasedError, RngError
from pp1wire.q import dyadic, stoprules
from pp1wire.q.rng import Domain, Role, RoundStreams
from pp1wire.q.stoprules import FIXED, StopRule, admits_next

MAX_DEPTH = stoprules.MAX_DEPTH
_LITTLE = sys.byteorder == "little"

DrafterFn = Callable[[Sequence[int]], npt.NDArray[np.floating]]
"""A drafter: token prefix → one row over the vocabulary: logits, or (``kind`` ``"probs"``)
probabilities or non-negative weights."""

DrafterKind = Literal["logits", "probs"]
DRAFTER_KINDS: Final = ("logits", "probs")


def drafter_kind(drafter: object) -> DrafterKind:
    """What a drafter's rows are: its ``kind`` attribute, ``"logits"`` (the default) or
    ``"probs"`` (``docs/protocol.md`` §6.1).

    Raises:
        ValueError: for any other ``kind``.
    """
    kind = getattr(drafter, "kind", "logits")
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"a drafter's kind is 'logits' or 'probs', not {kind!r}")
    return cast(DrafterKind, kind)


def _token_bytes(tokens: Sequence[int]) -> bytes | memoryview:
    if isinstance(tokens, array) and tokens.typecode == "i" and _LITTLE:
        return memoryview(tokens)
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0x7FFFFFFF):
        raise ValueError("token IDs must fit in non-negative int32")
    return arr.astype("<i4").tobytes()


def prefix_digest(tokens: Sequence[int]) -> int:
    """The committed-prefix digest: xxh3-64 of the tokens as little-endian int32.

    Raises:
        ValueError: if a token does not fit in int32.
    """
    return int(xxhash.xxh3_64_intdigest(_token_bytes(tokens)))


class PrefixDigest:
    """:func:`prefix_digest` of a growing prefix, streamed: a commit hashes its new tokens
    only, and :attr:`value` equals the one-shot digest."""

    __slots__ = ("_hash", "length")

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        """Start with ``tokens`` (hashed once).

        Raises:
            ValueError: if a token does not fit in int32.
        """
        self._hash = xxhash.xxh3_64()
        self.length = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``.

        Raises:
            ValueError: if a token does not fit in int32 (nothing is appended).
        """
        if len(tokens):
            self._hash.update(_token_bytes(tokens))
            self.length += len(tokens)

    @property
    def value(self) -> int:
        """The digest of the prefix so far."""
        return int(self._hash.intdigest())

    def copy(self) -> PrefixDigest:
        """An independent digest of the same prefix (to try an extension)."""
        twin = PrefixDigest()
        twin._hash = self._hash.copy()
        twin.length = self.length
        return twin


class ExtendedPrefix(Sequence[int]):
    """A committed prefix followed by tokens drawn after it, the prefix viewed, not copied:
    what drafters and targets are called with while a block is drawn or verified."""

    __slots__ = ("_base", "_tail")

    def __init__(self, base: Sequence[int]) -> None:
        """View ``base`` (not copied; it must not change while the view is used)."""
        self._base = base
        self._tail: list[int] = []

    def append(self, token: int) -> None:
        """Add a token after the prefix."""
        self._tail.append(token)

    @property
    def tail(self) -> list[int]:
        """The tokens added after the prefix."""
        return self._tail

    def __len__(self) -> int:
        """Prefix plus added tokens."""
        return len(self._base) + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        """A token, or a list for a slice.

        Raises:
            IndexError: for an index outside the sequence.
        """
        n = len(self._base)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            head = [int(t) for t in self._base[start : max(start, min(stop, n))]]
            return head + self._tail[max(start - n, 0) : max(stop - n, 0)]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError("prefix index out of range")
        return int(self._base[i]) if i < n else self._tail[i - n]

    def __iter__(self) -> Iterator[int]:
        """The prefix's tokens, then the added ones."""
        for t in self._base:
            yield int(t)
        yield from self._tail


class Lease:
    """Whether rows that view a receive buffer may still be read (shared by one proposal)."""

    __slots__ = ("released",)

    def __init__(self) -> None:
        """A live lease."""
        self.released = False


class QRow:
    """One proposal position: the sampled token and the exact q it was drawn from.

    q is integer ``counts`` or a received row's validated FP32 values ``q32`` (a view of
    the receive buffer); ``ids`` is ``None`` for a dense row, else the ascending support.
    A row under a receive buffer's ``lease`` refuses to read q once the proposal is
    released (:class:`~pp1wire.errors.ProposalReleasedError`); the token stays readable.
    """

    __slots__ = ("_counts", "_ids", "_lease", "_q32", "token")

    def __init__(
        self,
        token: int,
        counts: npt.NDArray[np.int64] | npt.NDArray[np.int32] | None = None,
        ids: npt.NDArray[np.int32] | None = None,
        q32: npt.NDArray[np.float32] | None = None,
        lease: Lease | None = None,
    ) -> None:
        """A row; exactly one of ``counts`` and ``q32``.

        Raises:
            ValueError: unless exactly one of ``counts`` and ``q32`` is given.
        """
        if (counts is None) == (q32 is None):
            raise ValueError("give exactly one of counts and q32")
        self.token = token
        self._counts = counts
        self._ids = ids
        self._q32 = q32
        self._lease = lease

    def _live(self) -> None:
        if self._lease is not None and self._lease.released:
            raise ProposalReleasedError(
                "this proposal was released: its q rows now view a recycled buffer"
            )

    @property
    def counts(self) -> npt.NDArray[np.int64] | npt.NDArray[np.int32] | None:
        """Integer counts (rows built locally), else None; released: ProposalReleasedError."""
        self._live()
        return self._counts

    @property
    def ids(self) -> npt.NDArray[np.int32] | None:
        """Ascending sparse support, None for a dense row; released: ProposalReleasedError."""
        self._live()
        return self._ids

    @property
    def q32(self) -> npt.NDArray[np.float32] | None:
        """The FP32 q values of a received row, else None; released: ProposalReleasedError."""
        self._live()
        return self._q32

    @property
    def borrowed(self) -> bool:
        """Whether q views a buffer lent to this row (a receive buffer, under a lease)."""
        return self._lease is not None

    @property
    def length(self) -> int:
        """Number of q entries carried (vocabulary-wide for dense rows)."""
        arr = self.counts if self.counts is not None else self.q32
        assert arr is not None
        return int(arr.shape[0])

    def _count_index(self, index: int) -> int:
        if self.counts is not None:
            return int(self.counts[index])
        assert self.q32 is not None
        return int(float(self.q32[index]) * dyadic.M)

    def count_at(self, token: int) -> int:
        """The integer count of ``token`` (0 outside a sparse support)."""
        if self.ids is None:
            return self._count_index(token) if 0 <= token < self.length else 0
        where = int(np.searchsorted(self.ids, token))
        if where < self.ids.size and int(self.ids[where]) == token:
            return self._count_index(where)
        return 0

    def dense_counts(self, vocab_size: int) -> npt.NDArray[np.int64]:
        """The integer counts as a vector over the vocabulary (zero outside a sparse support)."""
        return np.rint(self.dense_q(vocab_size) * dyadic.M).astype(np.int64)

    def dense_q(self, vocab_size: int) -> npt.NDArray[np.float64]:
        """q as a binary64 vector over the vocabulary (exact: counts / 2**24)."""
        if self.counts is not None:
            values = self.counts.astype(np.float64) / dyadic.M
        else:
            assert self.q32 is not None
            values = self.q32.astype(np.float64)
        if self.ids is None:
            return values[:vocab_size]
        q = np.zeros(vocab_size, dtype=np.float64)
        q[self.ids] = values
        return q


@dataclass(frozen=True)
class Proposal:
    """A whole validated proposal block, keyed to exactly one round.

    ``position`` is the committed prefix's length and ``digest`` its :func:`prefix_digest`;
    ``shard`` is ``(start, end)`` for one link's shard of a sharded proposal (§6.7), which
    only its group verifies; ``stop`` the STEP's stop rule (``depth`` its maximum); ``cut``
    the code of a fault that ended the block before its next row (``docs/adaptive.md`` §7).
    """

    session: int
    generation: int
    round_id: int
    position: int
    digest: int
    depth: int
    rows: tuple[QRow, ...]
    context: int = 0
    shard: tuple[int, int] | None = None
    stop: StopRule = FIXED
    cut: ErrorCode | None = None
    #: The slot it was received on (-1: built in this process, not received).
    slot: int = -1
    #: Gives the rows' receive buffers back (set by the client that received it).
    releaser: Callable[[Proposal], None] | None = field(default=None, compare=False, repr=False)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The sampled draft tokens in position order."""
        return tuple(r.token for r in self.rows)

    def release(self) -> None:
        """Done with the rows: their receive buffers may be reused (idempotent; reading q
        afterwards raises :class:`~pp1wire.errors.ProposalReleasedError`)."""
        if self.releaser is not None:
            self.releaser(self)

    def __enter__(self) -> Proposal:
        """The proposal itself; :meth:`release` runs when the block ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Release the rows."""
        self.release()


def greedy_counts(
    vocab: int, token: int, sparse: bool
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32] | None]:
    """A greedy row's q, the point mass at ``token``: (counts, ids), dense over ``vocab``
    entries (ids ``None``) or ``sparse``, the one-entry support.

    Raises:
        ConstructionError: ``BAD_SHAPE`` for a dense row if ``token`` is not in ``[0, vocab)``.
    """
    if not sparse:
        return dyadic.point_mass(vocab, token), None
    return np.array([dyadic.M], dtype=np.int64), np.array([token], dtype=np.int32)


def _greedy_row(
    logits: npt.ArrayLike, support: int | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32] | None, int]:
    """The greedy (temperature 0) row and its token: the point mass at the first maximal logit."""
    row = np.asarray(logits, dtype=np.float64)
    if row.ndim != 1 or row.size == 0 or np.isnan(row).any() or np.isposinf(row).any():
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "greedy logits must be finite or -inf")
    top = int(np.argmax(row))
    if row[top] == -np.inf:
        raise ConstructionError(ErrorCode.ZERO_MASS, "every logit is -inf")
    return (*greedy_counts(row.size, top, support is not None), top)


def _greedy_weights(
    weights: npt.NDArray[np.float32], support: int | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32] | None, int]:
    """The greedy row of a probabilities drafter, after the checks of §6.1: the point mass
    at the first maximal weight."""
    row = weights
    if row.ndim != 1 or row.size == 0:
        raise ConstructionError(ErrorCode.BAD_SHAPE, "weights must be a non-empty 1-D row")
    if not np.isfinite(row).all():
        raise ConstructionError(ErrorCode.WEIGHT_NON_FINITE, "weights contain NaN or infinity")
    if (row < 0).any():
        raise ConstructionError(ErrorCode.WEIGHT_NEGATIVE, "weights contain negative values")
    top = int(np.argmax(row))
    if not row[top] > 0:
        raise ConstructionError(ErrorCode.ZERO_MASS, "weights have zero total mass")
    return (*greedy_counts(row.size, top, support is not None), top)


def probs_row(row: object) -> npt.NDArray[np.float32]:
    """A probabilities drafter's row as the FP32 values q is built from: float32 as it is,
    anything else (a tensor on any device too) rounded to FP32 (beyond its range: infinite).

    Raises:
        ConstructionError: ``BAD_SHAPE`` unless it is a non-empty 1-D row.
    """
    x = _host(row)
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32):
        with np.errstate(over="ignore"):
            x = np.asarray(x, dtype=np.float32)
    if x.ndim != 1 or x.size == 0:
        raise ConstructionError(ErrorCode.BAD_SHAPE, "weights must be a non-empty 1-D row")
    return x


def _host(x: object) -> object:
    """A torch tensor's values on the host (as an array; others as they are)."""
    if _is_tensor(x):
        return cast(Any, x).detach().cpu().numpy()
    return x


def _is_tensor(x: object) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def build_row(
    logits: npt.ArrayLike, temperature: float, support: int | None, *, kind: DrafterKind = "logits"
) -> tuple[npt.NDArray[np.int64] | npt.NDArray[np.int32], npt.NDArray[np.int32] | None]:
    """q counts for one position: dense (``support=None``) or sparse top-k; temperature 0
    is greedy. With ``kind="probs"`` the FP32 values (:func:`probs_row`) are the weights,
    at temperature 1 (or 0).

    Raises:
        ConstructionError: see :mod:`pp1wire.q.dyadic`; ``BAD_TEMPERATURE`` for
            a probabilities row at a temperature other than 0 and 1.
    """
    if kind == "probs":
        w = probs_row(logits)
        if temperature == 0:
            counts, ids, _ = _greedy_weights(w, support)
            return counts, ids
        dyadic.check_probs_temperature(temperature)
        if support is None:
            return dyadic.counts_from_fp32(w), None
        ids, counts = dyadic.sparse_counts_from_fp32(w, support)
        return counts, ids
    if temperature == 0:
        counts, ids, _ = _greedy_row(logits, support)
        return counts, ids
    if support is None:
        row = np.asarray(logits, dtype=np.float64)
        if row.ndim != 1 or row.size == 0:
            raise ConstructionError(ErrorCode.BAD_SHAPE, "logits must be a non-empty 1-D row")
        # The builder's int32 scratch, copied once: counts never exceed 2**24.
        return dyadic.builder(row.size).from_logits(row, temperature).copy(), None
    ids, counts = dyadic.sparse_counts_from_logits(logits, temperature, support)
    return counts, ids


class DraftingStoppedError(Pp1Error):
    """Drafting failed after ``rows`` (never none) were drawn: they ship as a block that
    ended there (``docs/adaptive.md`` §7). ``code`` is the failure's COMPLETION status
    (``INTERNAL`` for an unexpected exception, its ``__cause__``).
    """

    def __init__(self, failure: BaseException, rows: Sequence[QRow]) -> None:
        """Drafting stopped by ``failure`` after ``rows`` (at least one).

        Raises:
            ValueError: for no rows.
        """
        if not rows:
            raise ValueError("a failure before the first row is raised as itself")
        code = failure.code if isinstance(failure, Pp1Error) else ErrorCode.INTERNAL
        detail = failure.detail if isinstance(failure, Pp1Error) else repr(failure)
        super().__init__(code, f"after {len(rows)} rows: {detail}")
        self.rows = tuple(rows)
        self.failure = failure
        self.__cause__ = failure


def stopped_by(failure: BaseException, rows: Sequence[QRow]) -> BaseException:
    """``failure`` itself when nothing was drawn before it, else :class:`DraftingStoppedError`."""
    return DraftingStoppedError(failure, rows) if rows else failure


def propose(
    prefix: Sequence[int],
    depth: int,
    drafter: DrafterFn,
    streams: RoundStreams,
    *,
    temperature: float = 1.0,
    support: int | None = None,
    eos: int | None = None,
    stop: StopRule = FIXED,
    on_row: Callable[[int, QRow], None] | None = None,
    vocab_size: int | None = None,
) -> tuple[QRow, ...]:
    """Draw one block of at most ``depth`` rows after ``prefix``.

    Row i's q is built from ``drafter(prefix + drafts[:i])`` (:func:`build_row`) and drawn
    with the proposal draw at position ``len(prefix) + i``; the next row is drawn only if
    :func:`pp1wire.q.stoprules.admits_next` admits it. ``on_row(i, row)`` gets each row as
    it is drawn; with ``vocab_size`` a 1-D row of another length is ``BAD_SHAPE``.

    Raises:
        ConstructionError: ``BAD_SHAPE`` for a depth outside 1..5, or whatever
            building q raises at the first row.
        RngError: if ``streams`` is not a worker stream or a key is reused.
        DraftingStoppedError: the drafter or construction failed at a later row (the
            rows drawn before it ride on the exception); anything the drafter
            raises at the first row propagates as itself.
        ValueError: for a drafter ``kind`` other than ``"logits"`` and ``"probs"``.
    """
    if not 1 <= depth <= MAX_DEPTH:
        raise ConstructionError(ErrorCode.BAD_SHAPE, f"depth {depth} outside 1..{MAX_DEPTH}")
    if streams.role is not Role.WORKER:
        # The RNG's own refusal, raised before the drafter runs (one meaning: a draw
        # in a domain the caller's role does not own).
        raise RngError(ErrorCode.WRONG_OWNER, "proposal draws belong to the worker")
    kind = drafter_kind(drafter)
    context = ExtendedPrefix(prefix)
    start = len(prefix)
    rows: list[QRow] = []
    drawn: list[int] = []  # each row's count at its own token: the rule's input
    for i in range(depth):
        try:
            raw = drafter(context)
            if vocab_size is not None:
                _check_width(raw, vocab_size)
            counts, ids = build_row(raw, temperature, support, kind=kind)
            u = streams.u24(Domain.PROPOSAL, start + i)
            pick = dyadic.sample(counts, u)
        except Exception as exc:
            if not rows:
                raise
            raise DraftingStoppedError(exc, rows) from exc
        token = pick if ids is None else int(ids[pick])
        rows.append(QRow(token=token, counts=counts, ids=ids))
        if on_row is not None:
            on_row(i, rows[-1])
        context.append(token)
        drawn.append(int(counts[pick]))
        if not admits_next(stop, depth, drawn, context.tail, eos):
            break
    return tuple(rows)


@dataclass(frozen=True)
class DraftJob:
    """One STEP to draft: the :func:`propose` arguments of one request's round (``support``
    0: dense), drawn with ``RoundStreams(Role.WORKER, seed, generation, round_id)``."""

    seed: int
    generation: int
    round_id: int
    prefix: Sequence[int]
    depth: int
    temperature: float = 1.0
    support: int = 0
    eos: int | None = None
    stop: StopRule = FIXED


BatchDrafterFn = Callable[
    [Sequence[Sequence[int]]], npt.NDArray[np.floating] | Sequence[npt.ArrayLike]
]
"""A batched drafter: prefixes → one logits row each (a ``[B, V]`` array or B rows)."""


def batched_drafter(drafter: DrafterFn) -> BatchDrafterFn:
    """``drafter``'s batched form: its own ``batch`` attribute, else one call per prefix."""
    batch = getattr(drafter, "batch", None)
    if callable(batch):
        return cast(BatchDrafterFn, batch)
    return lambda prefixes: [drafter(p) for p in prefixes]


def _check_width(raw: object, vocab_size: int) -> None:
    """Refuse a 1-D row whose length is not ``vocab_size`` (``BAD_SHAPE``); other shapes
    are :func:`build_row`'s to refuse."""
    shape: tuple[int, ...] = tuple(getattr(raw, "shape", None) or np.shape(cast(Any, raw)))
    if len(shape) == 1 and shape[0] not in (0, vocab_size):
        raise ConstructionError(
            ErrorCode.BAD_SHAPE, f"{shape[0]} values for a vocabulary of {vocab_size}"
        )
