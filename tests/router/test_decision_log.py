"""kv_aware's per-decision record (DEBUG on ragserve_router.kv_aware): every candidate's cost-model terms, best
first, so a "spread" (the engine holding the prompt ranked behind another) can be told apart: queued prefill, the
decode load, or no KV room. On the real index (MemoryState) and a real EnginePool's slots."""

from __future__ import annotations

import logging
import time

import pytest

from ragserve_router.state import STORED, KVOp
from tests.router.test_kv_room_held import DOC, fleet, question
from tests.router.test_policies import measured


def terms(line: str, engine: str) -> dict[str, str]:
    """One engine's `name=value` terms in a decision record."""
    part = next(p for p in line.split(": ", 1)[1].split("; ") if p.startswith(engine + " "))
    return dict(kv.split("=") for kv in part.split()[1:])


@pytest.mark.asyncio
async def test_a_spread_is_logged_with_the_term_that_made_it(caplog):
    pool, state, records, decider = fleet()
    await state.apply("e0", [KVOp(STORED, DOC)], 1)
    records[0].load = measured(total_blocks=1024, free_blocks=900, queued_prefill_tokens=6000, reported_at=time.time())
    with caplog.at_level(logging.DEBUG, logger="ragserve_router.kv_aware"):
        decision = await decider.decide("kv_aware", question(0), records)
    assert decision.reason == "spread" and decision.order[0].engine_id != "e0"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_aware ")]
    assert line.startswith("kv_aware spread: " + decision.order[0].engine_id)
    warm, cold = terms(line, "e0"), terms(line, decision.order[0].engine_id)
    assert (warm["local"], warm["queued"], warm["full"]) == ("1600", "6000/1", "False")
    assert (cold["local"], cold["queued"], cold["computed"]) == ("0", "0/1", "1621")
    assert float(warm["cost"]) > float(cold["cost"]) and float(warm["ttft"]) > float(cold["ttft"])
    chosen = decision.order[0]
    pool.reserve(chosen, 1621, question(0).key.hashes)  # it holds the document's 100 blocks there now
    chosen.load = measured(total_blocks=1024, free_blocks=5, reported_at=time.time())  # 5 of the 10 more it needs
    with caplog.at_level(logging.DEBUG, logger="ragserve_router.kv_aware"):
        await decider.decide("kv_aware", question(1), records)
    assert terms(caplog.records[-1].getMessage(), chosen.engine_id)["full"] == "True"
