"""Forward a routed request: retries before the first byte (upstream.py), SSE relayed (and migrated) by relay.py,
disconnects cancel. A non-streamed answer the client has seen nothing of is sent again elsewhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from ragserve.http.direct_request import DirectRequest
from ragserve.http.errors import ERROR_SCOPE_HEADER, ApiError
from ragserve.router_args import RouterConfig
from ragserve_router.engine_client import EngineResponse
from ragserve_router.engines import CONNECT, EngineRecord
from ragserve_router.metrics import RouterMetrics
from ragserve_router.pool import EnginePool
from ragserve_router.relay import Relay
from ragserve_router.upstream import Routed, Upstream

CLIENT_CLOSED = 499
PASS_HEADERS = ("content-type", "cache-control", ERROR_SCOPE_HEADER)


class ClientGone(Exception):
    pass


class _Broken(Exception):
    def __init__(self, engine: EngineRecord) -> None:
        self.engine = engine


async def race_disconnect(request: DirectRequest, work: Awaitable, orphan: Callable[[Any], None] | None = None):
    """Await work unless the client goes away first (then cancel it and raise ClientGone). `orphan` gets the
    result of work that finished all the same (a cancel it swallowed), so what it holds can be let go.

    The work runs in the caller's task, which the request's disconnect callback cancels (no watcher task)."""
    if request.disconnected:
        if isinstance(work, Coroutine):
            work.close()
        raise ClientGone
    task = asyncio.current_task()
    gone = False

    def on_gone() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    request.on_gone = on_gone
    result, failed = None, False
    try:
        result = await work
    except BaseException:
        if not gone:
            raise
        failed = True  # cancelled, or failing as it was
    finally:
        request.on_gone = None
    if gone:
        task.uncancel()
        if orphan is not None and not failed:  # the work swallowed the cancel and finished
            orphan(result)
        raise ClientGone
    return result


class Proxy:
    def __init__(self, cfg: RouterConfig, pool: EnginePool, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.upstream = Upstream(cfg, pool, metrics)

    def _response_headers(self, r: Routed, engine: EngineRecord, resp: EngineResponse) -> dict[str, str]:
        headers = {k: v for k, v in resp.headers.items() if k.lower() in PASS_HEADERS}
        headers["X-Ragserve-Engine"] = engine.engine_id
        headers["X-Request-Id"] = r.request_id
        headers.update(r.claim.headers)  # the tenant's x-ratelimit-* (quotas.py), when it has a token quota
        # why it went there, and kv_aware's prediction (the model's error, per request)
        headers["X-Ragserve-Route-Reason"] = r.decision.reason
        if (p := r.decision.predictions.get(engine.engine_id)) is not None:
            headers["X-Ragserve-Predicted-Ttft-Ms"] = f"{1000 * p.ttft_s:.0f}"
        return headers

    async def forward(self, r: Routed) -> Response:
        """Non-streamed answers the client has seen nothing of are sent again elsewhere if the engine dies."""
        engines, tried, body = r.decision.order, set(), r.plan.upstream_body()
        try:
            for resend in range(self.cfg.migration_limit + 1):
                try:
                    engine, resp, data = await race_disconnect(r.request, self._exchange(r, engines, body))
                except _Broken as broken:
                    self.pool.mark_failure(broken.engine, CONNECT)
                    tried.add(broken.engine.engine_id)
                    engines = self.upstream.fallbacks(r, tried)
                    if resend < self.cfg.migration_limit and engines:
                        self.metrics.migrations.labels("resent").inc()
                        continue
                    self.upstream.finish(r, broken.engine)
                    raise ApiError(502, "the engine failed while answering; try again", "upstream_error") from None
                if data is None:
                    return self._relay(r, engine, resp)
                self.upstream.finish(r, engine, _usage_of(data) if resp.status_code == 200 else None)
                return Response(data, status_code=resp.status_code, headers=self._response_headers(r, engine, resp))
        except ClientGone:
            r.slot.release()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            r.slot.release()
            raise
        raise AssertionError("unreachable")

    async def _exchange(self, r: Routed, engines: list[EngineRecord], body: bytes):
        """Send, and read a whole answer: (engine, response, its body), or no body for a stream to relay (one task
        for the client's disconnect to cancel). _Broken: the engine failed while answering."""
        engine, resp = await self.upstream.connect(r, engines, body)
        if r.stream and resp.status_code == 200:
            return engine, resp, None
        try:
            return engine, resp, await resp.aread()
        except httpx.HTTPError:
            raise _Broken(engine) from None
        finally:
            await resp.aclose()

    def _relay(self, r: Routed, engine: EngineRecord, resp: EngineResponse) -> StreamingResponse:
        relay = Relay(self.upstream, r, engine, resp)
        headers = self._response_headers(r, engine, resp)
        # the background task also runs when the client left before the body started
        return StreamingResponse(relay.body(), status_code=200, headers=headers, background=BackgroundTask(relay.close))

    async def close(self) -> None:
        await self.upstream.close()


def _usage_of(body: bytes) -> dict | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data.get("usage") if isinstance(data, dict) else None
