"""BlockPool and KVCacheManager: hash chains, LRU eviction, ref counts, copy-on-write."""

from __future__ import annotations

import pytest

from ragserve.keys import block_hashes, root_hash
from ragserve_engine.block_pool import BlockPool
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.sequence import Sequence
from tests.helpers.kv_pool import BS, LAYOUT, admit

ROOT = root_hash("unit-test-model")


def manager(num_blocks: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching), LAYOUT, num_swap_blocks=4)


def test_full_blocks_cached_under_the_shared_key_chain():
    kv = manager()
    kv.pool.record_events = True
    seq = admit(kv, list(range(10)))  # 2 full blocks + 2 tokens
    expected = block_hashes(list(range(10)), BS, ROOT)
    assert len(expected) == 2
    assert [b.block_hash for b in seq.blocks[:2]] == expected
    assert seq.blocks[2].block_hash is None  # the partial block is never cached
    assert set(kv.pool.cached) == set(expected)
    events = kv.pool.take_events()
    assert [e.kind for e in events] == ["stored", "stored"]
    assert events[1].parent_hash == expected[0]


def test_stored_events_carry_the_blocks_tokens_and_block_0s_salt():
    kv = manager()
    kv.pool.record_events = True
    tokens = list(range(100, 111))  # 2 full blocks + 3 tokens
    admit(kv, tokens, salt="tenant-a")
    first, second = kv.pool.take_events()
    assert (first.token_ids, first.cache_salt, first.parent_hash) == (tokens[:4], "tenant-a", None)
    assert (second.token_ids, second.cache_salt) == (tokens[4:8], None)  # the salt is in block 0's hash only
    assert not first.chunk and not second.chunk


def test_imported_blocks_carry_their_tokens():
    kv = manager()
    kv.pool.record_events = True
    tokens = list(range(12))
    hashes = block_hashes(tokens, BS, ROOT, "s")
    kv.import_blocks(hashes[1:], hashes[0], lambda i, block_id: None, tokens[4:], "s")
    events = kv.pool.take_events()
    assert [e.token_ids for e in events] == [tokens[4:8], tokens[8:12]]
    assert [e.cache_salt for e in events] == [None, None]  # block 0 was not imported
    kv.import_blocks(hashes[:1], None, lambda i, block_id: None, tokens[:4], "s")
    assert kv.pool.take_events()[0].cache_salt == "s"


def test_prefix_hit_leaves_last_token_to_compute_and_counts_tokens():
    kv = manager()
    a = admit(kv, list(range(8)))
    b = Sequence(list(range(8)), 8)
    hits = kv.get_computed_blocks(b, None)
    assert len(hits) == 1  # 8 tokens = 2 full blocks, but the last token must be recomputed
    assert hits[0] is a.blocks[0]
    c = Sequence(list(range(9)), 9)
    assert len(kv.get_computed_blocks(c, None)) == 2
    assert kv.allocate_slots(c, 1, kv.get_computed_blocks(c, None))
    assert c.num_computed_tokens == 8 and a.blocks[1].ref_cnt == 2


def test_salt_isolates_tenants():
    kv = manager()
    admit(kv, list(range(9)), salt="tenant-a")
    assert kv.get_computed_blocks(Sequence(list(range(9)), 9), "tenant-b") == []
    assert len(kv.get_computed_blocks(Sequence(list(range(9)), 9), "tenant-a")) == 2


def test_freed_blocks_keep_hash_and_lru_evicts_tail_first():
    kv = manager(num_blocks=6)
    kv.pool.record_events = True
    a = admit(kv, list(range(12)))  # 3 full blocks
    ids = [b.block_id for b in a.blocks]
    kv.free(a)
    assert kv.pool.num_free_blocks == 6 and len(kv.pool.cached) == 3  # still hittable
    free_order = [b.block_id for b in kv.pool.free_queue]
    # untouched blocks first, then a's blocks tail first
    assert free_order[-3:] == ids[::-1]
    kv.pool.take_events()
    new = kv.pool.get_new_blocks(4)  # 3 never-used blocks, then a's tail block is evicted
    assert new[-1].block_id == ids[2]
    assert [e.kind for e in kv.pool.take_events()] == ["removed"]
    hits = kv.get_computed_blocks(Sequence(list(range(13)), 13), None)
    assert [b.block_id for b in hits] == ids[:2]


def test_hit_on_a_free_block_removes_it_from_the_free_queue():
    kv = manager(num_blocks=4)
    a = admit(kv, list(range(8)))
    kv.free(a)
    seq = Sequence(list(range(9)), 9)
    hits = kv.get_computed_blocks(seq, None)
    assert kv.allocate_slots(seq, 1, hits)
    in_queue = {b.block_id for b in kv.pool.free_queue}
    assert not in_queue & {b.block_id for b in seq.blocks}
    assert kv.pool.num_free_blocks == 4 - 3


def test_ref_counts_and_double_free_detected():
    kv = manager()
    a = admit(kv, list(range(8)))
    child = kv.fork(a)
    assert all(b.ref_cnt == 2 for b in a.blocks)
    kv.free(child)
    assert all(b.ref_cnt == 1 for b in a.blocks)
    blocks = list(a.blocks)
    kv.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        kv.pool.free_blocks(blocks[:1])


def test_copy_on_write_before_writing_a_shared_partial_block():
    kv = manager()
    parent = admit(kv, list(range(6)))  # 1 full block + a partial block holding 2 tokens
    child = kv.fork(parent)
    for seq, token in ((parent, 100), (child, 200)):
        seq.token_ids.append(token)
    shared_partial = parent.blocks[1]
    assert kv.allocate_slots(child, 1)
    assert kv.pending_copies == [(shared_partial.block_id, child.blocks[1].block_id)]
    assert child.blocks[0] is parent.blocks[0]  # full blocks stay shared
    assert shared_partial.ref_cnt == 1
    assert kv.allocate_slots(parent, 1)  # last holder writes in place
    assert parent.blocks[1] is shared_partial and len(kv.pending_copies) == 1


def test_allocation_fails_cleanly_when_pool_is_short():
    kv = manager(num_blocks=2)
    seq = Sequence(list(range(12)), 12)
    assert not kv.allocate_slots(seq, 12)
    assert seq.blocks == [] and kv.pool.num_free_blocks == 2


def test_swap_out_and_in_preserves_sharing():
    kv = manager()
    parent = admit(kv, list(range(8)))
    child = kv.fork(parent)
    mapping = kv.swap_out([parent, child])
    assert mapping is not None and len(mapping) == 2  # shared blocks are swapped once
    assert kv.pool.num_free_blocks == 8
    back = kv.swap_in([parent, child])
    assert len(back) == 2
    assert [b.block_id for b in parent.blocks] == [b.block_id for b in child.blocks]
    assert all(b.ref_cnt == 2 for b in parent.blocks)
    assert len(kv.swap.free) == 4


def test_prefix_caching_off_never_hits():
    kv = manager(caching=False)
    admit(kv, list(range(9)))
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(Sequence(list(range(9)), 9), None) == []
