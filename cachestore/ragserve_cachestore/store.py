"""TieredStore: RAM -> disk -> Redis. Demote on eviction, promote (copy up) on hit.

Blocks are immutable (content-addressed), so a promoted block keeps its lower-tier
copy and a later eviction from RAM needs no rewrite. A block leaves the store only
when the last tier holding it evicts it. Keys are store keys (layout + hash).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from ragserve_cachestore.record import CorruptRecord, StoredBlock
from ragserve_cachestore.tiers import Tier, TierError

log = logging.getLogger(__name__)


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0


@dataclass
class StoreCounters:
    lookups: int = 0  # Lookup calls
    hits: int = 0  # blocks found by Lookup or Get
    misses: int = 0  # Lookup/Get calls that stopped at a missing block
    puts: int = 0  # blocks stored
    skipped: int = 0  # blocks already present or larger than every tier
    dropped: int = 0  # blocks evicted from the last tier holding them


@dataclass(frozen=True)
class TierSnapshot:
    kind: int
    name: str
    used: int
    capacity: int
    blocks: int
    counters: TierCounters


@dataclass(frozen=True)
class StoreSnapshot:
    tiers: list[TierSnapshot]
    counters: StoreCounters = field(default_factory=StoreCounters)


class TieredStore:
    def __init__(self, tiers: list[Tier]) -> None:
        self.tiers = tiers
        self.counters = StoreCounters()
        self.tier_counters = [TierCounters() for _ in tiers]
        self._lock = threading.Lock()

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Tier kinds of the longest stored prefix of `keys` (index only, no reads)."""
        found = []
        with self._lock:
            self.counters.lookups += 1
            for key in keys:
                kind = next((t.kind for t in self.tiers if key in t.index), None)
                if kind is None:
                    self.counters.misses += 1
                    break
                found.append(kind)
            self.counters.hits += len(found)
        return found

    def get(self, key: bytes) -> tuple[StoredBlock, int] | None:
        """The block and the tier kind it came from; verified; promoted to RAM."""
        with self._lock:
            for level, tier in enumerate(self.tiers):
                if key not in tier.index:
                    self.tier_counters[level].misses += 1
                    continue
                block = self._read(level, key)
                if block is None:
                    continue
                tier.index.touch(key)
                self.tier_counters[level].hits += 1
                self.counters.hits += 1
                if level > 0:
                    self._insert(0, key, block)
                return block, tier.kind
            self.counters.misses += 1
            return None

    def put(self, key: bytes, block: StoredBlock) -> bool:
        with self._lock:
            if any(key in t.index for t in self.tiers) or not self._insert(0, key, block):
                self.counters.skipped += 1
                return False
            self.counters.puts += 1
            return True

    def touch_chain(self, keys: list[bytes]) -> None:
        """Mark a chain used head-last, so that its head is evicted after its tail (a tail is useless alone)."""
        with self._lock:
            for key in reversed(keys):
                for tier in self.tiers:
                    if key in tier.index:
                        tier.index.touch(key)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            present = [t for t in self.tiers if key in t.index]
            for tier in present:
                tier.remove(key)
            return bool(present)

    def snapshot(self) -> StoreSnapshot:
        with self._lock:
            tiers = [
                TierSnapshot(t.kind, t.name, t.index.used, t.index.capacity, len(t.index), TierCounters(**vars(c)))
                for t, c in zip(self.tiers, self.tier_counters, strict=True)
            ]
            return StoreSnapshot(tiers, StoreCounters(**vars(self.counters)))

    def _insert(self, level: int, key: bytes, block: StoredBlock) -> bool:
        """Store at `level` or, if it cannot take the block, the next tier down."""
        if level >= len(self.tiers):
            return False
        tier = self.tiers[level]
        if key in tier.index:
            tier.index.touch(key)
            return True
        if not tier.index.fits(block.size):
            return self._insert(level + 1, key, block)
        for victim in tier.index.victims(block.size):
            self._evict(level, victim)
        return tier.write(key, block) or self._insert(level + 1, key, block)

    def _evict(self, level: int, key: bytes) -> None:
        """Remove from `level`; demote if no other tier holds a copy."""
        self.tier_counters[level].evictions += 1
        if any(key in t.index for i, t in enumerate(self.tiers) if i != level):
            self.tiers[level].remove(key)
            return
        block = self._read(level, key) if level + 1 < len(self.tiers) else None
        self.tiers[level].remove(key)
        if block is None or not self._insert(level + 1, key, block):
            self.counters.dropped += 1

    def _read(self, level: int, key: bytes) -> StoredBlock | None:
        tier = self.tiers[level]
        try:
            return tier.read(key)
        except KeyError:
            tier.index.discard(key)  # deleted behind our back
        except CorruptRecord as exc:
            log.warning("%s tier: corrupt block %s dropped: %s", tier.name, key.hex(), exc)
            self.tier_counters[level].corrupt += 1
            tier.remove(key)
        except TierError as exc:
            log.warning("%s tier: %s", tier.name, exc)
        return None
