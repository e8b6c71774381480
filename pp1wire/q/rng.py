"""The pp1wire RNG ABI ``pp1-philox4x32-10-v1`` (``docs/protocol.md`` §6.3): one Philox4x32-10
block per draw, keyed by the request seed, the counter (position, round, generation,
domain << 24 | draw); each domain has one owning role.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from enum import IntEnum
from typing import Final, cast

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

DRAW_LIMIT: Final = 1 << 24
SEED_LIMIT: Final = 1 << 64


class Domain(IntEnum):
    """RNG domains; each has exactly one owning role (:data:`OWNED_DOMAINS`)."""

    PROPOSAL = 1
    ACCEPTANCE = 2
    CORRECTION = 3
    TARGET = 4


class Role(IntEnum):
    """A protocol role: the ``role`` of a HELLO, and who may draw in which domain."""

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
    """The Philox counter for one draw: (position, round, generation, domain << 24 | draw).

    Raises:
        RngError: ``RNG_FIELD_RANGE`` if generation, round or position is outside ``[0, 2**32)``,
            the draw counter outside ``[0, 2**24)``, or the domain is not a :class:`Domain`.
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


def proposal_u24(seed: int, generation: int, round_id: int, position: int) -> int:
    """The worker's 24-bit PROPOSAL draw at ``position``, recomputed for an audit: a pure
    function of the key, so it consumes no key and breaks no ownership rule.

    Raises:
        RngError: ``RNG_FIELD_RANGE`` for out-of-range fields.
    """
    counter = counter_for(generation, round_id, position, Domain.PROPOSAL)
    return u24_from_block(philox4x32_10(counter, key_for_seed(seed)))


class RoundStreams:
    """The draws one role may make in one (seed, generation, round): only in its own domains, and
    never a key (domain, position, draw) twice, so a retry cannot pair fresh noise with an old q."""

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
            RngError: ``WRONG_OWNER`` if this role does not own ``domain``; ``KEY_REUSED`` if this
                key was drawn before; ``RNG_FIELD_RANGE`` for out-of-range fields.
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


def derive_seed(base_seed: int, index: int) -> int:
    """A 64-bit per-request seed: output ``index`` of SplitMix64 started at ``base_seed``.

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
