"""kv_aware's knock-on term: the waiting a prompt's own prefill adds to the requests arriving at its engine before its
first token. A warm document's request on a busy engine used to spread to a cold engine that other requests kept
arriving at, which then waited behind the recomputed document (docs/router.md, bench/results/router_scale-real-*)."""

from __future__ import annotations

import hashlib
import math
import time

import pytest

from ragserve.router_args import RouterConfig
from ragserve.v1 import registry_pb2
from ragserve_router.cost_model import calibrate, knock_on, predict
from ragserve_router.engines import EngineRecord, Load
from ragserve_router.memory_state import MemoryState
from ragserve_router.metrics import RouterMetrics
from ragserve_router.policies import Decider, RouteRequest
from ragserve_router.pool import EnginePool
from ragserve_router.prompt import RoutingKey
from ragserve_router.slots import ARRIVAL_TAU_S, Health
from ragserve_router.state import STORED, KVOp

DOC = [hashlib.sha256(f"doc-{i}".encode()).digest() for i in range(120)]  # 1,920 tokens held by "warm"


def measured(**over) -> Load:
    """An engine that measured 1,000 prefill tokens/s and eager 50 ms + 5 ms a sequence steps."""
    fields = dict(prefill_tokens_per_s=1000.0, decode_step_s=0.05, decode_seq_s=0.005, step_token_budget=2048)
    fields.update(decode_path=registry_pb2.DECODE_EAGER, decode_seq_measured=True, reported_at=time.time())
    return Load(**{**fields, **over})


def test_knock_on_is_the_wait_added_to_arrivals_until_the_first_token():
    # 2 s of own prefill done at 5 s: arrivals in the first 3 s wait 2 s, those in the last 2 s 1 s on average
    assert knock_on(2.0, 5.0, 0.5) == pytest.approx(0.5 * 3 * 2 + 0.5 * 2 * 1)
    assert knock_on(2.0, 5.0, 0.0) == 0.0
    speed = calibrate(measured(), [], 16)
    quiet = predict(1000, 16, 0, 0, 1500, 0, 0, speed, 0.5)
    busy = predict(1000, 16, 0, 0, 1500, 0, 0, speed, 0.5, 1, arrivals_per_s=0.25, knock_on_weight=1.0)
    assert busy.ttft_s == quiet.ttft_s  # the term ranks engines; it predicts nothing about the request itself
    assert busy.cost == pytest.approx(quiet.cost + 0.25 * 1.0 * (quiet.ttft_s - 0.5))


def test_an_engines_arrival_rate_is_a_moving_average_of_what_was_sent_there():
    health = Health()
    for i in range(15):
        health.arrived(100.0 + i * 0.001)
    assert health.arrival_rate(100.0) == pytest.approx(15 / ARRIVAL_TAU_S, rel=1e-3)
    assert health.arrival_rate(100.0 + ARRIVAL_TAU_S) == pytest.approx(15 / ARRIVAL_TAU_S / math.e, rel=1e-3)


async def decide(knock_on_weight: float, arrivals_at_cold: int) -> tuple[str, str]:
    """(engine, reason) for a request on DOC: "warm" holds it with 3,000 prefill tokens queued, "cold" is idle and
    was sent `arrivals_at_cold` requests over the last seconds (all ended)."""
    cfg, state = RouterConfig(knock_on_weight=knock_on_weight), MemoryState()
    pool = EnginePool(cfg, state, RouterMetrics())
    decider = Decider(
        cfg, state, pool.load, pool.kv_usage, pool.queued_prefill, pool.routed_blocks, pool.queued_prompts,
        arrival_rate=pool.arrival_rate,
    )  # fmt: skip
    warm, cold = (EngineRecord(e, f"http://127.0.0.1:1/{e}", ["m"], block_size=16) for e in ("warm", "cold"))
    warm.load, cold.load = measured(queued_prefill_tokens=3000), measured()
    await state.apply("warm", [KVOp(STORED, DOC)], 1)
    for _ in range(arrivals_at_cold):
        pool.reserve(cold).release()
    body = {"prompt": "x", "max_tokens": 16}
    request = RouteRequest("m", body, False, {}, RoutingKey(DOC + [b"question"], 16, 16 * 120 + 21))
    decision = await decider.decide("kv_aware", request, [warm, cold])
    return decision.order[0].engine_id, decision.reason


@pytest.mark.asyncio
async def test_a_warm_request_stays_off_a_cold_engine_that_requests_keep_arriving_at():
    # warm: (3,000 + 21) / 1,000 s queued and computed; cold: 1,941 tokens to compute, predicted ~1 s sooner
    assert await decide(0.0, 15) == ("cold", "spread")  # without the term: the spread the bench saw
    # 0.5 requests/s arriving at cold would each wait up to ~2 s behind the recomputed document: stay
    assert await decide(1.0, 15) == ("warm", "prefix_hit")
    # nothing arriving at cold: nobody waits behind it, so the spread is still right
    assert await decide(1.0, 0) == ("cold", "spread")
