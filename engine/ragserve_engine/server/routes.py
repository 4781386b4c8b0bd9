"""The engine's FastAPI app: OpenAI endpoints, tokenizer endpoints, warm-up, health, readiness, metrics."""

from __future__ import annotations

import functools
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ragserve import __version__
from ragserve.http.auth import ApiKeys, require_api_key
from ragserve.http.errors import ApiError, install_error_handlers
from ragserve.http.outcomes import CountResponses
from ragserve.tokenizer import encode_beside_loop, long_messages, long_text
from ragserve_engine.server.engine_server import READY, EngineServer
from ragserve_engine.server.errors import bad_request
from ragserve_engine.server.pooling_routes import add_pooling_routes
from ragserve_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    WarmupRequest,
)
from ragserve_engine.server.tools import tool_request
from ragserve_engine.server.transport import M, parse, parse_body

log = logging.getLogger("ragserve_engine.server")


def create_app(server: EngineServer) -> FastAPI:
    app = FastAPI(title="ragserve engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    install_error_handlers(app, "engine", log, scoped=True)
    app.add_middleware(CountResponses, count=server.metrics.count, broken=500)  # every answer once
    limit = server.config.max_body_bytes
    created = int(time.time())
    auth = [require_api_key(ApiKeys.single(server.config.api_key))]

    add_pooling_routes(app, server, auth, limit)
    if not server.embeds:
        add_generation_routes(app, server, auth, limit)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> Response:
        card = {"id": server.model_name, "object": "model", "created": created, "owned_by": "ragserve"}
        if server.llm is not None:
            card["max_model_len"] = server.llm.info.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenizer_request(request: Request, model: type[M]) -> M:
        server.check_loaded()
        req = await parse(request, model, limit)
        server.check_model(req.model)
        return req

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        req = await tokenizer_request(request, TokenizeRequest)
        tok = server.llm.tokenizer
        try:
            if req.messages is not None:
                messages = [m.render_dict() for m in req.messages]
                tools = tool_request(req.tools, None)  # rendered as a chat request's are
                encode = functools.partial(server.chat.encode, messages, tools, req.add_generation_prompt)
                big = long_messages(messages)
            else:
                encode = functools.partial(tok.encode, req.prompt, add_special_tokens=req.add_special_tokens)
                big = long_text(req.prompt)
            tokens = await encode_beside_loop(encode, big)
        except ValueError as exc:
            raise bad_request(exc, "messages") from None
        return JSONResponse({"count": len(tokens), "max_model_len": server.llm.info.max_model_len, "tokens": tokens})

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        req = await tokenizer_request(request, DetokenizeRequest)
        tok = server.llm.tokenizer
        if any(t < 0 or t >= tok.vocab_size for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {tok.vocab_size})", "invalid_value", "tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        body = {"status": server.status, "model": server.model_name}
        if server.registration is not None:
            body["registered"] = server.registration.registered
        return JSONResponse(body, status_code=200 if server.status == READY else 503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def add_generation_routes(app: FastAPI, server: EngineServer, auth: list, limit: int) -> None:
    """Chat, completions and KV warm-up: what a generating engine (--task generate) serves."""

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        server.check_accepting()
        req, body = await parse_body(request, ChatCompletionRequest, limit)
        server.check_model(req.model)
        await server.prefill_leg(request, "/v1/chat/completions", body, req)  # named by the endpoint picker
        return await server.chat.create(request, req)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        server.check_accepting()
        req, body = await parse_body(request, CompletionRequest, limit)
        server.check_model(req.model)
        await server.prefill_leg(request, "/v1/completions", body, req)
        return await server.completion.create(request, req)

    @app.post("/v1/warmup", dependencies=auth)
    async def warmup(request: Request) -> Response:
        server.check_accepting()
        req = await parse(request, WarmupRequest, limit)
        server.check_model(req.model)
        return JSONResponse(await server.warmups.warm(req))

    @app.get("/v1/warmup", dependencies=auth)
    async def warmups() -> Response:
        return JSONResponse(server.warmups.summary())

    @app.delete("/v1/warmup/{warmup_id}", dependencies=auth)
    async def unpin(warmup_id: str) -> Response:
        server.check_loaded()
        return JSONResponse(await server.warmups.release(warmup_id))
