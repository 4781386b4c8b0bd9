"""The engine's chunk KV store: content key -> K/V computed at the canonical position, LRU within a byte budget.

Each key stored or evicted is told to `listener` as a KV event (the engine passes them on with its block
events, so the router's exact index knows where chunks live).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ragserve_engine.block_pool import KVEvent


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class ChunkStore:
    def __init__(self, capacity_bytes: int, listener: Callable[[KVEvent], None] | None = None) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.stats = StoreStats()
        self.listener = listener

    def get(self, key: bytes) -> torch.Tensor | None:
        kv = self.entries.get(key)
        if kv is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.entries.move_to_end(key)
        return kv

    def put(self, key: bytes, kv: torch.Tensor) -> bool:
        """Store kv ([num_layers, 2, n, kvh, d]); False if it alone exceeds the budget."""
        size = _nbytes(kv)
        if size > self.capacity:
            return False
        known = key in self.entries
        if known:
            self.used -= _nbytes(self.entries.pop(key))
        while self.used + size > self.capacity:
            old_key, old = self.entries.popitem(last=False)
            self.used -= _nbytes(old)
            self.stats.evictions += 1
            self._tell(KVEvent("removed", [old_key], chunk=True))
        self.entries[key] = kv
        self.used += size
        if not known:
            self._tell(KVEvent("stored", [key], chunk=True))
        return True

    def _tell(self, event: KVEvent) -> None:
        if self.listener is not None:
            self.listener(event)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
