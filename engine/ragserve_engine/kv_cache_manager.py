"""KVCacheManager: prefix-cache hits, slot allocation with copy-on-write, freeing, forks, swap, imports.

Block ref counts and the free queue change only here and in BlockPool; the scheduler and the
cachestore connector ask through these methods. Hit/query counters are in tokens, like vLLM's
prefix_cache_queries / prefix_cache_hits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from ragserve.keys import KVLayout, block_hashes, cacheable_blocks, root_hash
from ragserve.prefix_hashes import prefix_block_hashes
from ragserve_engine.block_pool import BlockPool, KVCacheBlock, KVCacheBlocks
from ragserve_engine.sequence import Sequence

__all__ = ["KVCacheBlocks", "KVCacheManager"]  # KVCacheBlocks lives in block_pool (torch-free: the sim engine's too)


@dataclass
class CacheStats:
    queries: int = 0
    hits: int = 0


@dataclass
class SwapPool:
    """Host-memory block slots for swap preemption (ids index the host KV tensor), with counters:
    groups swapped out and in, and swap-outs that found too few free slots (the scheduler then recomputes)."""

    num_blocks: int
    free: list[int] = field(default_factory=list)
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_fallbacks: int = 0

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def release(self, host_ids: list[int]) -> None:
        self.free += host_ids


class KVCacheManager:
    def __init__(self, pool: BlockPool, layout: KVLayout, num_swap_blocks: int = 0) -> None:
        """`layout`: the engine's KV layout, the one holder of its block size (and model id: the hash root)."""
        self.pool = pool
        self.layout = layout
        self.root = root_hash(layout.model_id)
        self.stats = CacheStats()
        self.swap = SwapPool(num_swap_blocks)
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next step
        self.on_hits: Callable[[list[KVCacheBlock]], None] | None = None  # told the prefix hits each admission takes

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    # ---- prefix cache -------------------------------------------------------------------------
    def hash_blocks(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """Chained hashes of the full blocks of token_ids (the cache keys they would have)."""
        return prefix_block_hashes(token_ids, self.block_size, self.root, cache_salt)

    def update_hashes(self, seq: Sequence, cache_salt: str | None) -> list[bytes]:
        """Extend seq.block_hashes over its full blocks."""
        start = len(seq.block_hashes)
        if not start:  # a prompt: its prefix's hashes may be kept (prefix_hashes.py)
            seq.block_hashes += self.hash_blocks(seq.token_ids, cache_salt)
        elif (seq.num_tokens // self.block_size) > start:
            parent = seq.block_hashes[-1]
            seq.block_hashes += block_hashes(seq.token_ids, self.block_size, self.root, cache_salt, start, parent)
        return seq.block_hashes

    def get_computed_blocks(self, seq: Sequence, cache_salt: str | None) -> list[KVCacheBlock]:
        """Longest cached chain of full blocks; the last token is always left to compute."""
        hashes = self.update_hashes(seq, cache_salt)
        return self._cached_prefix(hashes[: cacheable_blocks(seq.num_tokens, self.block_size)])

    def _cached_prefix(self, hashes: list[bytes]) -> list[KVCacheBlock]:
        hits = []
        for h in hashes:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def cache_blocks(self, seq: Sequence, cache_salt: str | None) -> list[tuple[KVCacheBlock, bytes]]:
        """Register blocks whose tokens are all computed under their chained hash; returns the new ones."""
        hashes = self.update_hashes(seq, cache_salt)
        num_full = min(seq.num_computed_tokens // self.block_size, len(hashes), len(seq.blocks))
        new = []
        bs = self.block_size
        for i in range(num_full):
            block = seq.blocks[i]
            if block.block_hash is None:
                tokens = seq.token_ids[i * bs : (i + 1) * bs]
                self.pool.cache_full_block(block, hashes[i], hashes[i - 1] if i else None, tokens, cache_salt)
                if block.block_hash is not None:
                    new.append((block, hashes[i]))
        return new

    def num_importable_blocks(self, keep: list[bytes] | None = None) -> int:
        """Blocks an import may fill now without evicting the cached prefix of `keep` (the prefix the import
        extends); one stays free for the admission that follows."""
        kept = sum(1 for block in self._cached_prefix(keep or []) if block.ref_cnt == 0)
        return max(0, self.pool.num_free_blocks - 1 - kept)

    def next_free_block_ids(self, n: int) -> list[int]:
        """The blocks the next n new blocks are taken from (the free queue's head), as they stand now."""
        return [block.block_id for block in itertools.islice(self.pool.free_queue, n)]

    def import_blocks(
        self,
        hashes: list[bytes],
        parent: bytes | None,
        write: Callable[[int, int], None],
        token_ids: list[int] = (),
        cache_salt: str | None = None,
    ) -> None:
        """Cache blocks computed elsewhere: write(i, block_id) fills the block cached under hashes[i].

        `hashes` continue the chain after `parent`; the blocks end free but cached, so admission hits them.
        `token_ids`: the imported blocks' tokens (block_size each, for the KV events), `cache_salt` the request's.
        """
        blocks = self.pool.get_new_blocks(len(hashes))
        bs = self.block_size
        for i, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
            write(i, block.block_id)
            self.pool.cache_full_block(block, block_hash, parent, token_ids[i * bs : (i + 1) * bs], cache_salt)
            parent = block_hash
        self.pool.free_blocks(list(reversed(blocks)))

    def pin(self, hashes: list[bytes]) -> KVCacheBlocks:
        """Hold a reference on the cached prefix of `hashes` so eviction skips it (warm-up)."""
        blocks = self._cached_prefix(hashes)
        self.pool.touch(blocks)
        return KVCacheBlocks(blocks)

    def unpin(self, pinned: KVCacheBlocks) -> None:
        self.pool.free_blocks(list(reversed(pinned.blocks)))

    # ---- slots --------------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        total = -(-(seq.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens) // self.block_size)
        cow = 1 if self._needs_cow(seq) else 0
        return max(0, total - len(seq.blocks) - num_hit_blocks) + cow

    def can_allocate(self, num_blocks: int, hits: list[KVCacheBlock] = ()) -> bool:
        reclaimed = sum(1 for b in hits if b.ref_cnt == 0)  # hits taken out of the free queue
        return num_blocks <= self.pool.num_free_blocks - reclaimed

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hits: list[KVCacheBlock] = ()) -> KVCacheBlocks | None:
        """Reserve blocks so `num_new_tokens` more tokens can be written; None if the pool is short."""
        needed = self.num_blocks_needed(seq, num_new_tokens, len(hits))
        if not self.can_allocate(needed, hits):
            return None
        if hits:
            self.pool.touch(list(hits))
            seq.blocks += hits
            seq.num_computed_tokens += len(hits) * self.block_size
            if self.on_hits is not None:
                self.on_hits(hits)
        new = []
        if self._needs_cow(seq):
            new.append(self._copy_on_write(seq))
            needed -= 1
        fresh = self.pool.get_new_blocks(needed)
        seq.blocks += fresh
        return KVCacheBlocks(new + fresh)

    def _needs_cow(self, seq: Sequence) -> bool:
        """The next token lands in a partially filled block that another sequence also holds."""
        if seq.num_computed_tokens % self.block_size == 0 or not seq.blocks:
            return False
        idx = seq.num_computed_tokens // self.block_size
        return idx < len(seq.blocks) and seq.blocks[idx].ref_cnt > 1

    def _copy_on_write(self, seq: Sequence) -> KVCacheBlock:
        idx = seq.num_computed_tokens // self.block_size
        old = seq.blocks[idx]
        (new,) = self.pool.get_new_blocks(1)
        self.pending_copies.append((old.block_id, new.block_id))
        self.pool.free_blocks([old])
        seq.blocks[idx] = new
        return new

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) pairs the next step must copy before it writes."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- sharing and freeing ------------------------------------------------------------------
    def fork(self, parent: Sequence) -> Sequence:
        child = parent.fork()
        self.pool.touch(child.blocks)
        return child

    def free(self, seq: Sequence) -> None:
        self.pool.free_blocks(list(reversed(seq.blocks)))
        seq.blocks = []

    def free_seqs(self, seqs: list[Sequence]) -> None:
        """Release everything finished sequences hold: host swap slots, then device blocks."""
        self.swap.release(list(dict.fromkeys(h for seq in seqs for h in seq.swapped_table)))
        for seq in seqs:
            seq.swapped_table = []
            if seq.blocks:
                self.free(seq)

    # ---- swap ---------------------------------------------------------------------------------
    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """Move the blocks of a group to host slots; returns (device, host) pairs or None if full."""
        unique = list({b.block_id: b for s in seqs for b in s.blocks}.values())
        if len(unique) > len(self.swap.free):
            self.swap.num_fallbacks += 1
            return None
        self.swap.num_swap_outs += 1
        mapping = dict(zip((b.block_id for b in unique), self.swap.allocate(len(unique)), strict=True))
        for seq in seqs:
            seq.swapped_table = [mapping[b.block_id] for b in seq.blocks]
            self.free(seq)
        return list(mapping.items())

    def can_swap_in(self, seqs: list[Sequence], num_new_tokens: int) -> bool:
        """Whether the device blocks to swap a group back in and give it num_new_tokens more are free."""
        bs = self.block_size
        total = len({h for s in seqs for h in s.swapped_table})
        for s in seqs:
            total += max(0, -(-(s.num_computed_tokens + num_new_tokens) // bs) - len(s.swapped_table))
            total += 1 if len(seqs) > 1 and s.num_computed_tokens % bs else 0  # copy-on-write
        return total <= self.pool.num_free_blocks

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        host_ids = list(dict.fromkeys(h for s in seqs for h in s.swapped_table))
        self.swap.num_swap_ins += 1
        new = dict(zip(host_ids, self.pool.get_new_blocks(len(host_ids)), strict=True))
        for seq in seqs:
            seq.blocks = [new[h] for h in seq.swapped_table]
            seq.swapped_table = []
        self.pool.touch(_shared_holds(seqs))
        self.swap.release(host_ids)
        return [(h, new[h].block_id) for h in host_ids]


def _shared_holds(seqs: list[Sequence]) -> list[KVCacheBlock]:
    """A block once for each sequence holding it beyond the first: the references sharing adds."""
    seen: set[int] = set()
    extra = []
    for block in (b for s in seqs for b in s.blocks):
        if block.block_id in seen:
            extra.append(block)
        seen.add(block.block_id)
    return extra
