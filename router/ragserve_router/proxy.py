"""Forward a routed request: retries before the first byte, SSE relayed chunk by chunk, disconnects cancel."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

import httpx
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ragserve.http.errors import ApiError
from ragserve_router.config import RouterConfig
from ragserve_router.engines import EngineRecord
from ragserve_router.metrics import RouterMetrics
from ragserve_router.policies import Decision
from ragserve_router.pool import CONNECT, SERVER_ERROR, TIMEOUT, EnginePool
from ragserve_router.prompt import RoutingKey

log = logging.getLogger(__name__)
CLIENT_CLOSED = 499
PASS_HEADERS = ("content-type", "cache-control")


class ClientGone(Exception):
    pass


@dataclass
class Routed:
    """One request on its way: what was decided and where it went."""

    request: Request
    request_id: str
    model: str
    path: str
    body: bytes
    stream: bool
    decision: Decision | None
    key: RoutingKey | None
    started: float


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
        return headers

    async def _connect(self, r: Routed) -> tuple[EngineRecord, httpx.Response]:
        """Send to engines in decision order until one answers with a status below 500."""
        failure = "unavailable"
        for attempt, engine in enumerate(r.decision.order[: self.cfg.max_attempts]):
            if attempt:
                self.metrics.retries.labels(failure).inc()
                await asyncio.sleep(self.cfg.retry_backoff * 2 ** (attempt - 1))
            health = self.pool.health[engine.engine_id]
            health.inflight += 1
            try:
                req = self.client.build_request("POST", engine.url + r.path, content=r.body, headers=self._headers(r))
                resp = await self.client.send(req, stream=True)
            except httpx.PoolTimeout:  # our own connection pool is full: not the engine's fault
                health.inflight -= 1
                raise ApiError(503, "the router is overloaded; try again", "overloaded") from None
            except httpx.TimeoutException:
                failure = TIMEOUT
            except httpx.HTTPError:
                failure = CONNECT
            except BaseException:
                health.inflight -= 1
                raise
            else:
                if resp.status_code < 500:
                    self.pool.mark_success(engine)
                    self.metrics.inflight.inc()
                    return engine, resp
                await resp.aclose()
                failure = SERVER_ERROR
            health.inflight -= 1
            self.pool.mark_failure(engine, failure)
            log.warning("request %s: engine %s failed (%s)", r.request_id, engine.engine_id, failure)
        status, message = (504, "the engine timed out") if failure == TIMEOUT else (502, "no engine could serve it")
        self.metrics.request_errors.labels(r.model, failure).inc()
        raise ApiError(status, f"request failed: {message}; try again", code=failure)

    def _response_headers(self, r: Routed, engine: EngineRecord, resp: httpx.Response) -> dict[str, str]:
        headers = {k: v for k, v in resp.headers.items() if k.lower() in PASS_HEADERS}
        headers["X-Ragserve-Engine"] = engine.engine_id
        headers["X-Request-Id"] = r.request_id
        return headers

    async def forward(self, r: Routed) -> Response:
        try:
            engine, resp = await race_disconnect(r.request, self._connect(r))
        except ClientGone:
            self.metrics.requests.labels(r.model, "", r.decision.policy, str(CLIENT_CLOSED)).inc()
            return Response(status_code=CLIENT_CLOSED)
        if r.stream and resp.status_code == 200:
            return self._relay(r, engine, resp)
        try:
            body = await race_disconnect(r.request, resp.aread())
        except (ClientGone, httpx.HTTPError) as exc:
            code = CLIENT_CLOSED if isinstance(exc, ClientGone) else 502
            self._finish(r, engine, code)
            if code == 502:
                raise ApiError(502, "the engine failed while answering; try again", code="upstream_error") from None
            return Response(status_code=CLIENT_CLOSED)
        finally:
            await resp.aclose()
        if resp.status_code == 200:
            self._account_usage(r, engine, _usage_of(body))
        self._finish(r, engine, resp.status_code)
        return Response(body, status_code=resp.status_code, headers=self._response_headers(r, engine, resp))

    def _relay(self, r: Routed, engine: EngineRecord, resp: httpx.Response) -> StreamingResponse:
        relay = Relay(self, r, engine, resp)
        headers = self._response_headers(r, engine, resp)
        # the background task also runs when the client left before the body started
        return StreamingResponse(relay.body(), status_code=200, headers=headers, background=BackgroundTask(relay.close))

    def _finish(self, r: Routed, engine: EngineRecord, code: int) -> None:
        self.pool.health[engine.engine_id].inflight -= 1
        self.metrics.inflight.dec()
        self.metrics.requests.labels(r.model, engine.engine_id, r.decision.policy, str(code)).inc()
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


class Relay:
    """One SSE stream from an engine to the client; close() runs exactly once, however it ends."""

    def __init__(self, proxy: Proxy, r: Routed, engine: EngineRecord, resp: httpx.Response) -> None:
        self.proxy, self.r, self.engine, self.resp = proxy, r, engine, resp
        self.sniffer = UsageSniffer()
        self.code = CLIENT_CLOSED  # until the stream completes
        self.closed = False

    async def body(self) -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in self.resp.aiter_raw():
                if first:
                    self.proxy.metrics.ttft.labels(self.r.model).observe(time.monotonic() - self.r.started)
                    first = False
                self.sniffer.feed(chunk)
                yield chunk
            self.code = 200
        except httpx.HTTPError as exc:  # headers were sent: the stream can only end early
            log.warning("request %s: engine %s broke the stream: %s", self.r.request_id, self.engine.engine_id, exc)
            self.proxy.pool.mark_failure(self.engine, CONNECT)
            self.code = 502
        finally:
            await self.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.resp.aclose()
        self.proxy._account_usage(self.r, self.engine, self.sniffer.usage)
        self.proxy._finish(self.r, self.engine, self.code)


class UsageSniffer:
    """Finds the `usage` object in an SSE stream without holding the stream back."""

    def __init__(self) -> None:
        self.tail = b""
        self.usage: dict | None = None

    def feed(self, chunk: bytes) -> None:
        lines = (self.tail + chunk).split(b"\n")
        self.tail = lines.pop()[-65536:] if lines else b""
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                usage = _usage_of(line[5:].strip())
                if usage:
                    self.usage = usage
