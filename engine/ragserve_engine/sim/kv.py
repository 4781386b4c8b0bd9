"""The sim's paged-KV model: the engine's BlockPool (LRU eviction of unreferenced blocks, BlockStored /
BlockRemoved events) keyed by ragserve.keys' chained block hashes, as KVCacheManager keys the real engine's."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragserve.keys import KVLayout, block_hashes, cacheable_blocks, root_hash
from ragserve.prefix_hashes import prefix_block_hashes
from ragserve_engine.block_pool import BlockPool, KVCacheBlock, KVCacheBlocks


@dataclass
class SimSeq:
    """One request's KV: its tokens (prompt, then generated), hashes of its full blocks, blocks held."""

    token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None
    hashes: list[bytes] = field(default_factory=list)
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens hit in the prefix cache at admission
    num_cached_blocks: int = 0  # blocks registered under their hash so far


class SimKV:
    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.block_size = layout.block_size
        self.root = root_hash(layout.model_id)
        self.pool = BlockPool(num_blocks)
        self.pool.record_events = True
        self.queries = 0  # prompt tokens looked up, and found (vllm:prefix_cache_queries / _hits)
        self.hits = 0

    def hash_blocks(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        return prefix_block_hashes(token_ids, self.block_size, self.root, cache_salt)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, hashes: list[bytes]) -> list[KVCacheBlock]:
        hits = []
        for h in hashes:
            if (block := self.pool.get_cached_block(h)) is None:
                break
            hits.append(block)
        return hits

    def pin(self, hashes: list[bytes]) -> KVCacheBlocks:
        """Hold the cached prefix of `hashes` so eviction skips it (warm-up), as KVCacheManager.pin does."""
        blocks = self.cached_prefix(hashes)
        self.pool.touch(blocks)
        return KVCacheBlocks(blocks)

    def admit(self, seq: SimSeq, num_tokens: int) -> bool:
        """Hit the longest cached prefix (never the last prompt token) and reserve blocks for num_tokens; False
        (nothing taken) when the pool is short."""
        if not seq.hashes:
            seq.hashes = self.hash_blocks(seq.token_ids, seq.cache_salt)
        hits = self.cached_prefix(seq.hashes[: cacheable_blocks(seq.num_prompt_tokens, self.block_size)])
        reclaimed = sum(1 for b in hits if b.ref_cnt == 0)  # hits taken out of the free queue
        fresh = self.blocks_needed(num_tokens) - len(hits)
        if fresh > self.pool.num_free_blocks - reclaimed:
            return False
        self.pool.touch(hits)
        seq.blocks = hits + self.pool.get_new_blocks(fresh)
        seq.num_cached_tokens = seq.num_cached_blocks = len(hits)
        seq.num_cached_tokens *= self.block_size
        self.queries += seq.num_prompt_tokens
        self.hits += seq.num_cached_tokens
        return True

    def cache(self, seq: SimSeq, num_computed: int) -> None:
        """Register the full blocks whose tokens are all computed (prompt, then generated) under their hashes."""
        bs = self.block_size
        full = min(num_computed, len(seq.token_ids)) // bs
        if full > len(seq.hashes):
            parent = seq.hashes[-1] if seq.hashes else None
            start = len(seq.hashes)
            seq.hashes += block_hashes(seq.token_ids, bs, self.root, seq.cache_salt, start, parent)
        for i in range(seq.num_cached_blocks, min(full, len(seq.blocks))):
            parent = seq.hashes[i - 1] if i else None
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            self.pool.cache_full_block(seq.blocks[i], seq.hashes[i], parent, tokens, seq.cache_salt)
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def free(self, seq: SimSeq) -> None:
        self.pool.free_blocks(list(reversed(seq.blocks)))
        seq.blocks = []
