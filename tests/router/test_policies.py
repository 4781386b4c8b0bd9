"""Routing policies and consistent hashing, on the real index (MemoryState) with controlled loads."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from ragserve_router.config import RouterConfig
from ragserve_router.engines import STATIC, EngineRecord
from ragserve_router.hashring import bounded_order, ring_order
from ragserve_router.memory_state import MemoryState
from ragserve_router.policies import Policies, RouteRequest
from ragserve_router.prompt import RoutingKey
from ragserve_router.state import STORED, KVOp

IDS = ["e0", "e1", "e2"]


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def setup(**cfg):
    state = MemoryState()
    loads = dict.fromkeys(IDS, 0.0)
    records = [EngineRecord(e, f"http://127.0.0.1:1/{e}", ["m"], model_id="m@1", block_size=16) for e in IDS]
    policies = Policies(RouterConfig(**cfg), state, lambda r: loads.get(r.engine_id, 0.0), lambda r: 0.0)
    return state, loads, records, policies


def req(hashes: list[bytes], headers: dict | None = None, body: dict | None = None, tokens: int | None = None):
    key = RoutingKey(hashes, 16, tokens if tokens is not None else 16 * len(hashes) + 5)
    return RouteRequest("m", body or {"prompt": "x"}, False, headers or {}, key)


def test_ring_is_consistent_when_an_engine_leaves():
    keys = [f"doc-{i}" for i in range(600)]
    before = {k: ring_order(k, IDS + ["e3"])[0] for k in keys}
    after = {k: ring_order(k, IDS)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "e3" for k in moved)
    share = Counter(before.values())
    assert set(share) == {"e0", "e1", "e2", "e3"} and min(share.values()) > 60  # spread over all engines


def test_bounded_load_skips_engines_above_c_times_average():
    key = next(k for k in (f"k{i}" for i in range(100)) if ring_order(k, IDS)[0] == "e0")
    loads = {"e0": 10, "e1": 0, "e2": 0}
    order = bounded_order(key, IDS, loads.__getitem__, 1.25)
    assert order[0] != "e0" and order[-1] == "e0"
    assert bounded_order(key, IDS, dict.fromkeys(IDS, 1).__getitem__, 1.25)[0] == "e0"


@pytest.mark.asyncio
async def test_kv_aware_prefers_cached_prefix_until_load_outweighs_it():
    state, loads, records, policies = setup(kv_weight=1.0, load_weight=2.0, guard_abs=100)
    await state.apply("e1", [KVOp(STORED, [h(i) for i in range(10)])], 1)
    request = req([h(i) for i in range(12)])
    decision = await policies.decide("kv_aware", request, records)
    assert decision.order[0].engine_id == "e1" and decision.reason == "prefix_hit"
    assert decision.predicted_cached_tokens("e1", request.key) == 160
    loads["e1"] = 4  # cost 2 + 8 = 10 < 12 uncached blocks elsewhere: still e1
    assert (await policies.decide("kv_aware", request, records)).order[0].engine_id == "e1"
    loads["e1"] = 6  # cost 2 + 12 = 14 > 12: recomputing elsewhere is cheaper
    assert (await policies.decide("kv_aware", request, records)).order[0].engine_id != "e1"


@pytest.mark.asyncio
async def test_kv_aware_imbalance_guard_falls_back_to_least_loaded():
    state, loads, records, policies = setup(guard_abs=8, guard_rel=1.5, load_weight=0.0)
    await state.apply("e0", [KVOp(STORED, [h(i) for i in range(50)])], 1)
    loads.update(e0=9, e1=3, e2=0)
    decision = await policies.decide("kv_aware", req([h(i) for i in range(50)]), records)
    assert decision.reason == "imbalance_guard"
    assert [r.engine_id for r in decision.order] == ["e2", "e1", "e0"]


@pytest.mark.asyncio
async def test_kv_aware_uses_routing_history_for_engines_without_events():
    state, loads, records, policies = setup()
    static = [EngineRecord(f"static-{i}", f"http://127.0.0.1:1/{i}", ["m"], source=STATIC) for i in range(3)]
    hashes = [h(i) for i in range(8)]
    await state.record_route(hashes, "static-2")
    decision = await policies.decide("kv_aware", req(hashes + [h(99)]), static)
    assert decision.order[0].engine_id == "static-2" and decision.cached_blocks["static-2"] == 8


@pytest.mark.asyncio
async def test_kv_aware_predicts_at_most_all_but_the_last_token():
    state, loads, records, policies = setup()
    hashes = [h(i) for i in range(4)]
    await state.apply("e0", [KVOp(STORED, hashes)], 1)
    request = req(hashes, tokens=64)  # block-aligned prompt: the engine recomputes the last block
    decision = await policies.decide("kv_aware", request, records)
    assert decision.predicted_cached_tokens("e0", request.key) == 48


@pytest.mark.asyncio
async def test_prefix_policy_follows_the_context_header():
    state, loads, records, policies = setup()
    chosen = {
        (await policies.decide("prefix", req([h(i)], {"x-context-hash": "doc-7"}), records)).order[0].engine_id
        for i in range(20)
    }
    assert len(chosen) == 1
    docs = {
        (await policies.decide("prefix", req([], {"x-context-hash": f"d{i}"}), records)).order[0].engine_id
        for i in range(40)
    }
    assert docs == set(IDS)


@pytest.mark.asyncio
async def test_prefix_policy_keys_on_leading_blocks_only():
    state, loads, records, policies = setup(prefix_key_blocks=4)
    shared = [h(i) for i in range(4)]
    picks = {
        (await policies.decide("prefix", req(shared + [h(100 + i)]), records)).order[0].engine_id for i in range(10)
    }
    assert len(picks) == 1


@pytest.mark.asyncio
async def test_session_policy_sticks_to_user_and_falls_back_to_load():
    state, loads, records, policies = setup()
    picks = {
        (await policies.decide("session", req([], body={"user": "alice"}), records)).order[0].engine_id
        for _ in range(10)
    }
    assert len(picks) == 1
    by_header = await policies.decide("session", req([], {"x-session-id": "s1"}), records)
    assert by_header.reason == "session_key"
    loads.update(e0=5, e1=0, e2=5)
    no_key = await policies.decide("session", req([]), records)
    assert no_key.reason == "no_session_key" and no_key.order[0].engine_id == "e1"


@pytest.mark.asyncio
async def test_round_robin_and_least_loaded():
    state, loads, records, policies = setup()
    firsts = [(await policies.decide("round_robin", req([]), records)).order[0].engine_id for _ in range(6)]
    assert Counter(firsts) == {"e0": 2, "e1": 2, "e2": 2}
    loads.update(e0=3, e1=1, e2=2)
    order = (await policies.decide("least_loaded", req([]), records)).order
    assert [r.engine_id for r in order] == ["e1", "e2", "e0"]


@pytest.mark.asyncio
async def test_kv_aware_spreads_new_documents_that_share_a_system_prompt():
    state, loads, records, policies = setup(prefix_key_blocks=4)

    def doc(d: int, question: int) -> list[bytes]:
        return [h(0), h(1)] + [h(1000 * d + i) for i in range(2, 6)] + [h(10**6 + question)]

    firsts = {d: (await policies.decide("kv_aware", req(doc(d, 0)), records)).order[0].engine_id for d in range(30)}
    assert set(firsts.values()) == set(IDS)  # not all on one engine because block 0 is shared
    again = {d: (await policies.decide("kv_aware", req(doc(d, 1)), records)).order[0].engine_id for d in range(30)}
    assert again == firsts  # a burst of one new document stays together even before any event
