"""The disk tier on a real directory: restart rebuild, atomic writes, corruption is a counted miss."""

import time

import pytest

from ragserve.v1 import cachestore_pb2 as pb
from ragserve_cachestore.record import HEADER_SIZE
from ragserve_cachestore.store import TieredStore
from ragserve_cachestore.tiers.disk import DiskTier
from ragserve_cachestore.tiers.memory import MemoryTier
from tests.helpers.cachestore import COST, LAYOUT, SIZE, dir_bytes, items


def disk_store(root, blocks: int) -> TieredStore:
    return TieredStore([MemoryTier(0), DiskTier(root, blocks * COST)])


def test_files_are_named_by_hex_key_under_the_layout(tmp_path):
    store = disk_store(tmp_path, 4)
    (key, block) = items(1)[0]
    store.put(key, block)
    path = tmp_path / LAYOUT / key[16:].hex()
    assert path.stat().st_size == HEADER_SIZE + SIZE
    assert path.read_bytes()[HEADER_SIZE:] == block.data
    assert [p.name for p in (tmp_path / LAYOUT).iterdir()] == [key[16:].hex()]  # no temp file left


def test_index_is_rebuilt_on_restart_in_lru_order(tmp_path):
    store = disk_store(tmp_path, 3)
    blocks = items(3)
    for key, block in blocks:
        store.put(key, block)
        time.sleep(0.02)  # distinct mtimes
    store.get(blocks[0][0])  # read -> mtime refreshed: blocks[1] is now the oldest
    (tmp_path / LAYOUT / ".tmp-interrupted").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not a block")

    restarted = disk_store(tmp_path, 3)
    assert not (tmp_path / LAYOUT / ".tmp-interrupted").exists()
    assert (tmp_path / "notes.txt").exists()
    assert restarted.snapshot().tiers[1].used == 3 * COST
    restarted.put(*items(1, "new")[0])
    assert restarted.lookup([blocks[1][0]]) == []  # the least recently used one went
    for key, block in (blocks[0], blocks[2]):
        assert restarted.get(key)[0] == block


def test_smaller_budget_on_restart_trims_the_oldest(tmp_path):
    store = disk_store(tmp_path, 4)
    blocks = items(4)
    for key, block in blocks:
        store.put(key, block)
        time.sleep(0.02)
    restarted = disk_store(tmp_path, 2)
    assert restarted.lookup([k for k, _ in blocks[2:]]) == [pb.TIER_DISK] * 2
    assert restarted.lookup([blocks[0][0]]) == restarted.lookup([blocks[1][0]]) == []
    assert dir_bytes(tmp_path) <= 2 * COST


def test_corrupted_and_truncated_files_are_counted_misses_and_deleted(tmp_path):
    store = disk_store(tmp_path, 4)
    blocks = items(3)
    for key, block in blocks:
        store.put(key, block)
    flipped, truncated = (tmp_path / LAYOUT / k[16:].hex() for k, _ in blocks[:2])
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-10])

    assert store.get(blocks[0][0]) is None and store.get(blocks[1][0]) is None
    assert store.get(blocks[2][0])[0] == blocks[2][1]
    assert not flipped.exists() and not truncated.exists()
    snap = store.snapshot()
    assert snap.tiers[1].counters.corrupt == 2 and snap.tiers[1].blocks == 1
    assert snap.tiers[1].used == COST


def test_file_deleted_behind_the_store_is_a_miss(tmp_path):
    store = disk_store(tmp_path, 4)
    key, block = items(1)[0]
    store.put(key, block)
    (tmp_path / LAYOUT / key[16:].hex()).unlink()
    assert store.get(key) is None
    assert store.snapshot().tiers[1].used == 0


def test_unwritable_disk_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot create disk tier directory"):
        DiskTier(blocker / "sub", COST)
