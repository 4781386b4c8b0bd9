"""Byte-budgeted LRU bookkeeping shared by every tier (the tier stores the bytes)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator


class LRUIndex:
    """key -> size in least- to most-recently-used order, with a byte budget."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._sizes: OrderedDict[bytes, int] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._sizes)

    def fits(self, size: int) -> bool:
        return size <= self.capacity

    def touch(self, key: bytes) -> None:
        self._sizes.move_to_end(key)

    def add(self, key: bytes, size: int) -> None:
        """Record a new entry; the caller has made room (see victims)."""
        if key in self._sizes:
            raise KeyError("already indexed")
        if self.used + size > self.capacity:
            raise ValueError(f"adding {size} bytes would exceed the {self.capacity}-byte budget")
        self._sizes[key] = size
        self.used += size

    def discard(self, key: bytes) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.used -= size
        return True

    def victims(self, size: int) -> list[bytes]:
        """Least-recently-used keys to remove so that `size` more bytes fit."""
        out, free = [], self.capacity - self.used
        for key, entry in self._sizes.items():
            if free >= size:
                break
            out.append(key)
            free += entry
        return out

    def fill(self, entries: Iterable[tuple[bytes, int]], delete: Callable[[bytes], None]) -> None:
        """Index entries found on start (oldest first), calling `delete` for those over the budget."""
        for key, size in entries:
            if not self.fits(size):
                delete(key)
                continue
            for victim in self.victims(size):
                self.discard(victim)
                delete(victim)
            self.add(key, size)
