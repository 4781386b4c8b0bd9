"""BlockPool: KV blocks with ref counts, a hash → block map for full blocks, and an LRU free queue.

Freed blocks keep their hash (and stay hittable) until they are reused; the free queue
hands out the least recently freed block first, and removes a hit block in O(1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: popleft for allocation, O(1) remove for hits."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


@dataclass
class KVCacheBlocks:
    """Blocks one call handed out: the new blocks of an allocation, or a pinned prefix."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass
class KVSnapshot:
    """Every cached block hash, and how many pool events are not yet taken (the snapshot covers them)."""

    block_hashes: list[bytes]
    num_pending_events: int


@dataclass
class KVEvent:
    kind: str  # "stored" | "removed" | "cleared"
    block_hashes: list[bytes] = field(default_factory=list)
    parent_hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)  # stored: the blocks' tokens, block_size each
    cache_salt: str | None = None  # stored: the salt in the first block's hash (a chain's block 0 only)
    chunk: bool = False  # a blend chunk key held outside the pool, not a prefix block


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, external_keys: Callable[[], list[bytes]] = list
    ) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.enable_caching = enable_caching
        self.events: list[KVEvent] = []
        self.record_events = False  # turned on by whoever publishes them
        self.external_keys = external_keys  # keys held outside the pool (blend chunks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self._event(KVEvent("removed", [block.block_hash]))
        block.block_hash = None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each, in the given order (callers pass tail first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(
        self,
        block: KVCacheBlock,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: list[int] = (),
        cache_salt: str | None = None,
    ) -> None:
        """`token_ids`: the block's tokens; `cache_salt`: the request's (only block 0's hash includes it)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # computed twice concurrently: keep the first copy
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        salt = cache_salt if parent_hash is None else None
        self._event(KVEvent("stored", [block_hash], parent_hash, list(token_ids), salt or None))

    def reset_prefix_cache(self) -> bool:
        """Forget all hashes; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self._event(KVEvent("cleared"))
        for key in self.external_keys():  # still held: the router must not forget them
            self._event(KVEvent("stored", [key], chunk=True))
        return True

    def _event(self, event: KVEvent) -> None:
        if self.record_events:
            self.events.append(event)

    def external_event(self, event: KVEvent) -> None:
        """A key held outside the pool was stored or removed: published in order with the pool's events."""
        self._event(event)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot([*self.cached, *self.external_keys()], len(self.events))
