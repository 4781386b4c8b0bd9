"""Storage tiers: RAM, local disk, Redis. Each keeps an LRUIndex and the bytes; TieredStore moves blocks between them.

The interface every tier implements:
    kind: int                      # ragserve.v1.cachestore_pb2.Tier value
    name: str                      # metric label: memory | disk | redis
    index: LRUIndex                # what is stored, in LRU order, with the byte budget
    read(key) -> StoredBlock       # KeyError: gone; CorruptRecord: bad bytes; TierError: tier unavailable
    write(key, block) -> bool      # caller made room; False when the bytes could not be written
    remove(key) -> None            # forget and delete (best effort)
"""

from __future__ import annotations

from typing import Protocol

from ragserve_cachestore.lru import LRUIndex
from ragserve_cachestore.record import StoredBlock


class TierError(Exception):
    """The tier cannot serve right now (I/O error, Redis down): a miss, not a crash."""


class Tier(Protocol):
    kind: int
    name: str
    index: LRUIndex

    def read(self, key: bytes) -> StoredBlock: ...

    def write(self, key: bytes, block: StoredBlock) -> bool: ...

    def remove(self, key: bytes) -> None: ...
