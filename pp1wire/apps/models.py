"""Built-in toy models: a low-rank bigram target and a perturbed copy as its drafter, exact and
deterministic from ``(vocab_size, seed)``, so that tests can compute the target's law for any
prefix (acceptance is high but not one); the default vocabulary is DeepSeek's 129,280."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from pp1wire.q.proposal import DrafterFn, DrafterKind, drafter_kind
from pp1wire.q.verify import TargetFn

DEFAULT_VOCAB = 129_280
DEFAULT_RANK = 8
DRAFT_NOISE = 0.35
_BOS = 0


class ToyLM:
    """A deterministic low-rank bigram model over ``vocab_size`` tokens."""

    def __init__(
        self,
        vocab_size: int = DEFAULT_VOCAB,
        seed: int = 0,
        *,
        draft: bool = False,
        rank: int = DEFAULT_RANK,
        noise: float = DRAFT_NOISE,
    ) -> None:
        """Build the model's tables from ``seed``; the drafter perturbs the target's.

        Raises:
            ValueError: if ``vocab_size < 2`` or ``rank < 1``.
        """
        if vocab_size < 2 or rank < 1:
            raise ValueError("need vocab_size >= 2 and rank >= 1")
        base = np.random.default_rng([seed, 0x7050_3157])
        self.vocab_size = vocab_size
        emb = base.standard_normal((vocab_size, rank))
        out = base.standard_normal((rank, vocab_size))
        ranks = np.arange(1, vocab_size + 1, dtype=np.float64)
        bias = -1.1 * np.log(ranks)
        bias = bias[base.permutation(vocab_size)]
        if draft:
            pert = np.random.default_rng([seed, 0xD4AF7])
            emb = emb + noise * pert.standard_normal(emb.shape)
            out = out + noise * pert.standard_normal(out.shape)
        self._emb = emb.astype(np.float32)
        self._out = out.astype(np.float32)
        self._bias = bias
        self._scale = 1.2 / float(np.sqrt(rank))

    def logits(self, prefix: Sequence[int]) -> npt.NDArray[np.float64]:
        """Next-token logits (binary64) after ``prefix``; only the last token matters."""
        last = int(prefix[-1]) if len(prefix) else _BOS
        row: npt.NDArray[np.float64] = (self._emb[last] @ self._out).astype(np.float64)
        row *= self._scale
        row += self._bias
        return row

    def logits_batch(self, prefixes: Sequence[Sequence[int]]) -> npt.NDArray[np.float64]:
        """:meth:`logits` of every prefix, as the rows of one ``[B, V]`` array, bit for bit (each
        distinct last token's product is the per-prefix one: a BLAS matrix product may add in
        another order)."""
        lasts = [int(p[-1]) if len(p) else _BOS for p in prefixes]
        distinct = sorted(set(lasts))
        products = np.empty((len(distinct), self.vocab_size), dtype=np.float32)
        for j, last in enumerate(distinct):
            products[j] = self._emb[last] @ self._out
        rows: npt.NDArray[np.float64] = products[np.searchsorted(distinct, lasts)].astype(
            np.float64
        )
        rows *= self._scale
        rows += self._bias
        return rows

    def probs(self, prefix: Sequence[int]) -> npt.NDArray[np.float64]:
        """Exact (binary64 softmax) next-token probabilities after ``prefix``."""
        z = self.logits(prefix)
        z -= z.max()
        np.exp(z, out=z)
        z /= z.sum()
        return z

    def probs_batch(self, prefixes: Sequence[Sequence[int]]) -> npt.NDArray[np.float64]:
        """:meth:`probs` of every prefix, as the rows of one ``[B, V]`` array (bit for bit)."""
        z = self.logits_batch(prefixes)
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        for r in range(z.shape[0]):  # each row's own 1-D sum: the order probs adds in
            z[r] /= z[r].sum()
        return z

    def probs32(self, prefix: Sequence[int]) -> npt.NDArray[np.float32]:
        """:meth:`probs` rounded to FP32: what a draft head hands over as probabilities."""
        return self.probs(prefix).astype(np.float32)

    def probs32_batch(self, prefixes: Sequence[Sequence[int]]) -> npt.NDArray[np.float32]:
        """:meth:`probs32` of every prefix, as one ``[B, V]`` float32 array (bit for bit)."""
        return self.probs_batch(prefixes).astype(np.float32)

    __call__ = probs
    batch = probs_batch


class ModelFn:
    """A per-prefix model function with its vectorized form as ``batch`` (what
    ``batched_drafter`` and ``batched`` look for); as a drafter, its rows are ``kind``."""

    __slots__ = ("_many", "_one", "kind")

    def __init__(
        self,
        one: Callable[[Sequence[int]], npt.NDArray[np.floating]],
        many: Callable[[Sequence[Sequence[int]]], npt.NDArray[np.floating]],
        *,
        kind: DrafterKind = "logits",
    ) -> None:
        """Pair ``one`` (prefix → row) with ``many`` (prefixes → ``[B, V]``).

        Raises:
            ValueError: for another ``kind``.
        """
        self._one = one
        self._many = many
        self.kind: DrafterKind = kind
        drafter_kind(self)

    def __call__(self, prefix: Sequence[int]) -> npt.NDArray[np.floating]:
        """The row for one prefix."""
        return self._one(prefix)

    def batch(self, prefixes: Sequence[Sequence[int]]) -> npt.NDArray[np.floating]:
        """The rows for many prefixes, one call."""
        return self._many(prefixes)


def toy_target(vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> ToyLM:
    """The built-in target model for ``(vocab_size, seed)``."""
    return ToyLM(vocab_size, seed)


def toy_drafter(vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> ToyLM:
    """The built-in drafter matching :func:`toy_target` with the same arguments."""
    return ToyLM(vocab_size, seed, draft=True)


def drafter_factory(
    vocab_size: int = DEFAULT_VOCAB, seed: int = 0, *, kind: DrafterKind = "logits"
) -> DrafterFn:
    """Plugin factory for ``--drafter pp1wire.apps.models:drafter_factory``: prefix → logits,
    with ``batch`` (``kind="probs"``: FP32 probabilities).

    Raises:
        ValueError: for a ``kind`` other than ``"logits"`` and ``"probs"``.
    """
    model = toy_drafter(vocab_size, seed)
    if kind == "probs":
        return ModelFn(model.probs32, model.probs32_batch, kind="probs")
    return ModelFn(model.logits, model.logits_batch, kind=kind)


def probs_drafter_factory(vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> DrafterFn:
    """Plugin factory for ``--drafter pp1wire.apps.models:probs_drafter_factory``: the toy
    drafter handing over FP32 probabilities (``kind = "probs"``), with ``batch``."""
    return drafter_factory(vocab_size, seed, kind="probs")


def target_factory(vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> TargetFn:
    """Plugin factory for ``--target pp1wire.apps.models:target_factory``: prefix → p, with
    ``batch``."""
    model = toy_target(vocab_size, seed)
    return ModelFn(model.probs, model.probs_batch)
