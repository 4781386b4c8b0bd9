"""TieredStore over a real RAM tier and a real disk tier (a tmp directory): LRU, budgets, demotion, promotion."""

import random

from ragserve.v1 import cachestore_pb2 as pb
from ragserve_cachestore.store import TieredStore
from ragserve_cachestore.tiers.disk import DiskTier
from ragserve_cachestore.tiers.memory import MemoryTier
from tests.helpers.cachestore import COST, LAYOUT, SIZE, dir_bytes, items


def make(tmp_path, ram_blocks: int, disk_blocks: int = 0) -> TieredStore:
    tiers = [MemoryTier(ram_blocks * COST)]
    if disk_blocks:
        tiers.append(DiskTier(tmp_path / "disk", disk_blocks * COST))
    return TieredStore(tiers)


def where(store: TieredStore, key: bytes) -> list[str]:
    return [t.name for t in store.tiers if key in t.index]


def test_round_trip_and_already_present(tmp_path):
    store = make(tmp_path, 10)
    blocks = items(5)
    assert all(store.put(k, b) for k, b in blocks)
    assert not store.put(*blocks[0])  # already present
    for key, block in blocks:
        assert store.get(key) == (block, pb.TIER_MEMORY)
    assert store.lookup([k for k, _ in blocks]) == [pb.TIER_MEMORY] * 5
    snap = store.snapshot()
    assert snap.counters.puts == 5 and snap.counters.skipped == 1


def test_ram_lru_evicts_least_recently_used(tmp_path):
    store = make(tmp_path, 3)
    (a, ba), (b, bb), (c, bc), (d, bd) = items(4)
    for key, block in ((a, ba), (b, bb), (c, bc)):
        store.put(key, block)
    store.get(a)  # a is now the most recently used
    store.put(d, bd)
    assert store.get(b) is None  # b was the least recently used
    assert [store.get(k)[0] for k in (a, c, d)] == [ba, bc, bd]
    snap = store.snapshot()
    assert snap.tiers[0].used == 3 * COST and snap.tiers[0].counters.evictions == 1
    assert snap.counters.dropped == 1


def test_chain_head_outlives_its_tail(tmp_path):
    """A chain's tail is useless without its head, so within a chain the head is evicted last."""
    store = make(tmp_path, 4)
    first = items(4, "first")
    for key, block in first:
        store.put(key, block)
    store.touch_chain([k for k, _ in first])
    for key, block in items(2, "second"):
        store.put(key, block)
    assert store.lookup([k for k, _ in first]) == [pb.TIER_MEMORY] * 2  # head kept, tail evicted
    assert store.get(first[3][0]) is None


def test_demote_to_disk_on_eviction_and_promote_on_hit(tmp_path):
    store = make(tmp_path, 2, 10)
    blocks = items(5)
    for key, block in blocks:
        store.put(key, block)
    assert [where(store, k) for k, _ in blocks[:3]] == [["disk"]] * 3
    assert store.lookup([k for k, _ in blocks]) == [pb.TIER_DISK] * 3 + [pb.TIER_MEMORY] * 2
    block, tier = store.get(blocks[0][0])
    assert (block, tier) == (blocks[0][1], pb.TIER_DISK)
    assert where(store, blocks[0][0]) == ["memory", "disk"]  # promoted, disk copy kept
    assert store.get(blocks[0][0])[1] == pb.TIER_MEMORY
    snap = store.snapshot()
    assert [t.counters.hits for t in snap.tiers] == [1, 1]
    assert snap.counters.dropped == 0


def test_capacity_is_never_exceeded_under_a_random_workload(tmp_path):
    rng = random.Random(7)
    store = make(tmp_path, 5, 12)
    pool = items(40, size=SIZE) + items(20, "big", size=3 * SIZE)
    absent = {key for key, _ in pool}  # never put, or deleted since
    hits = misses = 0
    for _ in range(400):
        key, block = rng.choice(pool)
        op = rng.random()
        if op < 0.5:
            store.put(key, block)
            absent.discard(key)
        elif op < 0.9:
            listed = store.lookup([key]) != []
            got = store.get(key)
            assert (got is not None) == listed and not (got and key in absent)  # get agrees with lookup
            if got is not None:
                assert got[0] == block
            hits, misses = hits + (got is not None), misses + (got is None)
        else:
            store.delete(key)
            absent.add(key)
        for tier in store.snapshot().tiers:
            assert tier.used <= tier.capacity
        assert dir_bytes(tmp_path / "disk") <= 12 * COST
    assert store.snapshot().counters.dropped > 0 and hits > 0 and misses > 0


def test_block_larger_than_ram_goes_to_disk_and_larger_than_all_is_skipped(tmp_path):
    store = make(tmp_path, 1, 4)
    (k1, big), (k2, huge) = items(1, "big", 2 * SIZE)[0], items(1, "huge", 10 * SIZE)[0]
    assert store.put(k1, big) and where(store, k1) == ["disk"]
    assert not store.put(k2, huge) and where(store, k2) == []
    assert store.snapshot().counters.skipped == 1


def test_delete_removes_every_copy(tmp_path):
    store = make(tmp_path, 1, 4)
    (k1, b1), (k2, b2) = items(2)
    store.put(k1, b1)
    store.put(k2, b2)
    store.get(k1)  # now in RAM and on disk
    assert store.delete(k1) and not store.delete(k1)
    assert where(store, k1) == [] and store.get(k1) is None
    assert not (tmp_path / "disk" / LAYOUT / k1[16:].hex()).exists()
