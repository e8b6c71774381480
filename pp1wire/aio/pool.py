"""Receive buffers of one size, allocated once and recycled by the client."""

from __future__ import annotations


class BufferPool:
    """Receive buffers of one size, allocated once and recycled.

    A frame larger than the pool's buffers, or one arriving while every buffer
    is in use, gets a fresh allocation (counted in :attr:`misses`) rather than
    waiting: correctness never depends on the pool.
    """

    def __init__(self, size: int, count: int) -> None:
        """Allocate ``count`` buffers of ``size`` bytes."""
        self.size = size
        # The pool keeps every buffer alive, so an id() it knows can never be
        # reused by an unrelated object handed to release().
        self._buffers = [bytearray(size) for _ in range(count)]
        self._free = list(self._buffers)
        self._owned = {id(b) for b in self._buffers}
        self._free_ids = set(self._owned)
        self.misses = 0

    def acquire(self, nbytes: int) -> memoryview:
        """A writable buffer of at least ``nbytes``."""
        if nbytes <= self.size and self._free:
            buf = self._free.pop()
            self._free_ids.discard(id(buf))
            return memoryview(buf)
        self.misses += 1
        return memoryview(bytearray(nbytes))

    def release(self, view: memoryview) -> None:
        """Return the buffer behind ``view`` (ignores buffers the pool does not own)."""
        obj = view.obj
        if isinstance(obj, bytearray) and id(obj) in self._owned and id(obj) not in self._free_ids:
            self._free.append(obj)
            self._free_ids.add(id(obj))

    @property
    def free(self) -> int:
        """Buffers currently available."""
        return len(self._free)


__all__ = ["BufferPool"]
