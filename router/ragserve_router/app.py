"""The OpenAI-compatible gateway (FastAPI): auth, limits, routing, proxying, health and metrics."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from ragserve import tracing
from ragserve.http.auth import ApiKeys, require_api_key
from ragserve.http.body import parse_json_object, read_body
from ragserve.http.errors import ApiError, install_error_handlers
from ragserve.http.limits import check_request
from ragserve.http.outcomes import CountResponses
from ragserve.router_args import POLICIES, RouterConfig
from ragserve_router.auth import LimitedKey, RateLimiter
from ragserve_router.engines import EngineRecord
from ragserve_router.metrics import RouterMetrics
from ragserve_router.policies import Decider, RouteRequest
from ragserve_router.pool import EnginePool
from ragserve_router.prompt import Tokenizers
from ragserve_router.proxy import Proxy
from ragserve_router.resume import ResumePlan, unresumable
from ragserve_router.state import RouterState
from ragserve_router.upstream import Routed

log = logging.getLogger(__name__)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
POLICY_HEADER = "x-ragserve-policy"


@dataclass
class Gateway:
    cfg: RouterConfig
    state: RouterState
    pool: EnginePool
    tokenizers: Tokenizers
    decider: Decider
    proxy: Proxy
    auth: ApiKeys
    limiter: RateLimiter
    metrics: RouterMetrics
    draining: bool = False
    _tasks: set[asyncio.Task] = field(default_factory=set)

    def background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def parse_body(raw: bytes) -> tuple[dict, str]:
    body = parse_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string", "missing_model", param="model")
    return body, model


async def assign_request_id(request: Request) -> None:
    """The client's X-Request-Id when well formed, else a new one; error answers carry it too."""
    given = request.headers.get("x-request-id", "")
    request.state.request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def create_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="ragserve router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    install_error_handlers(app, "router", log)
    app.add_middleware(CountResponses, count=gw.metrics.count)  # every answer once, by final status

    def rate_limit(request: Request, key: LimitedKey | None) -> None:
        try:
            gw.limiter.check(key.name if key else (request.client.host if request.client else "-"), key)
        except ApiError:
            gw.metrics.rate_limited.inc()
            raise

    auth = require_api_key(gw.auth, rate_limit)
    generate = [Depends(assign_request_id), auth]  # in this order: a 401 or 429 carries the request id

    async def route(request: Request, path: str, chat: bool) -> Response:
        started = time.monotonic()
        raw = await read_body(request, gw.cfg.max_body_bytes)
        routed = await _route(gw, request, path, raw, chat, started)
        attributes = _trace_attributes(routed) if tracing.enabled() else None
        with tracing.span("router.route", tracing.extract(request.headers), attributes):
            return await gw.proxy.forward(routed)

    @app.post("/v1/chat/completions", dependencies=generate)
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions", dependencies=generate)
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions", chat=False)

    @app.get("/v1/models", dependencies=[auth])
    async def models() -> Response:
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
        return Response(gw.metrics.render(gw.pool.models()), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _candidates(gw: Gateway, request: Request, model: str) -> list[EngineRecord]:
    """The healthy engines serving `model` (404 for a model nobody serves, 503 while none is up)."""
    if model not in gw.pool.models() and model not in gw.pool.served_models:
        raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", param="model")
    request.state.model = model  # a served model: a bounded metric label
    candidates = gw.pool.candidates(model)
    if not candidates:  # a model the cluster serves, with no engine up right now: come back soon
        retry = {"Retry-After": str(max(1, round(gw.cfg.probe_interval)))}
        raise ApiError(503, f"no healthy engine serves model `{model}` right now; try again", "no_engine", None, retry)
    return candidates


def _policy(gw: Gateway, request: Request) -> str:
    """--policy, or the client's X-Ragserve-Policy where --allow-policy-header lets it choose."""
    if gw.cfg.allow_policy_header and (wanted := request.headers.get(POLICY_HEADER)):
        if wanted not in POLICIES:
            raise ApiError(400, f"unknown policy {wanted!r}; use one of {', '.join(POLICIES)}", "invalid_policy")
        return wanted
    return gw.cfg.policy


async def _route(gw: Gateway, request: Request, path: str, raw: bytes, chat: bool, started: float) -> Routed:
    """Decide where the request goes and reserve its slot on the first engine of that order."""
    body, model = parse_body(raw)
    check_request(body, chat)  # the same limits the engine applies (ragserve.http.limits)
    candidates, policy = _candidates(gw, request, model), _policy(gw, request)
    t0 = time.monotonic()
    key = await gw.tokenizers.routing_key(gw.pool.spec(model), model, body, chat, len(raw))
    decision = await gw.decider.decide(policy, RouteRequest(model, body, chat, request.headers, key), candidates)
    first = decision.order[0]
    chosen = decision.predictions.get(first.engine_id)
    slot = gw.pool.reserve(first, chosen.computed_tokens if chosen else 0, key.hashes)  # no await since the decision
    gw.metrics.routing_latency.observe(time.monotonic() - t0)
    gw.metrics.decisions.labels(decision.policy, decision.reason).inc()
    if chosen:
        gw.metrics.observe_prediction(first.engine_id, chosen)
    request.state.policy = decision.policy
    if key.hashes:
        gw.background(_record(gw, key.hashes, first.engine_id))
    stream = body.get("stream") is True
    plan = ResumePlan(body, raw, chat, unresumable(body, chat, stream, gw.cfg.migration_limit, first))
    return Routed(request, request.state.request_id, model, path, raw, stream, decision, key, started, slot, plan)


def _trace_attributes(routed: Routed) -> dict:
    """The routing decision on the router's span: policy, reason, engine and its predicted cached tokens."""
    d, engine_id = routed.decision, routed.decision.order[0].engine_id
    attrs = {"ragserve.request_id": routed.request_id, "ragserve.policy": d.policy, "ragserve.reason": d.reason}
    attrs["ragserve.engine"] = engine_id
    if (predicted := d.predicted_cached_tokens(engine_id, routed.key)) is not None:
        attrs["ragserve.predicted_cached_tokens"] = predicted
    return attrs


async def _record(gw: Gateway, hashes: list[bytes], engine_id: str) -> None:
    try:
        await gw.state.record_route(hashes, engine_id)
    except Exception as exc:  # the approximate index is best effort
        log.debug("could not record route: %s", exc)
