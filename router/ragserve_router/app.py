"""The OpenAI-compatible gateway (FastAPI): auth, limits, routing, proxying, health and metrics."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragserve.http.body import parse_json_object
from ragserve.http.body import read_body as _read_body
from ragserve_router.auth import Authenticator, RateLimiter
from ragserve_router.config import POLICIES, RouterConfig
from ragserve_router.errors import RouterError, error_response
from ragserve_router.metrics import RouterMetrics
from ragserve_router.policies import Policies, RouteRequest
from ragserve_router.pool import EnginePool
from ragserve_router.prompt import Tokenizers
from ragserve_router.proxy import Proxy, Routed
from ragserve_router.state import RouterState

log = logging.getLogger(__name__)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
POLICY_HEADER = "x-ragserve-policy"


@dataclass
class Gateway:
    cfg: RouterConfig
    state: RouterState
    pool: EnginePool
    tokenizers: Tokenizers
    policies: Policies
    proxy: Proxy
    auth: Authenticator
    limiter: RateLimiter
    metrics: RouterMetrics
    draining: bool = False
    _tasks: set[asyncio.Task] = field(default_factory=set)

    def background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def read_body(request: Request, limit: int) -> bytes:
    return await _read_body(request, limit, RouterError)


def parse_body(raw: bytes) -> tuple[dict, str]:
    body = parse_json_object(raw, RouterError)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RouterError(400, "'model' is required and must be a string", "missing_model", param="model")
    return body, model


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def create_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="ragserve router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, message, "not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return error_response(500, "internal router error", "internal_error")

    def authorize(request: Request) -> None:
        key = gw.auth.check(request.headers.get("authorization"))
        try:
            gw.limiter.check(key.name if key else (request.client.host if request.client else "-"), key)
        except RouterError:
            gw.metrics.rate_limited.inc()
            raise

    async def route(request: Request, path: str, chat: bool) -> Response:
        request_id = _request_id(request)
        started = time.monotonic()
        try:
            authorize(request)
            raw = await read_body(request, gw.cfg.max_body_bytes)
            body, model = parse_body(raw)
            routed = Routed(request, request_id, model, path, raw, body.get("stream") is True, None, None, started)
            return await _dispatch(gw, routed, body, chat)
        except RouterError as err:
            return err.response(request_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions", chat=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except RouterError as err:
            return err.response()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "ragserve"} for m in gw.pool.models()]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        status = {
            "status": "draining" if gw.draining else "ready",
            "engines": len(gw.pool.all()),
            "healthy_engines": len(gw.pool.healthy()),
        }
        return JSONResponse(status, status_code=503 if gw.draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _dispatch(gw: Gateway, routed: Routed, body: dict, chat: bool) -> Response:
    model, request = routed.model, routed.request
    if model not in gw.pool.models():
        gw.metrics.request_errors.labels("", "model_not_found").inc()
        raise RouterError(404, f"The model `{model}` does not exist.", "model_not_found", param="model")
    candidates = gw.pool.candidates(model)
    if not candidates:
        gw.metrics.request_errors.labels(model, "no_healthy_engine").inc()
        raise RouterError(503, f"no healthy engine serves model `{model}` right now; try again", "no_engine")
    policy = gw.cfg.policy
    if gw.cfg.allow_policy_header and (wanted := request.headers.get(POLICY_HEADER)):
        if wanted not in POLICIES:
            raise RouterError(400, f"unknown policy {wanted!r}; use one of {', '.join(POLICIES)}", "invalid_policy")
        policy = wanted
    t0 = time.monotonic()
    key = await gw.tokenizers.routing_key(gw.pool.spec(model), model, body, chat, len(routed.body))
    decision = await gw.policies.decide(policy, RouteRequest(model, body, chat, request.headers, key), candidates)
    gw.metrics.routing_latency.observe(time.monotonic() - t0)
    gw.metrics.decisions.labels(decision.policy, decision.reason).inc()
    if key.hashes:
        gw.background(_record(gw, key.hashes, decision.order[0].engine_id))
    routed.decision, routed.key = decision, key
    return await gw.proxy.forward(routed)


async def _record(gw: Gateway, hashes: list[bytes], engine_id: str) -> None:
    try:
        await gw.state.record_route(hashes, engine_id)
    except Exception as exc:  # the approximate index is best effort
        log.debug("could not record route: %s", exc)
