"""Pooling-style HTTP routes: /v1/embeddings (embedding engines, `--task embed`), /v1/rerank (also /rerank and
/v2/rerank, as vLLM serves it) and /v1/score (also /score) on every engine (serving_pooling.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ragserve_engine.server.engine_server import EngineServer
from ragserve_engine.server.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from ragserve_engine.server.serving_base import CLIENT_CLOSED
from ragserve_engine.server.transport import ClientDisconnected, M, parse


def add_pooling_routes(app: FastAPI, server: EngineServer, auth: list, limit: int) -> None:
    pooling = server.pooling

    async def answer(request: Request, model: type[M], serve: Callable[[Request, M], Awaitable[Response]]) -> Response:
        server.check_accepting()
        req = await parse(request, model, limit)
        server.check_model(req.model)
        try:
            return await serve(request, req)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    async def embeddings(request: Request) -> Response:
        return await answer(request, EmbeddingRequest, pooling.embeddings)

    if server.embeds:
        app.add_api_route("/v1/embeddings", embeddings, methods=["POST"], dependencies=auth)

    async def rerank(request: Request) -> Response:
        return await answer(request, RerankRequest, pooling.rerank)

    async def score(request: Request) -> Response:
        return await answer(request, ScoreRequest, pooling.score)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"], dependencies=auth)
    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"], dependencies=auth)
