"""The router queue when a waiting request's client leaves at the moment its place is granted (the release that
grants it and the cancel in the same turn of the event loop): the request must end cancelled and the place go
back. On Python 3.11 asyncio.wait_for returned the granted place instead of raising, the request went on to take an
engine slot nobody released, and after enough of them every place was gone (bench/flow_fairness's 503s)."""

from __future__ import annotations

import asyncio

import pytest

from ragserve_router.flow import FlowControl
from ragserve_router.metrics import RouterMetrics
from ragserve_router.priority import STANDARD


def test_a_waiter_cancelled_as_its_place_is_granted_gives_the_place_back():
    asyncio.run(_cancelled_as_granted())


async def _cancelled_as_granted() -> None:
    flow = FlowControl(per_engine=1, queue_size=8, queue_timeout=60, metrics=RouterMetrics(), engines=lambda _: 1)
    rank = await flow.acquire("tiny", STANDARD, "a")  # holds the only place
    waiting = asyncio.create_task(flow.acquire("tiny", STANDARD, "b"))
    while not flow.waiting:
        await asyncio.sleep(0)
    flow.release("tiny", "a", rank)  # grants the place to the waiter...
    waiting.cancel()  # ...whose client leaves before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert flow.inflight["tiny"] == 0 and not flow.held and not flow.ranks and not flow.waiting
