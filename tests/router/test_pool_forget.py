"""The pool forgets the health and breaker of an engine that left: a request that ended after its engine was
dropped marks it again, which recreated both entries for good (a small leak per engine that ever left)."""

from __future__ import annotations

import pytest

from ragserve.router_args import RouterConfig
from ragserve_router.engines import CONNECT, EngineRecord, TokenizerBlob
from ragserve_router.memory_state import MemoryState
from ragserve_router.metrics import RouterMetrics
from ragserve_router.pool import EnginePool

BLOB = TokenizerBlob('{"fake": "tokenizer"}', "{{ messages }}", {"eos_token": "</s>"})


@pytest.mark.asyncio
async def test_an_engine_that_left_keeps_no_health_or_breaker():
    state = MemoryState()
    pool = EnginePool(RouterConfig(), state, RouterMetrics())
    record = EngineRecord("gone", "http://127.0.0.1:1", ["m"], model_id="m@1", block_size=16)
    await state.register(record, BLOB, 30)
    await pool.refresh()
    pool.mark_failure(record, CONNECT)
    assert not pool.health["gone"].healthy and "gone" in pool.breakers
    await state.drop("gone")
    pool.mark_failure(record, CONNECT)  # requests that ended after the engine left
    pool.mark_success(record)
    await pool.refresh()
    assert "gone" not in pool.health and "gone" not in pool.breakers
    await state.register(record, BLOB, 30)  # back under the same id: a fresh start
    await pool.refresh()
    assert [r.engine_id for r in pool.healthy()] == ["gone"] and pool.breaker("gone").state == "closed"
    await pool.probe_client.aclose()
