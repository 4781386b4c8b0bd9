"""The engine's KV-event log: numbering, merging, replay buffer bounds and snapshots (no processes)."""

from __future__ import annotations

import pytest

from ragserve_engine.block_pool import BlockPool, KVEvent, KVSnapshot
from ragserve_engine.server.kv_events import SNAPSHOT_CHUNK, KVEventLog, to_proto

H = [bytes([i]) * 32 for i in range(10)]


def kinds(events) -> list[str]:
    return [e.WhichOneof("event") for e in events]


def test_chained_stores_and_removal_runs_merge():
    events = [
        KVEvent("stored", [H[0]], None),
        KVEvent("stored", [H[1]], H[0]),
        KVEvent("stored", [H[2]], H[1]),
        KVEvent("stored", [H[5]], None),  # a new chain
        KVEvent("removed", [H[3]]),
        KVEvent("removed", [H[4]]),
        KVEvent("cleared"),
        KVEvent("stored", [H[6]], H[9]),  # continues a chain stored earlier: parent kept
    ]
    out = to_proto(events)
    assert [next(iter(k)) for k in out] == ["stored", "stored", "removed", "cleared", "stored"]
    assert list(out[0]["stored"].block_hashes) == H[:3] and out[0]["stored"].parent_hash == b""
    assert list(out[1]["stored"].block_hashes) == [H[5]]
    assert list(out[2]["removed"].block_hashes) == [H[3], H[4]]
    assert out[4]["stored"].parent_hash == H[9]


def test_seqs_start_at_one_and_replay_is_bounded():
    log = KVEventLog(capacity=3)
    for i in range(5):
        log.on_events([KVEvent("removed", [H[i]])])
    assert log.last_seq == 5
    assert [e.seq for e in log.since(2, 10)] == [3, 4, 5]
    assert [e.seq for e in log.since(3, 1)] == [4]
    assert log.since(5, 10) == []
    assert log.can_replay(2) and log.can_replay(5)
    assert not log.can_replay(1) and not log.can_replay(0) and not log.can_replay(6)
    with pytest.raises(LookupError):
        log.since(1, 10)


def test_snapshot_numbers_on_from_the_routers_seq_and_covers_pending_events():
    pool = BlockPool(8)
    pool.record_events = True
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, H[i], H[i - 1] if i else None)
    log = KVEventLog()
    log.on_events([KVEvent("stored", [H[8]], None)])
    assert len(pool.events) == 3  # not yet published to listeners
    assert log.snapshot(pool.snapshot(), after_seq=41) == 3
    snap = log.since(41, 100)
    assert [e.seq for e in snap] == [42, 43] and kinds(snap) == ["cleared", "stored"]
    assert set(snap[1].stored.block_hashes) == set(H[:3])
    log.on_events(pool.take_events() + [KVEvent("removed", [H[0]])])  # the pending three are in the snapshot
    assert kinds(log.since(43, 10)) == ["removed"] and log.last_seq == 44


def test_large_snapshots_are_chunked():
    cached = {i.to_bytes(32, "little"): None for i in range(SNAPSHOT_CHUNK + 5)}
    log = KVEventLog()
    log.snapshot(KVSnapshot(list(cached), num_pending_events=0), after_seq=0)
    events = log.since(0, 10)
    assert kinds(events) == ["cleared", "stored", "stored"]
    assert [len(e.stored.block_hashes) for e in events[1:]] == [SNAPSHOT_CHUNK, 5]
