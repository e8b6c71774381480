"""The pp1wire RNG ABI: Philox4x32-10 keyed by request, generation, round and position.

ABI name: :data:`ABI_NAME` (``"pp1-philox4x32-10-v1"``). Two peers that agree on
this string produce bit-identical draws for the same key fields.

Key and counter layout (all words are unsigned 32-bit)::

    key     = (seed & 0xFFFFFFFF, seed >> 32)             # 64-bit request seed
    counter = (position,                                   # absolute token position
               round,                                      # round ID within the generation
               generation,                                 # session generation
               (domain << 24) | draw)                      # 8-bit domain, 24-bit draw counter

The map from (seed, generation, round, position, domain, draw) to (key, counter)
is injective over the documented field ranges, and Philox is a bijection of the
counter for a fixed key, so two draws that differ in any field never share a
Philox block: proposal noise can never be reused for acceptance or correction,
and no two positions share noise. Each draw consumes one whole block.

Domains and their single owners:

* ``PROPOSAL`` (1): the worker leader's proposal draws.
* ``ACCEPTANCE`` (2): the Spark side's accept/reject uniforms.
* ``CORRECTION`` (3): the Spark side's correction and bonus draws.
* ``TARGET`` (4): the Spark side's target-only decoding (fallback and depth 0).

Derived uniforms from a block ``(w0, w1, w2, w3)``:

* 24-bit draw: ``w0 >> 8``, uniform on ``[0, 2**24)``;
* 53-bit uniform: ``((w0 >> 5) * 2**26 + (w1 >> 6)) / 2**53``, uniform on the
  multiples of ``2**-53`` in ``[0, 1)``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from enum import IntEnum
from typing import Final, cast

import numpy as np
import numpy.typing as npt

from pp1wire.errors import ErrorCode, RngError

try:  # the optional compiled rounds (pp1wire/q/_fastq.c), qualified by the known answers
    from pp1wire.q import _fastq  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised by tests that disable it
    _fastq = None

ABI_NAME: Final = "pp1-philox4x32-10-v1"

# Philox4x32 (Salmon et al., SC11): the round multipliers, and the Weyl increments
# that bump the key between rounds.
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32: Final = 0xFFFFFFFF
_ROUNDS: Final = 10

U32_MAX: Final = _MASK32
DRAW_LIMIT: Final = 1 << 24
SEED_LIMIT: Final = 1 << 64


class Domain(IntEnum):
    """RNG domains; each has exactly one owning role (see the module docstring)."""

    PROPOSAL = 1
    ACCEPTANCE = 2
    CORRECTION = 3
    TARGET = 4


class Role(IntEnum):
    """A protocol role: the ``role`` of a HELLO, and who may draw in which domain.

    The worker leader owns proposal draws, the Spark side the rest.
    """

    WORKER = 1
    SPARK = 2


OWNED_DOMAINS: Final[dict[Role, frozenset[Domain]]] = {
    Role.WORKER: frozenset({Domain.PROPOSAL}),
    Role.SPARK: frozenset({Domain.ACCEPTANCE, Domain.CORRECTION, Domain.TARGET}),
}


@functools.lru_cache(maxsize=1024)
def _round_keys(k0: int, k1: int) -> tuple[tuple[int, int], ...]:
    """The key of each Philox round: (k0, k1), then bumped by the Weyl constants."""
    keys = []
    for _ in range(_ROUNDS):
        keys.append((k0, k1))
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return tuple(keys)


def philox4x32_10(counter: Iterable[int], key: Iterable[int]) -> tuple[int, int, int, int]:
    """Return the Philox4x32-10 block for a 4-word counter and a 2-word key.

    Raises:
        RngError: ``RNG_FIELD_RANGE`` if there are not exactly four counter words
            and two key words, each in ``[0, 2**32)``.
    """
    c = [int(v) for v in counter]
    k = [int(v) for v in key]
    if len(c) != 4 or len(k) != 2 or any(not 0 <= v <= _MASK32 for v in (*c, *k)):
        raise RngError(ErrorCode.RNG_FIELD_RANGE, "counter needs 4 and key 2 uint32 words")
    if _fastq is not None:  # the same rounds compiled (qualified by the known answers)
        return cast("tuple[int, int, int, int]", _fastq.philox_block(*c, *k))
    c0, c1, c2, c3 = c
    for k0, k1 in _round_keys(k[0], k[1]):
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & _MASK32,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & _MASK32,
        )
    return c0, c1, c2, c3


def philox4x32_10_array(counters: npt.ArrayLike, key: tuple[int, int]) -> npt.NDArray[np.uint32]:
    """Vectorized Philox4x32-10: ``counters`` of shape ``(n, 4)`` → blocks ``(n, 4)``.

    Bit-identical to :func:`philox4x32_10` row by row.

    Raises:
        RngError: ``RNG_FIELD_RANGE`` if the shape is not ``(n, 4)``, a counter
            word is outside ``[0, 2**32)`` or the key is not two uint32 words.
    """
    raw = np.asarray(counters)
    if raw.ndim != 2 or raw.shape[1] != 4:
        raise RngError(ErrorCode.RNG_FIELD_RANGE, f"counters must be (n, 4), got {raw.shape}")
    if raw.size and (raw.min() < 0 or raw.max() > _MASK32):
        raise RngError(ErrorCode.RNG_FIELD_RANGE, "counter word outside uint32")
    if len(key) != 2 or any(not 0 <= int(v) <= _MASK32 for v in key):
        raise RngError(ErrorCode.RNG_FIELD_RANGE, "key needs 2 uint32 words")
    c = raw.astype(np.uint64)
    c0, c1, c2, c3 = (c[:, i].copy() for i in range(4))
    mask = np.uint64(_MASK32)
    shift = np.uint64(32)
    m0 = np.uint64(_M0)
    m1 = np.uint64(_M1)
    for k0, k1 in _round_keys(int(key[0]), int(key[1])):
        # Both factors are below 2**32, so the uint64 product is exact.
        p0 = m0 * c0
        p1 = m1 * c2
        c0, c1, c2, c3 = (
            (p1 >> shift) ^ c1 ^ np.uint64(k0),
            p1 & mask,
            (p0 >> shift) ^ c3 ^ np.uint64(k1),
            p0 & mask,
        )
    return np.stack([c0, c1, c2, c3], axis=1).astype(np.uint32)


def key_for_seed(seed: int) -> tuple[int, int]:
    """Split a 64-bit request seed into the Philox key words.

    Raises:
        RngError: ``RNG_FIELD_RANGE`` if the seed is outside ``[0, 2**64)``.
    """
    if not 0 <= seed < SEED_LIMIT:
        raise RngError(ErrorCode.RNG_FIELD_RANGE, f"seed {seed} outside [0, 2**64)")
    return seed & _MASK32, seed >> 32


def counter_for(
    generation: int, round_id: int, position: int, domain: Domain, draw: int = 0
) -> tuple[int, int, int, int]:
    """Build the Philox counter for one draw (layout in the module docstring).

    Raises:
        RngError: ``RNG_FIELD_RANGE`` if generation, round or position is outside
            ``[0, 2**32)``, the draw counter outside ``[0, 2**24)``, or the domain
            is not a :class:`Domain`.
    """
    for name, value in (("generation", generation), ("round", round_id), ("position", position)):
        if not 0 <= value <= _MASK32:
            raise RngError(ErrorCode.RNG_FIELD_RANGE, f"{name} {value} outside uint32")
    if not 0 <= draw < DRAW_LIMIT:
        raise RngError(ErrorCode.RNG_FIELD_RANGE, f"draw counter {draw} outside [0, 2**24)")
    try:
        dom = Domain(domain)
    except ValueError:
        raise RngError(ErrorCode.RNG_FIELD_RANGE, f"unknown domain {domain}") from None
    return position, round_id, generation, (int(dom) << 24) | draw


def u24_from_block(block: tuple[int, int, int, int]) -> int:
    """The 24-bit draw of a block: ``w0 >> 8``."""
    return block[0] >> 8


def u53_int_from_block(block: tuple[int, int, int, int]) -> int:
    """The 53-bit draw of a block as an integer ``U`` in ``[0, 2**53)``."""
    return ((block[0] >> 5) << 26) | (block[1] >> 6)


def u53_from_block(block: tuple[int, int, int, int]) -> float:
    """The 53-bit uniform ``U / 2**53`` in ``[0, 1)`` of a block (exact in binary64)."""
    return u53_int_from_block(block) / float(1 << 53)


def proposal_u24(seed: int, generation: int, round_id: int, position: int) -> int:
    """The worker's 24-bit PROPOSAL draw at ``position``, recomputed (draws nothing).

    For audits on the Spark side: the value is a pure function of the public
    key and counter, so recomputing it neither consumes a key nor breaks the
    one-owner rule (only drawing under it would).

    Raises:
        RngError: ``RNG_FIELD_RANGE`` for out-of-range fields.
    """
    counter = counter_for(generation, round_id, position, Domain.PROPOSAL)
    return u24_from_block(philox4x32_10(counter, key_for_seed(seed)))


class RoundStreams:
    """The draws one role may make in one (seed, generation, round).

    Enforces the ABI's ownership rules: a role draws only in its own domains,
    and a key (domain, position, draw counter) is never drawn twice, so a retry
    can never silently redraw and pair fresh noise with an old q.
    """

    def __init__(self, role: Role, seed: int, generation: int, round_id: int) -> None:
        """Bind the streams; raises :class:`RngError` for out-of-range fields."""
        self.role = Role(role)
        self.key = key_for_seed(seed)
        counter_for(generation, round_id, 0, Domain.PROPOSAL)  # range check only
        self.seed = seed
        self.generation = generation
        self.round_id = round_id
        self._used: set[tuple[Domain, int, int]] = set()

    def block(self, domain: Domain, position: int, draw: int = 0) -> tuple[int, int, int, int]:
        """Return the Philox block for one key, marking it used.

        Raises:
            RngError: ``WRONG_OWNER`` if this role does not own ``domain``;
                ``KEY_REUSED`` if this key was drawn before; ``RNG_FIELD_RANGE``
                for out-of-range fields.
        """
        if domain not in OWNED_DOMAINS[self.role]:
            raise RngError(ErrorCode.WRONG_OWNER, f"{self.role.name} does not own {domain.name}")
        slot = (domain, position, draw)
        counter = counter_for(self.generation, self.round_id, position, domain, draw)
        if slot in self._used:
            raise RngError(
                ErrorCode.KEY_REUSED,
                f"{domain.name} draw {draw} at position {position} already used this round",
            )
        self._used.add(slot)
        if _fastq is not None:  # the fields were checked by counter_for
            return cast("tuple[int, int, int, int]", _fastq.philox_block(*counter, *self.key))
        return philox4x32_10(counter, self.key)

    def u24(self, domain: Domain, position: int, draw: int = 0) -> int:
        """A fresh 24-bit draw (see :meth:`block` for what it raises)."""
        return u24_from_block(self.block(domain, position, draw))

    def u53_int(self, domain: Domain, position: int, draw: int = 0) -> int:
        """A fresh 53-bit draw as an integer in ``[0, 2**53)`` (see :meth:`block`)."""
        return u53_int_from_block(self.block(domain, position, draw))

    def u53(self, domain: Domain, position: int, draw: int = 0) -> float:
        """A fresh 53-bit uniform in ``[0, 1)`` (see :meth:`block` for what it raises)."""
        return u53_from_block(self.block(domain, position, draw))


def derive_seed(base_seed: int, index: int) -> int:
    """Derive a 64-bit per-request seed from a base seed and a request index.

    SplitMix64 finalizer over ``base_seed + (index + 1) * golden``, so nearby
    indices get unrelated seeds. Deterministic across platforms.

    Raises:
        RngError: ``RNG_FIELD_RANGE`` if either input is negative.
    """
    if base_seed < 0 or index < 0:
        raise RngError(ErrorCode.RNG_FIELD_RANGE, "seed and index must be non-negative")
    mask = (1 << 64) - 1
    z = (base_seed + (index + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)
