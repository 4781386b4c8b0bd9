"""The OpenAI-compatible gateway (FastAPI; the generate endpoints answered by the HTTP protocol itself:
fast_routes.py): auth, limits, routing, proxying, health and metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp

from ragserve import tracing
from ragserve.http.auth import ApiKeys, require_api_key
from ragserve.http.body import read_body
from ragserve.http.direct import Direct, Handler
from ragserve.http.direct_request import DirectRequest
from ragserve.http.errors import ApiError, install_error_handlers
from ragserve.http.outcomes import CountResponses
from ragserve_router.admin import install_admin
from ragserve_router.auth import LimitedKey, RateLimiter
from ragserve_router.disagg import prefill_engines, run_prefill
from ragserve_router.fast_routes import front
from ragserve_router.priority import tenant_of
from ragserve_router.proxy import CLIENT_CLOSED, ClientGone, Proxy, race_disconnect
from ragserve_router.resume import ResumePlan, unresumable
from ragserve_router.routing import POOLING_PATHS, Routing
from ragserve_router.upstream import Routed

log = logging.getLogger(__name__)


@dataclass
class Gateway(Routing):
    """The HTTP front end: the shared routing plus the proxy, API keys and rate limits."""

    proxy: Proxy
    auth: ApiKeys
    limiter: RateLimiter

    def admit(self, who: str, key: LimitedKey | None) -> None:
        """The key's (else the client's) request-rate limit, for both front ends: 429 when over it."""
        try:
            self.limiter.check(key.name if key else who, key)
        except ApiError:
            self.metrics.rate_limited.inc()
            raise


def create_app(gw: Gateway) -> tuple[ASGIApp, Direct]:
    """The FastAPI app, and the generate endpoints as direct routes (fast_routes.py, served by the protocol of
    ragserve.http.direct); every answer counted once, by final status."""
    app = FastAPI(title="ragserve router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    install_error_handlers(app, "router", log)

    def rate_limit(request: Request | DirectRequest, key: LimitedKey | None) -> None:
        client = request.client.host if request.client else "-"
        gw.admit(client, key)
        request.state.tenant = tenant_of(request.headers, gw.cfg.tenant_header, key.name if key else None, client)

    def admit(request: DirectRequest) -> None:
        rate_limit(request, gw.auth.check(request.headers.get("authorization")))

    auth = require_api_key(gw.auth, rate_limit)

    async def route(request: DirectRequest, path: str, chat: bool, pooling: bool = False) -> Response:
        started = time.monotonic()
        raw = await read_body(request, gw.cfg.max_body_bytes)
        try:  # a client that leaves while its request waits in the router queue gives its place up
            routed = await race_disconnect(request, _route(gw, request, path, raw, chat, started, pooling), _let_go)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        attributes = _trace_attributes(routed) if tracing.enabled() else None
        with tracing.span("router.route", tracing.extract(request.headers), attributes):
            if not (engines := prefill_engines(gw, routed)):
                return await gw.proxy.forward(routed)
            try:  # a long prompt for a decode engine: its prefill leg first, on a prefill engine (disagg.py)
                leg = await race_disconnect(request, run_prefill(gw, routed, engines))
            except ClientGone:
                routed.slot.release()
                return Response(status_code=CLIENT_CLOSED)
            if not leg.engine_id:
                return await gw.proxy.forward(routed)
            plan = replace(routed.plan, first_token_id=leg.first_token_id)
            return await gw.proxy.forward(replace(routed, prefill_s=leg.seconds, plan=plan))

    def generate(path: str, chat: bool = False, pooling: bool = False) -> Handler:
        return front(lambda request: route(request, path, chat, pooling), admit)

    routes = {"/v1/chat/completions": generate("/v1/chat/completions", chat=True)}
    routes["/v1/completions"] = generate("/v1/completions")
    routes |= {path: generate(path, pooling=True) for path in POOLING_PATHS}  # embeddings, rerank and score

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

    if gw.cfg.admin_api_key_file:
        install_admin(app, gw.pool, gw.cfg.admin_api_key_file)
    return CountResponses(app, count=gw.metrics.count), Direct(routes, "router", gw.metrics.count)


async def _route(
    gw: Gateway, request: DirectRequest, path: str, raw: bytes, chat: bool, started: float, pooling: bool = False
) -> Routed:
    """Decide where the request goes (routing.Routing.pick) and how it may resume."""
    tenant = getattr(request.state, "tenant", "-")
    picked, body, raw = await gw.pick(request.headers, raw, chat, request.state, started, tenant=tenant,
                                      pooling=pooling)  # fmt: skip
    stream = body.get("stream") is True
    first = picked.decision.order[0]
    plan = ResumePlan(body, raw, chat, unresumable(body, chat, stream, gw.cfg.migration_limit, first))
    return Routed(**picked.fields(), request=request, request_id=request.state.request_id, path=path, body=raw,
                  stream=stream, plan=plan, prefill_s=0.0)  # fmt: skip


def _let_go(routed: Routed) -> None:
    """A request routed after its client left (a cancel swallowed on the way): its slot and places go back."""
    routed.slot.release()


def _trace_attributes(routed: Routed) -> dict:
    """The routing decision on the router's span: policy, reason, engine and its predicted cached tokens."""
    d, engine_id = routed.decision, routed.decision.order[0].engine_id
    attrs = {"ragserve.request_id": routed.request_id, "ragserve.policy": d.policy, "ragserve.reason": d.reason}
    attrs["ragserve.engine"] = engine_id
    if (predicted := d.predicted_cached_tokens(engine_id, routed.key)) is not None:
        attrs["ragserve.predicted_cached_tokens"] = predicted
    return attrs
