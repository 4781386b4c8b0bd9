"""kv_aware keeps the candidates' calibrated speeds (cost_model.FleetSpeeds) between decisions: a heartbeat that
replaces an engine's load must show in the next decision, its own speed and the fleet medians its peers borrow."""

from __future__ import annotations

import pytest

from ragserve.router_args import RouterConfig
from ragserve.v1 import registry_pb2
from ragserve_router.cost_model import FleetSpeeds, calibrate
from ragserve_router.engines import EngineRecord, Load, TokenizerBlob
from ragserve_router.memory_state import MemoryState
from ragserve_router.policies import Decider, RouteRequest
from ragserve_router.prompt import RoutingKey

IDS = ("e0", "e1", "e2")
REQUEST = RouteRequest("m", {"prompt": "x", "max_tokens": 8}, False, {}, RoutingKey([], 16, 900))


def heartbeat(prefill_tokens_per_s: float, step_s: float = 0.05) -> Load:
    """What the registry makes of an engine's heartbeat: a new Load."""
    return Load(
        prefill_tokens_per_s=prefill_tokens_per_s, decode_step_s=step_s, decode_seq_s=0.005, step_token_budget=2048,
        decode_path=registry_pb2.DECODE_EAGER, decode_seq_measured=True,
    )  # fmt: skip


async def fleet() -> tuple[MemoryState, list[EngineRecord]]:
    """e0 and e1 measured, e2 not yet (it borrows the fleet's medians), registered in the real state."""
    state = MemoryState()
    for engine_id in IDS:
        record = EngineRecord(engine_id, f"http://127.0.0.1:1/{engine_id}", ["m"], model_id="m@1", block_size=16)
        await state.register(record, TokenizerBlob("{}", None, {}), ttl_s=60)
    await state.heartbeat("e0", heartbeat(1000.0), 60)
    await state.heartbeat("e1", heartbeat(1000.0), 60)
    return state, await state.engines()


def decider(state: MemoryState) -> Decider:
    return Decider(RouterConfig(), state, lambda r: 0.0, lambda r: 0.0)


async def uncached(state: MemoryState, records: list[EngineRecord]) -> dict:
    """The predictions of a Decider that never decided before (nothing kept)."""
    return (await decider(state).decide("kv_aware", REQUEST, records)).predictions


@pytest.mark.asyncio
async def test_a_heartbeat_changes_the_next_decision_as_if_nothing_was_kept():
    state, records = await fleet()
    kept = decider(state)
    first = await kept.decide("kv_aware", REQUEST, records)
    assert first.predictions == await uncached(state, records)
    await state.heartbeat("e1", heartbeat(4000.0), 60)  # e1 got faster: it wins now
    second = await kept.decide("kv_aware", REQUEST, records)
    assert second.predictions == await uncached(state, records)
    assert second.order[0].engine_id == "e1" and second.predictions["e1"].cost < first.predictions["e1"].cost


@pytest.mark.asyncio
async def test_a_peers_heartbeat_moves_the_medians_an_unmeasured_engine_borrows():
    state, records = await fleet()
    kept = decider(state)
    before = (await kept.decide("kv_aware", REQUEST, records)).predictions["e2"]
    await state.heartbeat("e0", heartbeat(3000.0, step_s=0.01), 60)  # e2's own load is the same object
    after = (await kept.decide("kv_aware", REQUEST, records)).predictions
    assert after == await uncached(state, records) and after["e2"].ttft_s < before.ttft_s


@pytest.mark.asyncio
async def test_fleet_speeds_are_calibrate_and_are_kept_until_a_load_is_replaced():
    state, records = await fleet()
    speeds, loads = FleetSpeeds(), [r.load for r in records]
    first = speeds.of(IDS, loads, 16)
    assert first == tuple(calibrate(load, loads, 16) for load in loads)
    assert speeds.of(IDS, list(loads), 16) is first  # the same loads: kept
    assert speeds.of(IDS, loads, 32) == tuple(calibrate(load, loads, 32) for load in loads)  # another block size
    await state.heartbeat("e2", heartbeat(500.0), 60)
    loads = [r.load for r in records]
    assert speeds.of(IDS, loads, 16) == tuple(calibrate(load, loads, 16) for load in loads) != first
