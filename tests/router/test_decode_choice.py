"""kv_aware's choice of a decode engine (docs/disaggregation.md): the prompt is computed elsewhere, so the decode
engines differ by their decode load and their KV room. On the real index (MemoryState) with controlled loads."""

from __future__ import annotations

import pytest

from ragserve_router.cost_model import kv_room
from ragserve_router.engines import Load
from tests.router.test_policies import h, measured, req, setup

PROMPT = 16 * 100 + 5  # a 1,605-token RAG prompt, 128 output tokens: 109 blocks of 16


def decode_fleet(**cfg):
    state, loads, records, decider = setup(**cfg)
    for r in records:
        r.role, r.load = "decode", measured(total_blocks=1024, free_blocks=900)
    return loads, records, decider


def rag_request():
    return req([h(i) for i in range(100)], body={"prompt": "x", "max_tokens": 128}, tokens=PROMPT)


def test_kv_room_counts_prompt_and_output_blocks():
    assert kv_room(Load(total_blocks=1024, free_blocks=109), PROMPT + 128, 16)
    assert not kv_room(Load(total_blocks=1024, free_blocks=108), PROMPT + 128, 16)
    assert kv_room(Load(), PROMPT + 128, 16)  # no block counts reported: not held against it


@pytest.mark.asyncio
async def test_decode_engine_by_decode_load():
    loads, records, decider = decode_fleet()
    loads.update(e0=6, e1=1, e2=3)  # sequences decoding on each
    decision = await decider.decide("kv_aware", rag_request(), records)
    assert [r.engine_id for r in decision.order] == ["e1", "e2", "e0"]


@pytest.mark.asyncio
async def test_decode_engine_without_kv_room_ranks_last():
    loads, records, decider = decode_fleet()
    loads.update(e0=6, e1=1, e2=3)
    records[1].load = measured(total_blocks=1024, free_blocks=50)  # the least loaded one is nearly full
    decision = await decider.decide("kv_aware", rag_request(), records)
    assert [r.engine_id for r in decision.order] == ["e2", "e0", "e1"]
    for r in records:  # none has room: decode load decides again
        r.load = measured(total_blocks=1024, free_blocks=50)
    decision = await decider.decide("kv_aware", rag_request(), records)
    assert [r.engine_id for r in decision.order] == ["e1", "e2", "e0"]
