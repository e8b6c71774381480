"""A draft/target pair with the statistics of real language: a 4-gram drafter and a 5-gram
target (interpolated Kneser-Ney) over byte-pair tokens learned, deterministically, from the English
text that ships with Python (``pydoc_data.topics``), counted once and cached on disk."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import heapq
import importlib
import itertools
import json
import os
import re
import tempfile
import threading
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from pp1wire.apps.models import DEFAULT_VOCAB, ModelFn
from pp1wire.apps.paced import (
    DEFAULT_DRAFTER_MS,
    DEFAULT_TARGET_MS,
    DRAFTER_MS_ENV,
    TARGET_MS_ENV,
    PacedModelFn,
    pace_seconds,
)

#: The module whose ``topics`` dict holds the text (pydoc's help topics).
TEXT_MODULE: Final = "pydoc_data.topics"
#: Byte-pair merges learned from the text.
MERGES: Final = 4000
#: The target's order and the drafter's.
TARGET_ORDER: Final = 5
DRAFT_ORDER: Final = 4
#: Kneser-Ney's absolute discount at every order of the target, and of the drafter
#: (smoothed more: a small model is less sure of itself than a large one).
TARGET_DISCOUNT: Final = 0.4
DRAFT_DISCOUNT: Final = 0.5
#: Overrides the cache directory (:func:`cache_dir`).
CACHE_ENV: Final = "PP1_NGRAM_CACHE"
#: The layout of the tables (bump when the build changes: old cache files are then ignored).
FORMAT: Final = "pp1-ngram-tables-v1"

# A piece: a word with its leading space, digits, punctuation, or white space
# (a run of spaces before a word leaves its last space to the word).
_PIECES = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
_ORDERS = (DRAFT_ORDER, TARGET_ORDER)

Row = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class CorpusMissingError(RuntimeError):
    """This Python has no ``pydoc_data.topics`` text to build the pair from."""


def source_text() -> str:
    """The text the pair is learned from: pydoc's help topics, in sorted key order.

    Raises:
        CorpusMissingError: if this Python install lacks the module or its text.
    """
    try:
        module = importlib.import_module(TEXT_MODULE)
        topics = module.topics
    except (ImportError, AttributeError) as exc:
        raise CorpusMissingError(
            f"the n-gram pair is learned from the standard library's {TEXT_MODULE}, which this "
            f"Python lacks ({exc}); install the interpreter's full standard library, or use "
            "the toy pair (pp1wire.apps.models)"
        ) from None
    if not isinstance(topics, dict) or not topics:
        raise CorpusMissingError(f"{TEXT_MODULE}.topics holds no text to learn the pair from")
    return "\n\n".join(str(topics[key]) for key in sorted(topics))


def text_digest(text: str) -> str:
    """SHA-256 of ``text`` in UTF-8, hex."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def learn_tokens(text: str, merges: int = MERGES) -> tuple[list[str], IntArray]:
    """Byte-pair encoding learned from ``text`` (pieces spelled in characters, the most
    frequent adjacent pair merged ``merges`` times, ties to the lowest symbols): the tokens,
    ID i the i-th most frequent (ties by text), and ``text`` encoded."""
    pieces = _PIECES.findall(text)
    counted = collections.Counter(pieces)
    words = sorted(counted)
    weight = [counted[w] for w in words]
    alphabet = sorted(set(text))
    symbol = {c: i for i, c in enumerate(alphabet)}
    spelled = list(alphabet)
    seqs = [[symbol[c] for c in w] for w in words]
    pairs: dict[tuple[int, int], int] = collections.defaultdict(int)
    where: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for index, seq in enumerate(seqs):
        for pair in itertools.pairwise(seq):
            pairs[pair] += weight[index]
            where[pair].add(index)
    heap = [(-n, a, b) for (a, b), n in pairs.items()]
    heapq.heapify(heap)
    done = 0
    while done < merges and heap:
        negative, a, b = heapq.heappop(heap)
        if pairs.get((a, b), 0) != -negative:
            continue  # a stale entry: this pair's count changed since it was pushed
        if -negative < 2:
            break  # nothing left that occurs twice
        new = len(spelled)
        spelled.append(spelled[a] + spelled[b])
        done += 1
        touched: set[tuple[int, int]] = set()
        for index in sorted(where.pop((a, b))):
            seq, n = seqs[index], weight[index]
            for pair in itertools.pairwise(seq):
                pairs[pair] -= n
                touched.add(pair)
            merged: list[int] = []
            i = 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            seqs[index] = merged
            for pair in itertools.pairwise(merged):
                pairs[pair] += n
                where[pair].add(index)
                touched.add(pair)
        for pair in sorted(touched):
            if pairs[pair] > 0:
                heapq.heappush(heap, (-pairs[pair], pair[0], pair[1]))
            else:
                del pairs[pair]
                where.pop(pair, None)
    spelling = dict(zip(words, seqs, strict=True))
    stream = [s for piece in pieces for s in spelling[piece]]
    frequency = collections.Counter(stream)
    ranked = sorted(frequency, key=lambda s: (-frequency[s], spelled[s]))
    rank = np.zeros(len(spelled), dtype=np.int64)
    rank[ranked] = np.arange(len(ranked), dtype=np.int64)
    return [spelled[s] for s in ranked], rank[np.asarray(stream, dtype=np.int64)]


def _ngram_keys(stream: IntArray, order: int, base: int) -> IntArray:
    """Each ``order``-token window of ``stream`` as one integer in base ``base``."""
    keys = np.zeros(stream.size - order + 1, dtype=np.int64)
    for i in range(order):
        keys = keys * base + stream[i : stream.size - order + 1 + i]
    return keys


@dataclass(frozen=True)
class Tables:
    """What the pair is built from: the tokens, and ``counts[n]``, each distinct n-token window
    of the encoded text as one integer (IDs as base-K digits, first most significant),
    ascending, with how often it occurs."""

    tokens: tuple[str, ...]
    counts: dict[int, tuple[IntArray, IntArray]]
    text_digest: str

    @property
    def size(self) -> int:
        """K: the number of tokens."""
        return len(self.tokens)

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of the tables in a canonical form: the same text gives the same one."""
        h = hashlib.sha256()
        h.update(json.dumps([FORMAT, MERGES, list(_ORDERS), self.text_digest]).encode())
        for token in self.tokens:
            h.update(token.encode("utf-8") + b"\0")
        for order in _ORDERS:
            keys, counts = self.counts[order]
            h.update(keys.astype("<i8").tobytes())
            h.update(counts.astype("<i8").tobytes())
        return h.hexdigest()


def build_tables(text: str) -> Tables:
    """Learn the tokens and count the n-grams of ``text`` (about a second for pydoc's text).

    Raises:
        ValueError: if ``text`` has so many kinds of tokens that an n-gram's key
            overflows int64 (pydoc's text has about 3,700; the limit is 6,208).
    """
    tokens, stream = learn_tokens(text)
    if len(tokens) ** max(_ORDERS) >= 1 << 63:
        raise ValueError(f"{len(tokens)} tokens: their {max(_ORDERS)}-grams do not fit in int64")
    counts = {}
    for order in _ORDERS:
        keys, n = np.unique(_ngram_keys(stream, order, len(tokens)), return_counts=True)
        counts[order] = (keys.astype(np.int64), n.astype(np.int64))
    return Tables(tuple(tokens), counts, text_digest(text))


def cache_dir() -> Path | None:
    """Where the tables are cached: ``$PP1_NGRAM_CACHE``, ``$XDG_CACHE_HOME/pp1wire`` or
    ``~/.cache/pp1wire``; None without a home directory."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "pp1wire"
    try:
        return Path.home() / ".cache" / "pp1wire"
    except RuntimeError:  # no home directory: build in memory every time
        return None


def _save(tables: Tables, path: Path) -> None:
    """Write ``tables`` to ``path`` atomically: a temporary file in the same folder, renamed."""
    blob = "\0".join(tables.tokens).encode("utf-8")
    arrays: dict[str, npt.NDArray[np.generic]] = {
        "meta": np.frombuffer(
            json.dumps(
                {"format": FORMAT, "text": tables.text_digest, "digest": tables.digest}
            ).encode(),
            dtype=np.uint8,
        ),
        "tokens": np.frombuffer(blob, dtype=np.uint8),
    }
    for order in _ORDERS:
        keys, counts = tables.counts[order]
        arrays[f"keys{order}"] = keys
        arrays[f"counts{order}"] = counts
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _load(path: Path, digest: str) -> Tables | None:
    """The tables cached at ``path`` for the text ``digest``; None unless they are readable,
    of this format and text, and what their recorded digest says."""
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            tokens = tuple(bytes(z["tokens"]).decode("utf-8").split("\0"))
            counts = {
                order: (
                    np.asarray(z[f"keys{order}"], dtype=np.int64),
                    np.asarray(z[f"counts{order}"], dtype=np.int64),
                )
                for order in _ORDERS
            }
    except (OSError, ValueError, KeyError, UnicodeDecodeError, zipfile.BadZipFile):
        return None
    if meta.get("format") != FORMAT or meta.get("text") != digest:
        return None
    tables = Tables(tokens, counts, digest)
    return tables if tables.digest == meta.get("digest") else None


_lock = threading.Lock()
_memo: dict[str, Tables] = {}


def tables() -> Tables:
    """The pair's tables for this Python's text: from memory, the disk cache, or built (and
    cached, where the cache can be written).

    Raises:
        CorpusMissingError: if this Python install lacks the text.
    """
    text = source_text()
    digest = text_digest(text)
    with _lock:
        found = _memo.get(digest)
        if found is not None:
            return found
        directory = cache_dir()
        path = None if directory is None else directory / f"ngram-{digest[:16]}-m{MERGES}.npz"
        found = _load(path, digest) if path is not None else None
        if found is None:
            found = build_tables(text)
            if path is not None:
                with contextlib.suppress(OSError):  # read-only: each process builds its own
                    _save(found, path)
        _memo[digest] = found
        return found


@dataclass(frozen=True)
class _Level:
    """One order of an interpolated Kneser-Ney model: per context, its followers."""

    index: dict[int, int]  # context key -> its position in ``start`` and ``lam``
    start: IntArray  # followers of context i: ids[start[i]:start[i + 1]]
    lam: Row  # the weight of the lower orders after context i
    ids: IntArray  # followers
    num: Row  # each follower's discounted count over the context's total


def _level(keys: IntArray, counts: IntArray, base: int, discount: float) -> _Level:
    contexts, first = np.unique(keys // base, return_index=True)
    totals = np.add.reduceat(counts, first).astype(np.float64)
    kinds = np.diff(np.append(first, keys.size))
    start = np.append(first, keys.size).astype(np.int64)
    num = (counts - discount) / np.repeat(totals, kinds)
    return _Level(
        index={int(c): i for i, c in enumerate(contexts.tolist())},
        start=start,
        lam=discount * kinds / totals,
        ids=(keys % base).astype(np.int64),
        num=num,
    )


class NgramLM:
    """An interpolated Kneser-Ney model of ``order`` (one absolute discount at every order,
    lower orders from continuation counts, then the uniform law) over the tables' K tokens,
    served over ``vocab_size`` IDs: IDs at or above K have probability zero, and below K
    a smaller vocabulary keeps the most frequent, renormalized. Thread-safe."""

    def __init__(
        self, table: Tables, order: int, discount: float, vocab_size: int = DEFAULT_VOCAB
    ) -> None:
        """Build the model's levels from ``table``'s raw ``order``-gram counts.

        Raises:
            ValueError: if ``vocab_size < 2``, the tables have no ``order``-gram
                counts, or ``discount`` is not in (0, 1).
        """
        if vocab_size < 2:
            raise ValueError("need vocab_size >= 2")
        if order not in table.counts:
            raise ValueError(f"the tables hold no {order}-gram counts")
        if not 0 < discount < 1:
            raise ValueError("need 0 < discount < 1")
        k = table.size
        self.order = order
        self.vocab_size = vocab_size
        self.tables = table
        self.size = k
        self.identity = _identity(order, discount, table)
        keys, counts = table.counts[order]
        self._levels: dict[int, _Level] = {}
        for n in range(order, 1, -1):
            self._levels[n] = _level(keys, counts, k, discount)
            # The next order down counts distinct left extensions (continuation counts).
            keys, counts = np.unique(keys % k ** (n - 1), return_counts=True)
        uni = _level(keys, counts, k, discount)
        base = np.full(k, uni.lam[0] / k)
        base[uni.ids] += uni.num
        base.flags.writeable = False
        self._base = base

    def _model_row(self, prefix: Sequence[int]) -> Row:
        """The model's probabilities over its K tokens after ``prefix`` (not normalized)."""
        k = self.size
        row = self._base.copy()
        key, scale = 0, 1
        for n in range(2, self.order + 1):
            if len(prefix) < n - 1:
                break
            token = int(prefix[len(prefix) - n + 1])
            if not 0 <= token < k:
                break  # an ID beyond the text's tokens: no longer context knows it
            key += token * scale
            scale *= k
            level = self._levels[n]
            at = level.index.get(key)
            if at is None:
                break  # an unseen context: no longer one was seen either
            a, b = level.start[at], level.start[at + 1]
            row *= level.lam[at]
            row[level.ids[a:b]] += level.num[a:b]
        return row

    def _probs_into(self, prefix: Sequence[int], out: Row) -> None:
        """Write the row for ``prefix`` into ``out`` (zero beyond the model's tokens)."""
        row = self._model_row(prefix)
        used = min(self.size, self.vocab_size)
        kept = row[:used]
        kept /= kept.sum()
        out[:used] = kept
        out[used:] = 0.0

    def probs(self, prefix: Sequence[int]) -> Row:
        """Next-token probabilities (binary64, summing to 1) over the global vocabulary."""
        row: Row = self.probs_batch([prefix])[0]
        return row

    def probs_batch(self, prefixes: Sequence[Sequence[int]]) -> Row:
        """:meth:`probs` of every prefix as the rows of one ``[B, V]`` array (bit for bit)."""
        out = np.empty((len(prefixes), self.vocab_size))
        for i, prefix in enumerate(prefixes):
            self._probs_into(prefix, out[i])
        return out

    def logits(self, prefix: Sequence[int]) -> Row:
        """Next-token logits: the log of :meth:`probs` (-inf beyond the model's tokens)."""
        row: Row = self.logits_batch([prefix])[0]
        return row

    def logits_batch(self, prefixes: Sequence[Sequence[int]]) -> Row:
        """:meth:`logits` of every prefix as the rows of one ``[B, V]`` array (bit for bit)."""
        with np.errstate(divide="ignore"):  # log(0) is the -inf beyond the model's tokens
            return np.log(self.probs_batch(prefixes))


def _identity(order: int, discount: float, table: Tables) -> str:
    return f"pp1-ngram{order}-d{discount:g}-{table.digest[:12]}"


def identities() -> tuple[str, str]:
    """The drafter's and the target's identities for HELLO: they name the tables, so that
    sides whose texts (and so models) differ do not pair.

    Raises:
        CorpusMissingError: if this Python install lacks the text.
    """
    table = tables()
    return (
        _identity(DRAFT_ORDER, DRAFT_DISCOUNT, table),
        _identity(TARGET_ORDER, TARGET_DISCOUNT, table),
    )


def ngram_target(vocab_size: int = DEFAULT_VOCAB) -> NgramLM:
    """The pair's target: the 5-gram model over ``vocab_size`` IDs.

    Raises:
        CorpusMissingError: if this Python install lacks the text.
        ValueError: if ``vocab_size < 2``.
    """
    return NgramLM(tables(), TARGET_ORDER, TARGET_DISCOUNT, vocab_size)


def ngram_drafter(vocab_size: int = DEFAULT_VOCAB) -> NgramLM:
    """The pair's drafter: the 4-gram model over ``vocab_size`` IDs.

    Raises:
        CorpusMissingError: if this Python install lacks the text.
        ValueError: if ``vocab_size < 2``.
    """
    return NgramLM(tables(), DRAFT_ORDER, DRAFT_DISCOUNT, vocab_size)


def drafter_factory(vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> ModelFn:
    """Plugin factory for ``--drafter pp1wire.apps.ngram:drafter_factory``: prefix -> logits,
    with ``batch`` (``seed``, for the plugin interface, changes nothing).

    Raises:
        CorpusMissingError: if this Python install lacks the text.
    """
    model = ngram_drafter(vocab_size)
    return ModelFn(model.logits, model.logits_batch)


def probs_drafter_factory(vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> ModelFn:
    """Plugin factory for ``--drafter pp1wire.apps.ngram:probs_drafter_factory``: the drafter
    handing over FP32 probabilities (``kind = "probs"``), as a draft head does.

    Raises:
        CorpusMissingError: if this Python install lacks the text.
    """
    model = ngram_drafter(vocab_size)
    return ModelFn(
        lambda prefix: model.probs(prefix).astype(np.float32),
        lambda prefixes: model.probs_batch(prefixes).astype(np.float32),
        kind="probs",
    )


def target_factory(vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> ModelFn:
    """Plugin factory for ``--target pp1wire.apps.ngram:target_factory``: prefix -> p, with
    ``batch``.

    Raises:
        CorpusMissingError: if this Python install lacks the text.
    """
    model = ngram_target(vocab_size)
    return ModelFn(model.probs, model.probs_batch)


def _paced(
    make: Callable[[int, int], ModelFn], env: str, default_ms: float
) -> Callable[[int, int], PacedModelFn[npt.NDArray[np.floating]]]:
    """The plugin factory ``make`` at ``$env`` (default ``default_ms``) ms per call."""

    def factory(
        vocab_size: int = DEFAULT_VOCAB, seed: int = 0
    ) -> PacedModelFn[npt.NDArray[np.floating]]:
        """The pair's model at a fixed cost per call (:mod:`pp1wire.apps.paced`).

        Raises:
            CorpusMissingError: if this Python install lacks the text.
            ValueError: for a pace that is not a duration in 0..60,000 ms.
        """
        return PacedModelFn(make(vocab_size, seed), pace_seconds(env, default_ms))

    return factory


#: The pair's target at ``PP1_PACED_TARGET_MS`` (default 20) ms per call, and its drafter
#: (logits, or FP32 probabilities) at ``PP1_PACED_DRAFTER_MS`` (default 0.5).
paced_target_factory = _paced(target_factory, TARGET_MS_ENV, DEFAULT_TARGET_MS)
paced_drafter_factory = _paced(drafter_factory, DRAFTER_MS_ENV, DEFAULT_DRAFTER_MS)
paced_probs_drafter_factory = _paced(probs_drafter_factory, DRAFTER_MS_ENV, DEFAULT_DRAFTER_MS)
