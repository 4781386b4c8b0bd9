"""The Redis tier against a real redis-server started by the test."""

import pytest
import redis

from ragserve.v1 import cachestore_pb2 as pb
from ragserve_cachestore.client import CacheStoreClient
from ragserve_cachestore.record import HEADER_SIZE
from ragserve_cachestore.store import TieredStore
from ragserve_cachestore.tiers.disk import DiskTier
from ragserve_cachestore.tiers.memory import MemoryTier
from ragserve_cachestore.tiers.redis_tier import RedisTier
from tests.helpers.cachestore import COST, LAYOUT, SIZE, dir_bytes, items, kv_blocks
from tests.helpers.net import free_port

PREFIX = "test:kv:"


def three_tiers(tmp_path, redis_url, ram=1, disk=2, remote=3) -> TieredStore:
    return TieredStore(
        [MemoryTier(ram * COST), DiskTier(tmp_path, disk * COST), RedisTier(redis_url, remote * COST, PREFIX)]
    )


def redis_bytes(redis_url) -> int:
    client = redis.Redis.from_url(redis_url)
    return sum(client.strlen(k) for k in client.scan_iter(match=PREFIX + "*"))


def test_blocks_flow_ram_disk_redis_and_back(tmp_path, redis_url):
    store = three_tiers(tmp_path, redis_url)
    blocks = items(6)
    for key, block in blocks:
        store.put(key, block)
    names = [[t.name for t in store.tiers if k in t.index] for k, _ in blocks]
    assert names == [["redis"]] * 3 + [["disk"]] * 2 + [["memory"]]
    assert redis_bytes(redis_url) == 3 * COST
    assert redis.Redis.from_url(redis_url).get(f"{PREFIX}{LAYOUT}:{blocks[0][0][16:].hex()}")[HEADER_SIZE:] == (
        blocks[0][1].data
    )
    block, tier = store.get(blocks[0][0])
    assert (block, tier) == (blocks[0][1], pb.TIER_REDIS)
    assert store.lookup([blocks[0][0]]) == [pb.TIER_MEMORY]  # promoted: RAM's block pushed the others down
    store.put(*items(1, "more")[0])
    snap = store.snapshot()
    assert [t.used <= t.capacity for t in snap.tiers] == [True] * 3
    assert snap.counters.dropped == 1 and redis_bytes(redis_url) <= 3 * COST
    assert dir_bytes(tmp_path) <= 2 * COST


def test_redis_index_survives_a_restart(tmp_path, redis_url):
    store = TieredStore([MemoryTier(0), RedisTier(redis_url, 4 * COST, PREFIX)])
    blocks = items(3)
    for key, block in blocks:
        store.put(key, block)
    restarted = TieredStore([MemoryTier(0), RedisTier(redis_url, 4 * COST, PREFIX)])
    assert restarted.snapshot().tiers[1].used == 3 * COST
    assert [restarted.get(k)[0] for k, _ in blocks] == [b for _, b in blocks]
    redis.Redis.from_url(redis_url).config_set("maxmemory-policy", "allkeys-lfu")  # no OBJECT IDLETIME then
    shrunk = TieredStore([MemoryTier(0), RedisTier(redis_url, 2 * COST, PREFIX)])
    assert shrunk.snapshot().tiers[1].blocks == 2 and redis_bytes(redis_url) == 2 * COST


def test_corrupt_block_in_redis_is_a_counted_miss_and_deleted(tmp_path, redis_url):
    store = TieredStore([MemoryTier(0), RedisTier(redis_url, 4 * COST, PREFIX)])
    (key, block), (key2, block2) = items(2)
    store.put(key, block)
    store.put(key2, block2)
    client = redis.Redis.from_url(redis_url)
    name = f"{PREFIX}{LAYOUT}:{key[16:].hex()}"
    client.setrange(name, HEADER_SIZE + 5, b"\xff\xfe")
    assert store.get(key) is None
    assert client.exists(name) == 0
    assert store.snapshot().tiers[1].counters.corrupt == 1
    assert store.get(key2)[0] == block2


def test_redis_going_away_costs_misses_not_errors(tmp_path, redis_url):
    store = TieredStore([MemoryTier(0), RedisTier(redis_url, 4 * COST, PREFIX)])
    (key, block), (key2, block2) = items(2)
    store.put(key, block)
    redis.Redis.from_url(redis_url).shutdown(nosave=True)
    assert store.get(key) is None  # unavailable: a miss
    assert store.put(key2, block2) is False  # dropped, not raised
    assert store.snapshot().tiers[1].used == COST  # the block still in Redis stays accounted


def test_unreachable_redis_at_start_is_a_clear_error():
    with pytest.raises(ValueError, match=r"redis tier: cannot use redis://127\.0\.0\.1:\d+"):
        RedisTier(f"redis://127.0.0.1:{free_port()}", COST, timeout_s=0.5)
    with pytest.raises(ValueError, match=r"redis://\*\*\*@127\.0\.0\.1"):
        RedisTier(f"redis://user:secret@127.0.0.1:{free_port()}", COST, timeout_s=0.5)


def test_server_with_all_three_tiers(make_server, tmp_path, redis_url):
    server, address = make_server(
        memory=2 * COST, disk_dir=str(tmp_path), disk=2 * COST, redis=redis_url, redis_capacity=20 * COST
    )
    blocks = kv_blocks(10, SIZE)
    with CacheStoreClient([address], LAYOUT) as client:
        assert client.put(blocks) == 10
        assert client.get([b.key for b in blocks]) == blocks
        (stats,) = client.stats().values()
    assert [t.tier for t in stats.tiers] == [pb.TIER_MEMORY, pb.TIER_DISK, pb.TIER_REDIS]
    assert stats.tiers[2].hits > 0 and stats.evictions == 0
    assert all(t.used_bytes <= t.capacity_bytes for t in stats.tiers)
