"""The canonical pairwise tree over global token positions (``docs/protocol.md`` §6.6): its
total and the descent that draws from it, the same for any split of the vocabulary into
shards (each computes its maximal aligned nodes alone, :func:`cover`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

try:  # the optional compiled total (pp1wire/q/_fastq.c), qualified bit for bit against levels()
    from pp1wire.q import _fastq  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised by tests that disable it
    _fastq = None

Float64Array = npt.NDArray[np.float64]
Node = tuple[int, int]  # (level, index)


def depth_for(size: int) -> int:
    """``L``: the least ``L`` with ``2**L >= size`` (0 for sizes 0 and 1)."""
    return max(0, (size - 1).bit_length())


def levels(values: npt.ArrayLike, depth: int | None = None) -> list[Float64Array]:
    """Every level of the canonical tree over ``values`` (level 0 padded), root last.

    ``depth`` pads to ``2**depth`` entries instead of the least power of two.

    Raises:
        ValueError: if ``values`` is not 1-D or longer than ``2**depth``.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError("values must be 1-D")
    depth = depth_for(x.size) if depth is None else depth
    size = 1 << depth
    if x.size > size:
        raise ValueError(f"{x.size} values do not fit a tree of depth {depth}")
    level = np.zeros(size, dtype=np.float64)
    level[: x.size] = x
    out = [level]
    while level.size > 1:
        level = level[0::2] + level[1::2]
        out.append(level)
    return out


def total(values: npt.ArrayLike) -> float:
    """The canonical total: the root of the tree over ``values`` (0.0 if empty)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return 0.0
    if _fastq is not None and x.ndim == 1 and x.flags.c_contiguous:
        return float(_fastq.tree_total(x))
    return float(levels(x)[-1][0])


def step(a: float, b: float, t: float) -> tuple[bool, float]:
    """One descent decision: (go right?, the target in the chosen child)."""
    if b > 0.0 and (a == 0.0 or t >= a):
        return True, t - a
    return False, t


def descend(tree: list[Float64Array], t: float) -> int:
    """The leaf index a descent with target ``t`` reaches (the root must be positive).

    Raises:
        ValueError: if the tree's total is not positive.
    """
    if not tree[-1][0] > 0.0:
        raise ValueError("the tree has no mass")
    index = 0
    for level in range(len(tree) - 1, 0, -1):
        below = tree[level - 1]
        right, t = step(float(below[2 * index]), float(below[2 * index + 1]), t)
        index = 2 * index + int(right)
    return index


def cover(start: int, stop: int, depth: int) -> list[Node]:
    """The maximal aligned nodes exactly covering positions ``[start, stop)``, left to right."""
    out: list[Node] = []
    pos = start
    while pos < stop:
        level = 0
        # Grow while the node stays aligned and inside the range.
        while level < depth and pos % (2 << level) == 0 and pos + (2 << level) <= stop:
            level += 1
        out.append((level, pos >> level))
        pos += 1 << level
    return out


@dataclass
class ShardedTree:
    """The canonical tree over a vocabulary split into contiguous shards: ``local`` each
    shard's subtrees (one per cover node), ``upper`` the nodes above them; :attr:`total`
    and :meth:`descend` equal :func:`total` and :func:`descend` of the concatenation.
    """

    depth: int
    owner: dict[Node, tuple[int, int]]  # cover node -> (shard, offset of its block)
    local: list[dict[Node, list[Float64Array]]]
    upper: dict[Node, float]

    @classmethod
    def build(cls, shards: Sequence[npt.ArrayLike]) -> ShardedTree:
        """Each shard's cover-node subtrees (the last owns the zero padding), then the nodes
        above them."""
        pieces = [np.asarray(s, dtype=np.float64) for s in shards]
        size = sum(p.size for p in pieces)
        depth = depth_for(size)
        padded = 1 << depth
        owner: dict[Node, tuple[int, int]] = {}
        local: list[dict[Node, list[Float64Array]]] = []
        upper: dict[Node, float] = {}
        start = 0
        for r, piece in enumerate(pieces):
            stop = start + piece.size if r < len(pieces) - 1 else padded
            trees: dict[Node, list[Float64Array]] = {}
            for level, index in cover(start, stop, depth):
                first = (index << level) - start
                block = piece[first : first + (1 << level)]
                trees[(level, index)] = levels(block, level)
                owner[(level, index)] = (r, first)
                upper[(level, index)] = float(trees[(level, index)][-1][0])
            local.append(trees)
            start = stop
        # Complete the tree: a node whose two children are known is their sum.
        for level in range(depth):
            for index in sorted(i for (lv, i) in list(upper) if lv == level):
                parent = (level + 1, index >> 1)
                if parent in upper or index & 1:
                    continue
                left, right = upper[(level, index)], upper.get((level, index + 1))
                if right is not None:
                    upper[parent] = left + right
        return cls(depth, owner, local, upper)

    @property
    def total(self) -> float:
        """The canonical total of the whole vector."""
        return self.upper[(self.depth, 0)]

    def descend(self, t: float) -> int:
        """The global index a descent with target ``t`` reaches.

        Raises:
            ValueError: if the total is not positive.
        """
        if not self.total > 0.0:
            raise ValueError("the tree has no mass")
        level, index = self.depth, 0
        while (level, index) not in self.owner:
            right, t = step(
                self.upper[(level - 1, 2 * index)], self.upper[(level - 1, 2 * index + 1)], t
            )
            level, index = level - 1, 2 * index + int(right)
        shard, _ = self.owner[(level, index)]
        sub = self.local[shard][(level, index)]
        return (index << level) + descend(sub, t)
