"""kv_aware's KV-room check with requests in flight, on the real index (MemoryState) and a real EnginePool's slots.

An engine's free count (its heartbeat) leaves out the blocks its running requests use. A request whose prompt
starts with the blocks a running request holds there shares them: it needs only the rest. Counting the whole
prompt made a hot document's engine look full and sent its next requests away to compute the document again
(bench/router_scale.py --real, 36 RAG requests on two SmolLM2 engines: 6 "spread" decisions, TTFT up to 30 s).

The free count is the heartbeat's: requests sent after it take blocks it does not show yet, until the next one.
"""

from __future__ import annotations

import time

import pytest

from ragserve.router_args import RouterConfig
from ragserve_router.cost_model import output_tokens
from ragserve_router.memory_state import MemoryState
from ragserve_router.metrics import RouterMetrics
from ragserve_router.policies import Decider
from ragserve_router.pool import EnginePool
from ragserve_router.state import STORED, KVOp
from tests.router.test_policies import h, measured, req, setup

DOC = [h(i) for i in range(100)]  # a 1,600-token document; with a question and 128 output tokens: 110 blocks


def fleet():
    """Three engines with room, e0 holding the document; a Decider over the pool's slots (as server.py builds)."""
    pool = EnginePool(RouterConfig(), MemoryState(), RouterMetrics())
    state, _, records, _ = setup()
    decider = Decider(
        RouterConfig(), state, pool.load, pool.kv_usage, pool.queued_prefill, pool.routed_blocks,
        pool.queued_prompts, held_blocks=pool.held_blocks, pending_blocks=pool.pending_blocks,
    )  # fmt: skip
    for r in records:
        r.load = measured(total_blocks=1024, free_blocks=900)
    return pool, state, records, decider


def question(i: int, body: dict | None = None):
    return req([*DOC, h(10**6 + i)], body=body, tokens=16 * 101 + 5)


def send(pool, decision, request):
    """Reserve the request on the engine the decision picked, as routing.py does."""
    first = decision.order[0]
    p = decision.predictions[first.engine_id]
    out = output_tokens(request.body)
    return pool.reserve(
        first, p.computed_tokens, request.key.hashes, output_tokens=out, fetched_tokens=p.fetched_tokens
    )


@pytest.mark.asyncio
async def test_blocks_a_running_request_holds_are_not_needed_again():
    pool, state, records, decider = fleet()
    await state.apply("e0", [KVOp(STORED, DOC)], 1)
    first = await decider.decide("kv_aware", question(0), records)
    e0 = first.order[0]
    assert e0.engine_id == "e0" and first.reason == "prefix_hit"
    slot = pool.reserve(e0, first.predictions["e0"].computed_tokens, question(0).key.hashes)
    assert pool.held_blocks(e0, question(1).key.hashes) == len(DOC)
    e0.load = measured(total_blocks=1024, free_blocks=50)  # 50 free: fewer than the 110 blocks of a whole request
    again = await decider.decide("kv_aware", question(1), records)
    assert again.order[0].engine_id == "e0" and again.reason == "prefix_hit"  # it needs 10 of them
    slot.first_token()  # prefilled, still decoding: its blocks are still in use
    assert (await decider.decide("kv_aware", question(2), records)).order[0].engine_id == "e0"
    slot.release()  # it ended: the document's blocks may be among the 50 free ones, taken out by a hit
    assert pool.held_blocks(e0, question(1).key.hashes) == 0
    away = await decider.decide("kv_aware", question(3), records)
    assert away.order[0].engine_id != "e0" and away.reason == "spread"


@pytest.mark.asyncio
async def test_a_burst_sent_after_the_heartbeat_counts_against_its_free_blocks():
    pool, state, records, decider = fleet()
    await state.apply("e0", [KVOp(STORED, DOC)], 1)
    short = {"prompt": "x", "max_tokens": 16}  # each question: 21 tokens to compute + 16 output = 3 blocks anew
    e0 = records[0]
    slots = [send(pool, await decider.decide("kv_aware", question(0, short), records), question(0, short))]
    e0.load = measured(total_blocks=1024, free_blocks=13, reported_at=time.time())  # counts question 0
    for i in range(1, 5):  # 4 x 3 blocks fit in 13, none of them in that heartbeat
        decision = await decider.decide("kv_aware", question(i, short), records)
        assert decision.order[0].engine_id == "e0" and decision.reason == "prefix_hit"
        slots.append(send(pool, decision, question(i, short)))  # running: held until released
    assert pool.pending_blocks(e0, 16) == 12
    away = await decider.decide("kv_aware", question(5, short), records)  # 12 + 3 > 13: it would preempt
    assert away.order[0].engine_id != "e0" and away.reason == "spread"
    e0.load = measured(total_blocks=1024, free_blocks=5, reported_at=time.time())  # counts the burst
    assert pool.pending_blocks(e0, 16) == 0
    back = await decider.decide("kv_aware", question(6, short), records)  # 3 of 5: subtracted once, not twice
    assert back.order[0].engine_id == "e0" and back.reason == "prefix_hit"


def test_blocks_fetched_from_the_store_count_as_pending():
    """A prompt the engine loads from the cachestore takes KV blocks there as a computed one does: until the next
    heartbeat counts them, they come off its free count (they used to be left out)."""
    pool, _, records, _ = fleet()
    e0 = records[0]
    e0.load = measured(total_blocks=1024, free_blocks=900, reported_at=time.time() - 1)
    pool.reserve(e0, 21, question(0).key.hashes, output_tokens=16, fetched_tokens=1600)
    assert pool.pending_blocks(e0, 16) == 103  # (21 computed + 1,600 fetched + 16 output) / 16, rounded up
