"""The router state contract, run against both implementations: in memory and in a real redis-server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid

import pytest
import pytest_asyncio

from ragserve.v1 import registry_pb2
from ragserve_router.engines import EngineRecord, Load, TokenizerBlob
from ragserve_router.memory_state import MemoryState
from ragserve_router.redis_state import RedisState
from ragserve_router.state import CLEARED, REMOVED, STORED, KVOp, plan_events

BLOB = TokenizerBlob('{"fake": "tokenizer"}', "{{ messages }}", {"eos_token": "</s>"})


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def record(engine_id: str, model: str = "m") -> EngineRecord:
    return EngineRecord(engine_id, f"http://127.0.0.1:1/{engine_id}", [model], model_id="m@1", block_size=16)


@pytest.fixture(scope="module")
def redis_url(module_cluster):
    return module_cluster.redis()


@pytest_asyncio.fixture(params=["memory", "redis"])
async def state(request):
    if request.param == "memory":
        yield MemoryState(approx_max_entries=1000)
        return
    s = RedisState(request.getfixturevalue("redis_url"), f"test-{uuid.uuid4().hex[:8]}:", approx_max=1000)
    yield s
    await s.close()


def event(seq: int, kind: str, hashes: list[bytes] = ()) -> registry_pb2.KVEvent:
    if kind == STORED:
        return registry_pb2.KVEvent(seq=seq, stored=registry_pb2.BlocksStored(block_hashes=hashes))
    if kind == REMOVED:
        return registry_pb2.KVEvent(seq=seq, removed=registry_pb2.BlocksRemoved(block_hashes=hashes))
    return registry_pb2.KVEvent(seq=seq, cleared=registry_pb2.AllBlocksCleared())


def test_plan_events_skips_duplicates_and_stops_at_a_gap():
    events = [event(2, STORED, [h(2)]), event(3, STORED, [h(3)]), event(4, REMOVED, [h(2)]), event(6, CLEARED)]
    ops, last = plan_events(2, events)
    assert last == 4
    assert [(op.kind, op.hashes) for op in ops] == [(STORED, [h(3)]), (REMOVED, [h(2)])]
    assert plan_events(4, events) == ([], 4)


@pytest.mark.asyncio
async def test_register_events_and_resume_seq(state):
    assert await state.register(record("a"), BLOB, ttl_s=30) == 0
    assert await state.is_registered("a")
    await state.apply("a", [KVOp(STORED, [h(0), h(1), h(2)])], 1)
    assert await state.last_seq("a") == 1
    assert await state.num_blocks("a") == 3
    # re-registering (e.g. after a reconnect) resumes after the last applied event
    assert await state.register(record("a"), BLOB, ttl_s=30) == 1
    assert await state.tokenizer(record("a").tokenizer_fingerprint) == BLOB


@pytest.mark.asyncio
async def test_exact_match_counts_leading_blocks_only(state):
    for engine_id in ("a", "b", "c"):
        await state.register(record(engine_id), BLOB, ttl_s=30)
    await state.apply("a", [KVOp(STORED, [h(0), h(1), h(2)])], 1)
    await state.apply("b", [KVOp(STORED, [h(0), h(2)])], 1)  # h(1) missing: only block 0 is usable
    got = await state.match_exact(["a", "b", "c"], [h(0), h(1), h(2), h(3)])
    assert got == {"a": 3, "b": 1, "c": 0}


@pytest.mark.asyncio
async def test_removed_and_cleared(state):
    await state.register(record("a"), BLOB, ttl_s=30)
    await state.apply("a", [KVOp(STORED, [h(0), h(1), h(2)]), KVOp(REMOVED, [h(1)])], 2)
    assert (await state.match_exact(["a"], [h(0), h(1), h(2)]))["a"] == 1
    await state.apply("a", [KVOp(CLEARED, []), KVOp(STORED, [h(5)])], 4)
    assert await state.num_blocks("a") == 1
    assert await state.last_seq("a") == 4


@pytest.mark.asyncio
async def test_heartbeat_updates_load_and_unknown_is_reported(state):
    assert not await state.heartbeat("ghost", Load(), ttl_s=30)
    await state.register(record("a"), BLOB, ttl_s=30)
    assert await state.heartbeat("a", Load(num_running=3, num_waiting=2, kv_usage=0.5), ttl_s=30)
    [live] = await state.engines()
    assert live.load.active == 5 and live.load.kv_usage == 0.5


@pytest.mark.asyncio
async def test_missed_heartbeats_expire_and_drop_forgets_blocks(state):
    await state.register(record("a"), BLOB, ttl_s=0.2)
    await state.register(record("b"), BLOB, ttl_s=30)
    await state.apply("a", [KVOp(STORED, [h(0)])], 1)
    await asyncio.sleep(0.4)
    assert [r.engine_id for r in await state.engines()] == ["b"]
    assert await state.expired() == ["a"]
    assert await state.drop("a")
    assert not await state.drop("a")
    assert await state.expired() == []
    assert (await state.match_exact(["a"], [h(0)]))["a"] == 0
    assert await state.register(record("a"), BLOB, ttl_s=30) == 0  # a dropped engine must resend a snapshot


@pytest.mark.asyncio
async def test_approximate_index_ttl_per_engine(state):
    await state.record_route([h(0), h(1)], "static-0")
    await state.record_route([h(0)], "e1")
    got = await state.match_approx({"static-0": 600, "e1": 600, "e2": 600}, [h(0), h(1), h(2)])
    assert got == {"static-0": 2, "e1": 1, "e2": 0}
    await asyncio.sleep(0.3)
    got = await state.match_approx({"static-0": 600, "e1": 0.1}, [h(0), h(1)])
    assert got == {"static-0": 2, "e1": 0}


@pytest.mark.asyncio
async def test_the_in_process_index_records_a_route_at_once_redis_leaves_it_to_record_route(state):
    # Routing.remember records in process without a task per request; Redis's write goes to a background task
    done = state.record_route_now([h(0), h(1)], "e")
    got = await state.match_approx({"e": 600}, [h(0), h(1)])
    assert (done, got) == ((True, {"e": 2}) if isinstance(state, MemoryState) else (False, {"e": 0}))


@pytest.mark.asyncio
async def test_an_eviction_event_overrides_an_earlier_route_there(state):
    """Routes to an engine count as its blocks for a while (it is about to compute them); once the engine
    reports evicting them, routing there again must not predict a hit, however recently it was routed."""
    await state.register(record("a"), BLOB, ttl_s=30)
    doc = [h(0), h(1), h(2)]
    await state.record_route(doc, "a")
    await state.record_route(doc, "b")
    await state.apply("a", [KVOp(STORED, doc), KVOp(REMOVED, [h(1), h(2)])], 2)
    assert (await state.match_exact(["a"], doc))["a"] == 1
    assert await state.match_approx({"a": 600, "b": 600}, doc) == {"a": 1, "b": 3}
    await state.record_route(doc, "a")  # routed there again: it recomputes them
    assert (await state.match_approx({"a": 600}, doc))["a"] == 3


@pytest.mark.asyncio
async def test_a_cleared_or_dropped_engine_forgets_its_routing_history(state):
    """Routes recorded before the engine cleared its cache (or was dropped: a restart under the same id comes
    back empty) no longer predict hits there; routes after it do, and other engines keep theirs."""
    doc = [h(0), h(1), h(2)]
    for engine_id in ("a", "b"):
        await state.register(record(engine_id), BLOB, ttl_s=30)
        await state.record_route(doc, engine_id)
    assert await state.match_approx({"a": 600, "b": 600}, doc) == {"a": 3, "b": 3}
    await state.apply("a", [KVOp(CLEARED, [])], 1)
    assert await state.match_approx({"a": 600, "b": 600}, doc) == {"a": 0, "b": 3}
    await asyncio.sleep(0.01)  # a route after the clear: a later timestamp
    await state.record_route(doc[:2], "a")
    assert await state.match_approx({"a": 600}, doc) == {"a": 2}
    assert await state.drop("b")
    assert await state.match_approx({"a": 600, "b": 600}, doc) == {"a": 2, "b": 0}


@pytest.mark.asyncio
async def test_approximate_index_is_size_bounded(state):
    if isinstance(state, MemoryState):
        state.approx.max_entries = 3
    else:
        state.approx_max = 3
    await state.record_route([h(i) for i in range(5)], "e")
    if isinstance(state, RedisState):
        assert await state.trim_approx() == 2
    # the oldest entries went first, so the chain now misses its first blocks
    assert (await state.match_approx({"e": 600}, [h(i) for i in range(5)]))["e"] == 0
    assert (await state.match_approx({"e": 600}, [h(2), h(3), h(4)]))["e"] == 3


def test_a_record_stored_before_the_cachestore_moved_to_the_identity_reads():
    """Redis shared with an older router: its records carry the address in load.cachestore."""
    old = json.loads(EngineRecord("e", "http://e", ["m"]).to_json())
    old["load"]["cachestore"] = old.pop("cachestore") or "store:1"
    record = EngineRecord.from_json(json.dumps(old))
    assert record.cachestore == "store:1" and record.load == Load()


@pytest.mark.asyncio
async def test_a_heartbeat_that_reads_the_record_as_it_is_dropped_does_not_bring_it_back(redis_url):
    """Redis: the engine's Deregister drops it between its last Heartbeat's read of the record and that heartbeat's
    write (two RPCs of one engine in flight at once on its replica)."""
    state = RedisState(redis_url, f"test-{uuid.uuid4().hex[:8]}:")
    try:
        await state.register(record("a"), BLOB, ttl_s=0.2)
        read = state.redis.hget

        async def read_then_drop(*args):
            raw = await read(*args)
            assert await state.drop("a")
            return raw

        state.redis.hget = read_then_drop
        assert not await state.heartbeat("a", Load(num_running=1), ttl_s=0.2)  # unknown now
        state.redis.hget = read
        await asyncio.sleep(0.4)
        assert not await state.is_registered("a") and await state.engines() == []
        assert await state.expired() == []  # nothing left to drop for missed heartbeats
    finally:
        await state.close()
