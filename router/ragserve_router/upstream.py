"""Sending one routed request to the engines: tried in order before the first byte, finished once.

A failure the engine marks as the request's own (every 4xx, a 5xx with `x-ragserve-error-scope: request`) is the
client's answer: passed through, never replayed elsewhere, never held against the engine's health.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from ragserve import tracing
from ragserve.http.direct_request import DirectRequest
from ragserve.http.errors import ERROR_SCOPE_HEADER, REQUEST_SCOPE, ApiError
from ragserve.router_args import RouterConfig
from ragserve_router.disagg import decodes
from ragserve_router.engine_client import EngineHTTP, EngineResponse
from ragserve_router.engines import CONNECT, SERVER_ERROR, TIMEOUT, EngineRecord
from ragserve_router.metrics import RouterMetrics
from ragserve_router.pool import EnginePool
from ragserve_router.resume import ResumePlan
from ragserve_router.retry import backoff
from ragserve_router.routing import Picked

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Routed(Picked):
    """One HTTP request on its way: the decision and the slot it holds (which moves with it), and how it resumes."""

    request: DirectRequest
    request_id: str
    path: str
    body: bytes
    stream: bool
    plan: ResumePlan
    prefill_s: float  # its prefill leg (disagg.py), 0 when none ran

    def first_token(self, metrics: RouterMetrics, engine_id: str) -> float:
        elapsed = super().first_token(metrics, engine_id)
        if self.prefill_s:  # TTFT = prefill leg + decode leg: the leg is ragserve_router_disagg_prefill_seconds
            metrics.disagg_decode_ttft.observe(elapsed - self.prefill_s)
        return elapsed


def request_scoped(resp: EngineResponse) -> bool:
    """The engine's answer is about this request alone: the client gets it as it is."""
    scope = resp.headers.get(ERROR_SCOPE_HEADER, "")
    return resp.status_code < 500 or scope == REQUEST_SCOPE


class Upstream:
    """The engines' side of the proxy: one HTTP client (a pool per engine, engine_client.py), the retry order, and
    each request's end."""

    def __init__(self, cfg: RouterConfig, pool: EnginePool, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.http = EngineHTTP(cfg)  # the proxied requests and the prefill legs (disagg.py)

    def headers(self, r: Routed) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": r.request_id}
        if accept := r.request.headers.get("accept"):
            headers["Accept"] = accept
        if self.cfg.engine_api_key:
            headers["Authorization"] = f"Bearer {self.cfg.engine_api_key}"
        return headers | tracing.headers()

    async def connect(self, r: Routed, engines: list[EngineRecord], body: bytes) -> tuple[EngineRecord, EngineResponse]:
        """Send to engines in order (at most --max-attempts) until one answers or fails for the request's own
        reasons; the request's slot moves along."""
        failure = "unavailable"
        for attempt, engine in enumerate(engines[: self.cfg.max_attempts]):
            if attempt:
                self.metrics.retries.labels(failure).inc()
                await asyncio.sleep(backoff(self.cfg, attempt))
            if r.slot.engine.engine_id != engine.engine_id:
                r.slot.move(engine)
            try:
                resp = await self.http.post(engine.url + r.path, self.headers(r), body)
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
        left = [e for e in self.pool.candidates(r.model) if e.engine_id not in tried and decodes(e)]
        if only_registered:
            left = [e for e in left if e.has_events]
        return sorted(left, key=lambda e: (rank.get(e.engine_id, len(rank)), self.pool.load(e)))

    def finish(self, r: Routed, engine: EngineRecord, usage: dict | None = None) -> None:
        """The request is over on `engine` (routing.Picked.finish); its answer is credited to the engine
        (ragserve.http.outcomes counts it)."""
        r.finish(self.metrics, engine.engine_id, usage)
        r.request.state.engine = engine.engine_id

    async def close(self) -> None:
        await self.http.aclose()
