"""Routing policies and consistent hashing, on the real index (MemoryState) with controlled loads."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter

import pytest

from ragserve.cachestore_args import CacheStoreConfig
from ragserve.router_args import POLICIES, RouterConfig
from ragserve.v1 import registry_pb2
from ragserve_cachestore.client import CacheStoreClient
from ragserve_cachestore.server import CacheStoreServer
from ragserve_router.cost_model import DEFAULT_PREFILL_TOKENS_PER_S, calibrate, predict
from ragserve_router.engines import STATIC, EngineRecord, Load
from ragserve_router.hashring import bounded_order, ring_order
from ragserve_router.memory_state import MemoryState
from ragserve_router.metrics import RouterMetrics
from ragserve_router.policies import (
    POLICY_CLASSES,
    Decider,
    KVAware,
    LeastLoaded,
    Prefix,
    RoundRobin,
    RouteRequest,
    Session,
    keyed_by_name,
)
from ragserve_router.pool import EnginePool
from ragserve_router.prompt import RoutingKey
from ragserve_router.state import STORED, KVOp
from ragserve_router.store_index import StoreIndex
from tests.helpers.cachestore import LAYOUT, kv_blocks

IDS = ["e0", "e1", "e2"]


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def setup(**cfg):
    state = MemoryState()
    loads = dict.fromkeys(IDS, 0.0)
    records = [EngineRecord(e, f"http://127.0.0.1:1/{e}", ["m"], model_id="m@1", block_size=16) for e in IDS]
    decider = Decider(RouterConfig(**cfg), state, lambda r: loads.get(r.engine_id, 0.0), lambda r: 0.0)
    return state, loads, records, decider


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


def measured(**over) -> Load:
    """A heartbeat of an engine that measured 1,000 prefill tokens/s and eager 50 ms + 5 ms a sequence steps."""
    fields = dict(prefill_tokens_per_s=1000.0, decode_step_s=0.05, decode_seq_s=0.005, step_token_budget=2048)
    fields.update(decode_path=registry_pb2.DECODE_EAGER, decode_seq_measured=True)
    fields["reported_at"] = time.time()
    return Load(**{**fields, **over})


def test_cost_model_ttft_is_work_over_measured_speed():
    speed = calibrate(measured(fetch_s_per_block=0.004), [], 16)
    # 1,000-token prompt, 40 blocks cached locally (640 tokens), 10 more in the store, 1,500 tokens queued
    p = predict(1000, 16, 40, 50, 1500, 0, 0, speed, work_weight=0.5)
    assert (p.local_tokens, p.fetched_tokens, p.computed_tokens) == (640, 160, 200)
    # (1500 + 200) / 1000 + 1 step x 0.05 + 10 blocks x 0.004
    assert p.ttft_s == pytest.approx(1.7 + 0.05 + 0.04)
    assert p.cost == pytest.approx(p.ttft_s + 0.5 * 0.2)
    # never predicts the last token cached, and a long queue takes several steps
    p = predict(64, 16, 4, 4, 5000, 0, 0, speed, work_weight=0.0)
    assert (p.local_tokens, p.computed_tokens) == (48, 16) and p.ttft_s == pytest.approx(5.016 + 3 * 0.05)
    # 4 sequences decoding since the heartbeat (which saw none): each step takes 4 x 5 ms longer, and
    # 10 output tokens cost 10 of those steps plus 5 ms for each of the 5 sequences then decoding
    p = predict(1000, 16, 40, 50, 1500, 4, 10, speed, work_weight=0.0)
    assert p.ttft_s == pytest.approx(1.7 + 0.07 + 0.04)
    assert p.cost == pytest.approx(p.ttft_s + 10 * (0.07 + 0.005 * 5))


def test_under_a_per_step_prefill_cap_a_prompt_shares_steps_with_the_queue():
    speed = calibrate(measured(long_prefill_token_threshold=256), [], 16)
    # 21 tokens to compute behind one 2,000-token prefill: one step of 256 + 21 tokens, not the whole queue
    p = predict(661, 16, 40, 0, 2000, 0, 0, speed, work_weight=0.0, queued_prompts=1)
    assert p.computed_tokens == 21 and p.ttft_s == pytest.approx((256 + 21) / 1000 + 0.05)
    # a cold 661-token prompt takes 3 capped steps, each beside 256 tokens of the queued prompt
    p = predict(661, 16, 0, 0, 2000, 0, 0, speed, work_weight=0.0, queued_prompts=1)
    assert p.ttft_s == pytest.approx((3 * 256 + 661) / 1000 + 3 * 0.05)
    # eight queued prompts fill the step budget beside it: the whole queue is ahead
    p = predict(661, 16, 40, 0, 2000, 0, 0, speed, work_weight=0.0, queued_prompts=8)
    assert p.ttft_s == pytest.approx((2000 + 21) / 1000 + 0.05)
    # no cap: the queue first, in budget-sized steps (as before)
    p = predict(661, 16, 40, 0, 2000, 0, 0, calibrate(measured(), [], 16), work_weight=0.0)
    assert p.ttft_s == pytest.approx((2000 + 21) / 1000 + 0.05)


def test_with_a_long_prefill_limit_a_long_prompt_waits_its_turn_and_a_short_one_shares_one_step():
    speed = calibrate(measured(long_prefill_token_threshold=256, max_long_partial_prefills=1), [], 16)
    # 21 tokens to compute behind eight queued prompts: one step beside one long prefill's 256, not the budget
    p = predict(661, 16, 40, 0, 2000, 0, 0, speed, work_weight=0.0, queued_prompts=8)
    assert p.ttft_s == pytest.approx((256 + 21) / 1000 + 0.05)
    # a cold 661-token prompt waits for the queue's long prefills, 256 tokens a step, then takes 3 of its own
    p = predict(661, 16, 0, 0, 2000, 0, 0, speed, work_weight=0.0, queued_prompts=2)
    assert p.ttft_s == pytest.approx((2000 + 661) / 1000 + (8 + 3) * 0.05)
    # nothing queued: its own capped steps only
    p = predict(661, 16, 0, 0, 0, 0, 0, speed, work_weight=0.0, queued_prompts=0)
    assert p.ttft_s == pytest.approx(661 / 1000 + 3 * 0.05)


def test_unmeasured_engines_borrow_the_fleets_median_speed():
    fleet = [measured(prefill_tokens_per_s=500.0), measured(prefill_tokens_per_s=700.0), Load()]
    speed = calibrate(Load(), fleet, 16)
    assert speed.prefill_tokens_per_s == 600.0 and speed.step_s == 0.05
    assert calibrate(Load(), [], 16).prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S
    # a 4 ms step measured, no slope yet (and none in the fleet): the default slope's share of that step
    no_slope = measured(decode_step_s=0.004, decode_seq_s=0.0, decode_seq_measured=False)
    assert calibrate(no_slope, [], 16).seq_s == pytest.approx(0.0006)
    assert calibrate(no_slope, [measured(decode_seq_s=0.002)], 16).seq_s == 0.002  # a peer's fitted slope


def test_a_measured_zero_slope_is_taken_as_is_and_a_tiny_one_too():
    """The flag, not the value, says "measured": 0 and 0.01 ms are both figures (before, 0 meant the default)."""
    fleet = [measured(decode_seq_s=0.004)]
    assert calibrate(measured(decode_seq_s=0.0), fleet, 16).seq_s == 0.0
    assert calibrate(measured(decode_seq_s=0.00001), fleet, 16).seq_s == 0.00001


def test_an_eager_calibration_is_compared_with_graph_peers_on_their_path():
    """An engine that has only its eager start-up calibration (40 ms steps) but will decode through compiled
    graphs is ranked on its graph peers' figures (4 ms), not its eager ones; with no graph peer, on its own;
    an --enforce-eager engine (DECODE_EAGER) always on its own."""
    graph = measured(decode_step_s=0.004, decode_seq_s=0.0002, decode_path=registry_pb2.DECODE_GRAPH)
    cold = measured(decode_step_s=0.04, decode_seq_s=0.004, decode_path=registry_pb2.DECODE_EAGER_BEFORE_GRAPHS)
    speed = calibrate(cold, [graph, cold], 16)
    assert (speed.step_s, speed.seq_s, speed.batch) == (0.004, 0.0002, 0)
    assert calibrate(cold, [cold], 16).step_s == 0.04
    eager = measured(decode_step_s=0.04, decode_seq_s=0.004, decode_path=registry_pb2.DECODE_EAGER)
    assert calibrate(eager, [graph, eager], 16).step_s == 0.04
    # unmeasured: the graph peers' median when there are any, else every measured peer's
    assert calibrate(Load(), [graph, eager], 16).step_s == 0.004
    assert calibrate(Load(), [eager, measured(decode_step_s=0.02)], 16).step_s == pytest.approx(0.03)


@pytest.mark.asyncio
async def test_kv_aware_keeps_locality_until_queued_work_outweighs_it():
    state, loads, records, decider = setup()
    for r in records:
        r.load = measured()
    await state.apply("e1", [KVOp(STORED, [h(i) for i in range(40)])], 1)
    request = req([h(i) for i in range(40)] + [h(1000)], tokens=16 * 41 + 5)  # 645 of 661 tokens on e1
    decision = await decider.decide("kv_aware", request, records)
    assert decision.order[0].engine_id == "e1" and decision.reason == "prefix_hit"
    assert decision.predicted_cached_tokens("e1", request.key) == 640
    records[1].load = measured(queued_prefill_tokens=400, reported_at=time.time())
    # e1: (400 + 21) / 1000 = 0.42 s + a step; elsewhere 0.66 s + a step + half of it as work: still e1
    assert (await decider.decide("kv_aware", request, records)).order[0].engine_id == "e1"
    records[1].load = measured(queued_prefill_tokens=2000, reported_at=time.time())
    decision = await decider.decide("kv_aware", request, records)
    assert decision.order[0].engine_id != "e1" and decision.reason == "spread"
    # with a per-step prefill cap the request shares e1's steps with that prefill: it stays ...
    for r in records:
        r.load = measured(long_prefill_token_threshold=256, queued_prefill_tokens=2000 * (r is records[1]))
    assert (await decider.decide("kv_aware", request, records)).order[0].engine_id == "e1"
    # ... unless enough prompts wait there to fill every step's budget
    records[1].load = measured(long_prefill_token_threshold=256, queued_prefill_tokens=2000, num_waiting=8)
    assert (await decider.decide("kv_aware", request, records)).order[0].engine_id != "e1"


def pooled():
    """A Decider over a real EnginePool: the pool's slots carry what this replica sent each engine."""
    pool = EnginePool(RouterConfig(), MemoryState(), RouterMetrics())
    _, _, records, _ = setup()
    decider = Decider(
        RouterConfig(), MemoryState(), pool.load, pool.kv_usage, pool.queued_prefill, pool.routed_blocks,
        pool.queued_prompts,
    )  # fmt: skip
    return pool, records, decider


async def send(pool: EnginePool, decider: Decider, request: RouteRequest, records: list[EngineRecord]):
    """Decide and reserve as the gateway does (no await in between): the next decision sees this one."""
    decision = await decider.decide("kv_aware", request, records)
    chosen = decision.order[0]
    slot = pool.reserve(chosen, decision.predictions[chosen.engine_id].computed_tokens, request.key.hashes)
    return decision, slot


@pytest.mark.asyncio
async def test_kv_aware_counts_work_it_routed_since_the_last_heartbeat():
    """A burst of distinct cold prompts spreads although no heartbeat reported the first ones yet; a burst of
    one new document stays together (its blocks will be there), and once a heartbeat reports the queue the
    work is not counted twice."""
    pool, records, decider = pooled()
    for r in records:
        r.load = measured()
    firsts = [(await send(pool, decider, req([h(1000 * d + i) for i in range(60)]), records))[0] for d in range(9)]
    assert Counter(d.order[0].engine_id for d in firsts) == {"e0": 3, "e1": 3, "e2": 3}
    for r in records:  # a heartbeat arrives: the engines now report that work themselves
        r.load = measured(queued_prefill_tokens=3 * 965, reported_at=time.time() + 1)
    assert all(pool.queued_prefill(r) == 3 * 965 for r in records)
    again, _ = await send(pool, decider, req([h(i) for i in range(60)] + [h(10**6)]), records)  # doc 0 again
    assert again.order[0] is firsts[0].order[0] and again.reason == "prefix_hit"
    assert again.predictions[again.order[0].engine_id].local_tokens == 60 * 16


@pytest.fixture
def store():
    """A real in-process cachestore: (address, client writing blocks of the test layout)."""
    server = CacheStoreServer(CacheStoreConfig(host="127.0.0.1", port=0, metrics_port=0))
    address = f"127.0.0.1:{server.start()}"
    client = CacheStoreClient(address, LAYOUT)
    yield address, client
    client.close()
    server.stop(grace=0)


@pytest.mark.asyncio
async def test_kv_aware_counts_the_cachestores_blocks_as_fetchable(store):
    """A hot prefix held by e0 and by the store: e1 and e2 can fetch it, so a busy e0 no longer pins it."""
    address, client = store
    state, loads, records, decider = setup()
    blocks = kv_blocks(30, seed="hot")
    hot = [b.key for b in blocks]
    assert client.put(blocks) == 30
    for r in records:
        r.layout_fingerprint, r.cachestore = LAYOUT, address
        r.load = measured(fetch_s_per_block=0.002)
    # the router's own StoreIndex (real Lookup RPCs) on a clock the test moves, so what it remembers
    # expires when the test says, not when a slow machine gets there
    now = [0.0]
    index = decider.by_name["kv_aware"].ctx.store = StoreIndex(RouterConfig(), clock=lambda: now[0])
    deadline = time.monotonic() + 30  # until its channel is up (a lookup past its 0.1 s deadline counts 0)
    while await index.leading(address, LAYOUT, hot) != 30:
        assert time.monotonic() < deadline, "the router's store index never saw the 30 stored blocks"
        await asyncio.sleep(0.05)
    await state.apply("e0", [KVOp(STORED, hot)], 1)
    records[0].load = measured(queued_prefill_tokens=600)
    request = req(hot + [h(999)], tokens=16 * 31 + 3)
    decision = await decider.decide("kv_aware", request, records)
    assert decision.order[0].engine_id != "e0" and decision.reason == "spread"
    chosen = decision.predictions[decision.order[0].engine_id]
    assert (chosen.local_tokens, chosen.fetched_tokens, chosen.computed_tokens) == (0, 480, 19)
    assert decision.predicted_cached_tokens(decision.order[0].engine_id, request.key) == 480
    # the store lost it (and the index's memory of it expired): recomputing 480 tokens elsewhere is slower
    # than waiting on e0
    assert client.delete(hot) == 30 and client.lookup(hot) == 0
    now[0] += 2 * RouterConfig().store_lookup_ttl
    records[0].load = measured(queued_prefill_tokens=300, reported_at=time.time() + 1)
    assert (await decider.decide("kv_aware", request, records)).order[0].engine_id == "e0"
    index.close()


@pytest.mark.asyncio
async def test_kv_aware_uses_routing_history_for_engines_without_events():
    state, loads, records, decider = setup()
    static = [EngineRecord(f"static-{i}", f"http://127.0.0.1:1/{i}", ["m"], source=STATIC) for i in range(3)]
    hashes = [h(i) for i in range(8)]
    await state.record_route(hashes, "static-2")
    decision = await decider.decide("kv_aware", req(hashes + [h(99)]), static)
    assert decision.order[0].engine_id == "static-2" and decision.cached_blocks["static-2"] == 8


@pytest.mark.asyncio
async def test_kv_aware_predicts_at_most_all_but_the_last_token():
    state, loads, records, decider = setup()
    hashes = [h(i) for i in range(4)]
    await state.apply("e0", [KVOp(STORED, hashes)], 1)
    request = req(hashes, tokens=64)  # block-aligned prompt: the engine recomputes the last block
    decision = await decider.decide("kv_aware", request, records)
    assert decision.predicted_cached_tokens("e0", request.key) == 48


@pytest.mark.asyncio
async def test_prefix_policy_follows_the_context_header():
    state, loads, records, decider = setup()
    chosen = {
        (await decider.decide("prefix", req([h(i)], {"x-context-hash": "doc-7"}), records)).order[0].engine_id
        for i in range(20)
    }
    assert len(chosen) == 1
    docs = {
        (await decider.decide("prefix", req([], {"x-context-hash": f"d{i}"}), records)).order[0].engine_id
        for i in range(40)
    }
    assert docs == set(IDS)


@pytest.mark.asyncio
async def test_prefix_policy_keys_on_leading_blocks_only():
    state, loads, records, decider = setup(prefix_key_blocks=4)
    shared = [h(i) for i in range(4)]
    picks = {
        (await decider.decide("prefix", req(shared + [h(100 + i)]), records)).order[0].engine_id for i in range(10)
    }
    assert len(picks) == 1
    # different leading blocks spread, each where the ring puts its 4th block (idle fleet: no load bound)
    docs = [[h(1000 * d + i) for i in range(4)] for d in range(30)]
    got = [(await decider.decide("prefix", req(doc + [h(7)]), records)).order[0].engine_id for doc in docs]
    assert got == [ring_order(doc[3], IDS)[0] for doc in docs] and set(got) == set(IDS)


@pytest.mark.asyncio
async def test_session_policy_sticks_to_user_and_falls_back_to_load():
    state, loads, records, decider = setup()
    picks = {
        (await decider.decide("session", req([], body={"user": "alice"}), records)).order[0].engine_id
        for _ in range(10)
    }
    assert len(picks) == 1
    # different users spread: each where the ring puts "session:<user>", all three engines used
    users = [f"user-{i}" for i in range(30)]
    got = [(await decider.decide("session", req([], body={"user": u}), records)).order[0].engine_id for u in users]
    assert got == [ring_order("session:" + u, IDS)[0] for u in users] and set(got) == set(IDS)
    by_header = await decider.decide("session", req([], {"x-session-id": "s1"}), records)
    assert by_header.reason == "session_key"
    loads.update(e0=5, e1=0, e2=5)
    no_key = await decider.decide("session", req([]), records)
    assert no_key.reason == "no_session_key" and no_key.order[0].engine_id == "e1"


@pytest.mark.asyncio
async def test_round_robin_and_least_loaded():
    state, loads, records, decider = setup()
    firsts = [(await decider.decide("round_robin", req([]), records)).order[0].engine_id for _ in range(6)]
    assert Counter(firsts) == {"e0": 2, "e1": 2, "e2": 2}
    loads.update(e0=3, e1=1, e2=2)
    order = (await decider.decide("least_loaded", req([]), records)).order
    assert [r.engine_id for r in order] == ["e1", "e2", "e0"]


@pytest.mark.asyncio
async def test_kv_aware_spreads_new_documents_that_share_a_system_prompt():
    state, loads, records, decider = setup(prefix_key_blocks=4)

    def doc(d: int, question: int) -> list[bytes]:
        return [h(0), h(1)] + [h(1000 * d + i) for i in range(2, 6)] + [h(10**6 + question)]

    firsts = {d: (await decider.decide("kv_aware", req(doc(d, 0)), records)).order[0].engine_id for d in range(30)}
    assert set(firsts.values()) == set(IDS)  # not all on one engine because block 0 is shared
    again = {d: (await decider.decide("kv_aware", req(doc(d, 1)), records)).order[0].engine_id for d in range(30)}
    assert again == firsts  # a burst of one new document stays together even before any event


def test_pool_load_discounts_requests_that_finished_after_the_report():
    """A heartbeat taken while our request ran says active=1; once it is released the engine is idle again,
    so a sequence of pinned requests is not pushed off its engine by a stale report."""
    pool = EnginePool(RouterConfig(), MemoryState(), RouterMetrics())
    record = EngineRecord("e0", "http://127.0.0.1:1", ["m"])
    slot = pool.reserve(record)
    record.load = Load(num_running=1, reported_at=time.time())
    assert pool.load(record) == 1
    time.sleep(0.01)
    slot.release()
    assert pool.load(record) == 0
    record.load = Load(num_running=2, reported_at=time.time() + 1)  # a newer report: others' count again
    assert pool.load(record) == 2


def test_pool_load_discounts_a_report_taken_before_our_request_finished_that_arrives_after():
    """The engine took the report while our request ran and our client saw the last byte before the
    heartbeat arrived: the report is stale although it arrived after the release (CI run 12's flake: a
    prefix-pinned request pushed off its engine by the bounded load)."""
    pool = EnginePool(RouterConfig(), MemoryState(), RouterMetrics())
    record = EngineRecord("e0", "http://127.0.0.1:1", ["m"])
    pool.reserve(record).release()
    record.load = Load(num_running=1, reported_at=time.time())
    assert pool.load(record) == 0


@pytest.mark.asyncio
async def test_kv_aware_counts_our_prompts_without_a_first_token_over_a_stale_heartbeat():
    """An engine admits requests only between steps and reports its queue after one: a heartbeat arriving
    mid-step says 'queue empty' although we just sent it a cold prompt. Until its first token the prompt
    still counts, so the next cold prompt goes where the decoders are rather than behind that prefill."""
    pool, records, decider = pooled()
    e0, e1, e2 = records
    cold = pool.reserve(e0, 3000)  # sent, still prefilling
    decoding = [pool.reserve(r) for r in (e1, e1, e2, e2)]
    for slot in decoding:
        slot.first_token()
    for r in records:  # heartbeats newer than every send, none showing the 3,000 queued tokens
        r.load = measured(reported_at=time.time() + 1)
    assert (pool.prefilling(e0), pool.prefilling(e1)) == (3000, 0)
    decision = await decider.decide("kv_aware", req([h(7000 + i) for i in range(60)]), records)
    assert decision.order[0] is not e0 and decision.predictions["e0"].queued_tokens == 3000
    cold.first_token()  # its prefill is done: it no longer counts, and only once
    cold.first_token()
    assert pool.prefilling(e0) == 0
    assert (await decider.decide("kv_aware", req([h(8000 + i) for i in range(60)]), records)).order[0] is e0
    again = pool.reserve(e0, 500)
    again.move(e1)  # a retry takes its prompt along
    assert (pool.prefilling(e0), pool.prefilling(e1)) == (0, 500)
    again.release()
    assert pool.prefilling(e1) == 0


@pytest.mark.asyncio
async def test_kv_aware_discounts_a_reported_queue_whose_prefills_ended_since():
    """A heartbeat taken while our 2,000-token prompt prefilled on e0 says 2,500 tokens queued there; once that
    prompt's first token has come 500 are left, and a conversation's next turn stays on e0, where its prefix is,
    for the rest of the heartbeat interval (bench/results/router_scale-chat64.md: follow-ups moved off their prefix
    for a queue that had ended). A report taken after the first token, or a prompt sent after it, still counts."""
    pool, records, decider = pooled()
    e0 = records[0]
    for r in records:
        r.load = measured()
    turn = [h(i) for i in range(60)]
    await decider.by_name["kv_aware"].ctx.state.apply("e0", [KVOp(STORED, turn)], 1)
    other = pool.reserve(e0, 2000)  # another user's cold prompt
    time.sleep(0.01)
    e0.load = measured(queued_prefill_tokens=2500)  # taken while it prefilled (500 tokens of another router's)
    follow_up = req([*turn, h(10**6)], body={"prompt": "x", "max_tokens": 1}, tokens=16 * 61 + 5)
    decision = await decider.decide("kv_aware", follow_up, records)
    assert pool.queued_prefill(e0) == 2500 and decision.order[0] is not e0 and decision.reason == "spread"
    other.first_token()
    assert pool.queued_prefill(e0) == 500
    decision = await decider.decide("kv_aware", follow_up, records)
    assert decision.order[0] is e0 and decision.reason == "prefix_hit"
    time.sleep(0.01)
    later = pool.reserve(e0, 500)  # sent after the report: it was not in it
    later.first_token()
    assert pool.queued_prefill(e0) == 500
    e0.load = measured(queued_prefill_tokens=2000, reported_at=time.time() + 1)  # taken after both ended
    assert pool.queued_prefill(e0) == 2000
    other.release()
    later.release()


def test_policy_classes_are_keyed_by_the_launch_specs_names():
    """Any order in, ragserve.router_args.POLICIES' order out; a class missing, or two of one name, is refused."""
    shuffled = keyed_by_name(KVAware, Prefix, Session, LeastLoaded, RoundRobin)
    assert list(shuffled.items()) == list(POLICY_CLASSES.items())
    assert list(POLICY_CLASSES) == list(POLICIES)
    with pytest.raises(RuntimeError, match="do not match ragserve.router_args.POLICIES"):
        keyed_by_name(RoundRobin, LeastLoaded, Session, Prefix)
    with pytest.raises(RuntimeError, match="do not match"):
        keyed_by_name(RoundRobin, LeastLoaded, Session, Prefix, KVAware, KVAware)
