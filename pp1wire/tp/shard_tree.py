"""The canonical tree of ``docs/protocol.md`` §6.6 over a vocabulary split into ranks.

Each rank owns the maximal aligned nodes inside its range (its cover); the layout is
static, so :class:`TreePlan` knows every rank's cover and the additions above them.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt

from pp1wire.q import tree
from pp1wire.q.layout import ShardLayout
from pp1wire.tp.coordinator import GroupCoordinator

Float64Array = npt.NDArray[np.float64]
Node = tuple[int, int]


class TreePlan:
    """Where each rank's cover nodes sit in the canonical tree (§6.6), and the additions
    that complete the tree above them, in the order every rank performs them."""

    def __init__(self, layout: ShardLayout, rank: int) -> None:
        """The plan of ``layout`` seen from ``rank``.

        Raises:
            ValueError: if ``rank`` is not a rank of the layout.
        """
        self.start, self.stop = layout.range(rank)
        self.rank = rank
        self.world = layout.shards
        self.vocab = layout.vocab_size
        self.depth = tree.depth_for(self.vocab)
        padded = 1 << self.depth
        self.covers: list[list[Node]] = []
        for r in range(layout.shards):
            lo, hi = layout.range(r)
            self.covers.append(tree.cover(lo, hi if r < layout.shards - 1 else padded, self.depth))
        self.slots = max(1, *(len(c) for c in self.covers))
        self.owner: dict[Node, int] = {n: r for r, c in enumerate(self.covers) for n in c}
        # The nodes above the covers, each the sum of two known children (as
        # tree.ShardedTree.build adds them: level by level, left to right, a parent
        # once both of its children are known).
        known = set(self.owner)
        self.additions: list[tuple[Node, Node, Node]] = []
        for level in range(self.depth):
            for index in sorted(i for (lv, i) in known if lv == level):
                parent = (level + 1, index >> 1)
                if index & 1 or parent in known or (level, index + 1) not in known:
                    continue
                self.additions.append((parent, (level, index), (level, index + 1)))
                known.add(parent)
        self.root: Node = (self.depth, 0)

    def block(self, node: Node) -> tuple[int, int]:
        """``(first, size)``: a cover node of this rank as a slice of its shard (the
        last rank's blocks may reach past its data into the zero padding)."""
        level, index = node
        return (index << level) - self.start, 1 << level

    def cover_totals(self, values: Float64Array) -> Float64Array:
        """``[rows, slots]``: each of this rank's cover nodes' canonical total, per row."""
        rows = values.shape[0]
        out = np.zeros((rows, self.slots), dtype=np.float64)
        n = values.shape[1]
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is the caller's code
            for j, node in enumerate(self.covers[self.rank]):
                first, size = self.block(node)
                stop = min(first + size, n)
                for r in range(rows):
                    out[r, j] = tree.total(values[r, first:stop])
        return out

    def totals(self, gathered: Float64Array) -> dict[Node, Float64Array]:
        """Every node of the tree the ranks share, per row, from ``[world, rows, slots]``."""
        upper: dict[Node, Float64Array] = {}
        for r, nodes in enumerate(self.covers):
            for j, node in enumerate(nodes):
                upper[node] = gathered[r, :, j]
        for parent, left, right in self.additions:
            upper[parent] = upper[left] + upper[right]
        return upper

    def descend_upper(
        self, upper: dict[Node, Float64Array], row: int, t: float
    ) -> tuple[Node, float]:
        """The cover node a descent with target ``t`` reaches in ``row``, and the target there."""
        level, index = self.root
        while (level, index) not in self.owner:
            a = float(upper[(level - 1, 2 * index)][row])
            b = float(upper[(level - 1, 2 * index + 1)][row])
            right, t = tree.step(a, b, t)
            level, index = level - 1, 2 * index + int(right)
        return (level, index), t

    def descend_local(self, values: Float64Array, node: Node, t: float) -> int:
        """The global index a descent with target ``t`` reaches inside this rank's ``node``."""
        first, size = self.block(node)
        level = node[0]
        block = values[first : min(first + size, values.size)]
        return (node[1] << level) + tree.descend(tree.levels(block, level), t)


@lru_cache(maxsize=16)
def _plan(layout: ShardLayout, rank: int) -> TreePlan:
    return TreePlan(layout, rank)


def plan_of(coord: GroupCoordinator) -> TreePlan:
    """The coordinator's tree plan (cached per layout and rank).

    Raises:
        ValueError: if the coordinator has no vocabulary layout.
    """
    if coord.layout is None:
        raise ValueError("the sharded kernels need a coordinator with a vocabulary layout")
    return _plan(coord.layout, coord.rank)


__all__ = ["Node", "TreePlan", "plan_of"]
