"""Forward a routed request: retries before the first byte, SSE relayed (and migrated) by relay.py, disconnects cancel.

A failure the engine marks as the request's own (every 4xx, a 5xx with `x-ragserve-error-scope: request`) is the
client's answer: passed through, never replayed elsewhere, never held against the engine's health.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import httpx
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ragserve import tracing
from ragserve.http.errors import ERROR_SCOPE_HEADER, REQUEST_SCOPE, ApiError
from ragserve.router_args import RouterConfig
from ragserve_router.engines import CONNECT, SERVER_ERROR, TIMEOUT, EngineRecord
from ragserve_router.metrics import RouterMetrics
from ragserve_router.policies import Decision
from ragserve_router.pool import EnginePool, Slot
from ragserve_router.prompt import RoutingKey
from ragserve_router.resume import ResumePlan

log = logging.getLogger(__name__)
CLIENT_CLOSED = 499
PASS_HEADERS = ("content-type", "cache-control", ERROR_SCOPE_HEADER)


class ClientGone(Exception):
    pass


@dataclass
class Routed:
    """One request on its way: what was decided, where it went, and the slot it holds there."""

    request: Request
    request_id: str
    model: str
    path: str
    body: bytes
    stream: bool
    decision: Decision | None
    key: RoutingKey | None
    started: float
    slot: Slot | None = None
    plan: ResumePlan | None = None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(request: Request, work: Awaitable):
    """Await work unless the client goes away first (then cancel it and raise ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


def request_scoped(resp: httpx.Response) -> bool:
    """The engine's answer is about this request alone: the client gets it as it is."""
    scope = resp.headers.get(ERROR_SCOPE_HEADER, "")
    return resp.status_code < 500 or scope == REQUEST_SCOPE


class Proxy:
    def __init__(self, cfg: RouterConfig, pool: EnginePool, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        timeout = httpx.Timeout(cfg.upstream_timeout, connect=cfg.connect_timeout)
        limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256, keepalive_expiry=30)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    def _headers(self, r: Routed) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": r.request_id}
        if accept := r.request.headers.get("accept"):
            headers["Accept"] = accept
        if self.cfg.engine_api_key:
            headers["Authorization"] = f"Bearer {self.cfg.engine_api_key}"
        return headers | tracing.headers()

    async def connect(self, r: Routed, engines: list[EngineRecord], body: bytes) -> tuple[EngineRecord, httpx.Response]:
        """Send to engines in order (at most --max-attempts) until one answers or fails for the request's own
        reasons; the request's slot moves along."""
        failure = "unavailable"
        for attempt, engine in enumerate(engines[: self.cfg.max_attempts]):
            if attempt:
                self.metrics.retries.labels(failure).inc()
                await asyncio.sleep(self.cfg.retry_backoff * 2 ** (attempt - 1))
            if r.slot.engine.engine_id != engine.engine_id:
                r.slot.move(engine)
            try:
                req = self.client.build_request("POST", engine.url + r.path, content=body, headers=self._headers(r))
                resp = await self.client.send(req, stream=True)
            except httpx.PoolTimeout:  # our own connection pool is full: not the engine's fault
                raise ApiError(503, "the router is overloaded; try again", "overloaded") from None
            except httpx.TimeoutException:
                failure = TIMEOUT
            except httpx.HTTPError:
                failure = CONNECT
            else:
                if request_scoped(resp):
                    if resp.status_code < 500:
                        self.pool.mark_success(engine)
                    return engine, resp
                await resp.aclose()
                failure = SERVER_ERROR
            self.pool.mark_failure(engine, failure)
            log.warning("request %s: engine %s failed (%s)", r.request_id, engine.engine_id, failure)
        status, message = (504, "the engine timed out") if failure == TIMEOUT else (502, "no engine could serve it")
        raise ApiError(status, f"request failed: {message}; try again", code=failure)

    def fallbacks(self, r: Routed, tried: set[str], only_registered: bool = False) -> list[EngineRecord]:
        """Healthy engines for the model not tried yet: the decision's order first, then the least loaded."""
        rank = {e.engine_id: i for i, e in enumerate(r.decision.order)}
        left = [e for e in self.pool.candidates(r.model) if e.engine_id not in tried]
        if only_registered:
            left = [e for e in left if e.has_events]
        return sorted(left, key=lambda e: (rank.get(e.engine_id, len(rank)), self.pool.load(e)))

    def _response_headers(self, r: Routed, engine: EngineRecord, resp: httpx.Response) -> dict[str, str]:
        headers = {k: v for k, v in resp.headers.items() if k.lower() in PASS_HEADERS}
        headers["X-Ragserve-Engine"] = engine.engine_id
        headers["X-Request-Id"] = r.request_id
        if r.decision is not None:  # why it went there, and kv_aware's prediction (the model's error, per request)
            headers["X-Ragserve-Route-Reason"] = r.decision.reason
            if (p := r.decision.predictions.get(engine.engine_id)) is not None:
                headers["X-Ragserve-Predicted-Ttft-Ms"] = f"{1000 * p.ttft_s:.0f}"
        return headers

    async def forward(self, r: Routed) -> Response:
        """Non-streamed answers the client has seen nothing of are sent again elsewhere if the engine dies."""
        engines, tried, body = r.decision.order, set(), r.plan.upstream_body()
        try:
            for resend in range(self.cfg.migration_limit + 1):
                engine, resp = await race_disconnect(r.request, self.connect(r, engines, body))
                if r.stream and resp.status_code == 200:
                    return self._relay(r, engine, resp)
                try:
                    data = await race_disconnect(r.request, resp.aread())
                except httpx.HTTPError:
                    self.pool.mark_failure(engine, CONNECT)
                    tried.add(engine.engine_id)
                    engines = self.fallbacks(r, tried)
                    if resend < self.cfg.migration_limit and engines:
                        self.metrics.migrations.labels("resent").inc()
                        continue
                    self._finish(r, engine)
                    raise ApiError(502, "the engine failed while answering; try again", "upstream_error") from None
                finally:
                    await resp.aclose()
                if resp.status_code == 200:
                    self._account_usage(r, engine, _usage_of(data))
                self._finish(r, engine)
                return Response(data, status_code=resp.status_code, headers=self._response_headers(r, engine, resp))
        except ClientGone:
            r.slot.release()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            r.slot.release()
            raise
        raise AssertionError("unreachable")

    def _relay(self, r: Routed, engine: EngineRecord, resp: httpx.Response) -> StreamingResponse:
        from ragserve_router.relay import Relay

        relay = Relay(self, r, engine, resp)
        headers = self._response_headers(r, engine, resp)
        # the background task also runs when the client left before the body started
        return StreamingResponse(relay.body(), status_code=200, headers=headers, background=BackgroundTask(relay.close))

    def _finish(self, r: Routed, engine: EngineRecord) -> None:
        r.slot.release()
        r.request.state.engine = engine.engine_id  # the answer is counted by ragserve.http.outcomes
        self.metrics.latency.labels(r.model).observe(time.monotonic() - r.started)

    def _account_usage(self, r: Routed, engine: EngineRecord, usage: dict | None) -> None:
        """Routing accuracy: predicted cached tokens vs. what the engine reports (when it does)."""
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details") or {}
        actual = details.get("cached_tokens") if isinstance(details, dict) else None
        predicted = r.decision.predicted_cached_tokens(engine.engine_id, r.key)
        if isinstance(usage.get("prompt_tokens"), int):
            self.metrics.prompt_tokens.labels(engine.engine_id).inc(usage["prompt_tokens"])
        if isinstance(actual, int) and predicted is not None:
            self.metrics.predicted_cached.labels(engine.engine_id).inc(predicted)
            self.metrics.actual_cached.labels(engine.engine_id).inc(actual)

    async def close(self) -> None:
        await self.client.aclose()


def _usage_of(body: bytes) -> dict | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data.get("usage") if isinstance(data, dict) else None
