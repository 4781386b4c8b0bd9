"""RAM tier: blocks as Python bytes, verified on arrival, LRU within a byte budget."""

from __future__ import annotations

from ragserve.v1 import cachestore_pb2 as pb
from ragserve_cachestore.lru import LRUIndex
from ragserve_cachestore.record import StoredBlock


class MemoryTier:
    kind = pb.TIER_MEMORY
    name = "memory"

    def __init__(self, capacity: int) -> None:
        self.index = LRUIndex(capacity)
        self._blocks: dict[bytes, StoredBlock] = {}

    def read(self, key: bytes) -> StoredBlock:
        return self._blocks[key]

    def write(self, key: bytes, block: StoredBlock) -> bool:
        self.index.add(key, block.size)
        self._blocks[key] = block
        return True

    def remove(self, key: bytes) -> None:
        self.index.discard(key)
        self._blocks.pop(key, None)
