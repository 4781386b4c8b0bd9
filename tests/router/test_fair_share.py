"""--tenant-fair-share in the router queue itself (the end-to-end case is in test_flow_reserve.py): a tenant's recent
demand keeps its max-min fair allocation of the places for its clients' next requests (one place free, and the
places that free go to it) while a heavy tenant waits, and once that demand has decayed the heavy tenant takes every
place (work-conserving). The decay is real
time: a long half-life holds the demand for the whole test, a short one and a longer sleep let it lapse."""

from __future__ import annotations

import asyncio

import pytest

from ragserve.http.errors import ApiError
from ragserve_router.fair_share import TenantDemand, fair_allocation
from ragserve_router.flow import FlowControl
from ragserve_router.metrics import RouterMetrics
from ragserve_router.priority import SHEDDABLE, STANDARD


def test_max_min_fair_allocation():
    assert fair_allocation({"light": 4, "heavy": 40}, 7) == {"light": 4, "heavy": 3}
    assert fair_allocation({"a": 40, "b": 40}, 7) == {"a": 4, "b": 3}
    assert fair_allocation({"a": 1, "b": 2, "c": 40}, 8) == {"a": 1, "b": 2, "c": 5}
    assert fair_allocation({"a": 5, "b": 5, "c": 5}, 2) == {"a": 1, "b": 1, "c": 0}
    assert fair_allocation({"a": 2}, 8) == {"a": 2}


def test_a_light_tenants_recent_demand_keeps_its_places_free_until_it_decays():
    asyncio.run(_recent_demand())


async def _recent_demand() -> None:
    flow = FlowControl(per_engine=8, queue_size=64, queue_timeout=60, metrics=RouterMetrics(), engines=lambda _: 1,
                       fair_share=True, demand=TenantDemand(half_life=60))  # fmt: skip
    light = [await flow.acquire("tiny", STANDARD, "light") for _ in range(3)]  # its three clients' requests
    heavy = [asyncio.create_task(flow.acquire("tiny", STANDARD, "heavy")) for _ in range(10)]
    for _ in range(3):  # each task admitted or queued in its first step
        await asyncio.sleep(0)
    assert flow.held["tiny", "heavy"] == 5 and flow.inflight["tiny"] == 8  # max-min: light 3, heavy 5
    for rank in light:  # its answers end: one place free for it (its next request), the rest to the heavy tenant
        flow.release("tiny", "light", rank)
    assert flow.held["tiny", "heavy"] == 7 and len(flow.waiting) == 3
    light = [await asyncio.wait_for(flow.acquire("tiny", STANDARD, "light"), timeout=1)]  # at once (heavy ones wait)
    back = [asyncio.create_task(flow.acquire("tiny", STANDARD, "light")) for _ in range(2)]
    await asyncio.sleep(0)
    assert len(flow.waiting) == 5
    flow.release("tiny", "heavy", heavy[0].result())  # the heavy tenant over its allocation (5 of 8): to light
    flow.release("tiny", "heavy", heavy[1].result())
    light += await asyncio.wait_for(asyncio.gather(*back), timeout=1)
    assert flow.held["tiny", "light"] == 3 and flow.held["tiny", "heavy"] == 5 and len(flow.waiting) == 3
    for rank in light:
        flow.release("tiny", "light", rank)
    assert flow.held["tiny", "heavy"] == 7  # the light tenant's demand still keeps one place free
    flow.demand.half_life = 0.01
    await asyncio.sleep(0.5)  # 50 half-lives: its demand is gone
    flow.dispatch("tiny")
    assert flow.held["tiny", "heavy"] == 8 and not flow.waiting
    for task in heavy:
        task.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)


def test_a_shed_request_adds_no_demand():
    asyncio.run(_shed_demand())


async def _shed_demand() -> None:
    flow = FlowControl(per_engine=2, queue_size=8, queue_timeout=60, metrics=RouterMetrics(), engines=lambda _: 1,
                       fair_share=True, demand=TenantDemand(half_life=60))  # fmt: skip
    for _ in range(2):
        await flow.acquire("tiny", STANDARD, "heavy")
    for _ in range(5):  # every place is held: each sheddable request is refused at once
        with pytest.raises(ApiError) as refused:
            await flow.acquire("tiny", SHEDDABLE, "bursty")
        assert refused.value.status == 429
    assert flow.demand.demands("tiny", flow.held + flow.queued) == {"heavy": 2}  # no share kept for "bursty"


def test_with_preempt_a_tenant_under_its_allocation_is_admitted_past_the_places_with_its_rank():
    asyncio.run(_preempt())


async def _preempt() -> None:
    flow = FlowControl(per_engine=4, queue_size=8, queue_timeout=60, metrics=RouterMetrics(), engines=lambda _: 1,
                       fair_share=True, preempt=True, demand=TenantDemand(half_life=60))  # fmt: skip
    heavy = [await flow.acquire("tiny", STANDARD, "heavy") for _ in range(4)]
    assert heavy == [0, 1, 2, 3]  # its ranks
    waiting = asyncio.create_task(flow.acquire("tiny", STANDARD, "heavy"))  # over its allocation: it waits
    await asyncio.sleep(0)
    assert len(flow.waiting) == 1
    # the light tenant's first two requests: under its allocation (1, then 2 of 4), past the places, ranks 0 and 1
    assert [await asyncio.wait_for(flow.acquire("tiny", STANDARD, "light"), 1) for _ in range(2)] == [0, 1]
    assert flow.inflight["tiny"] == 6 and len(flow.waiting) == 1
    with pytest.raises(TimeoutError):  # its third: light 2 + heavy 2 is the split, it is at its allocation
        await asyncio.wait_for(flow.acquire("tiny", STANDARD, "light"), 0.05)
    for rank in (3, 2):  # the heavy tenant's newest answers end: at its allocation (2), no place free, it waits
        flow.release("tiny", "heavy", rank)
    assert len(flow.waiting) == 1 and flow.inflight["tiny"] == 4
    flow.release("tiny", "heavy", 1)  # a place frees, and it is under its allocation (it holds 1, rank 0)
    assert await asyncio.wait_for(waiting, 1) == 1  # its rank: it held 1
    assert flow.held["tiny", "heavy"] == 2 and flow.held["tiny", "light"] == 2 and flow.inflight["tiny"] == 4


def test_a_request_never_ranks_below_an_older_one_of_its_tenant_still_running():
    asyncio.run(_rank_order())


async def _rank_order() -> None:
    """Ranks are fixed at admission: once a tenant's oldest answers end, its next request would rank by the places
    it holds (1) below its own rank-2 request still running, and the engine would preempt that older one for it.
    It ranks with it instead (the engine, at equal priority, neither preempts for the newer one nor keeps it over
    the older). Once the tenant's high ranks end, its ranks fall back to its places."""
    flow = FlowControl(per_engine=8, queue_size=8, queue_timeout=60, metrics=RouterMetrics(), engines=lambda _: 1,
                       fair_share=True, preempt=True, demand=TenantDemand(half_life=60))  # fmt: skip
    assert [await flow.acquire("tiny", STANDARD, "a") for _ in range(3)] == [0, 1, 2]
    flow.release("tiny", "a", 0)
    flow.release("tiny", "a", 1)  # it holds one place, rank 2
    assert await flow.acquire("tiny", STANDARD, "a") == 2  # not 1
    assert await flow.acquire("tiny", STANDARD, "b") == 0  # another tenant's ranks are its own
    flow.release("tiny", "a", 2)
    assert await flow.acquire("tiny", STANDARD, "a") == 2  # its other rank-2 request still runs
    flow.release("tiny", "a", 2)
    flow.release("tiny", "a", 2)
    assert flow.held["tiny", "a"] == 0 and ("tiny", "a") not in flow.ranks
    assert [await flow.acquire("tiny", STANDARD, "a") for _ in range(2)] == [0, 1]  # back to its places
