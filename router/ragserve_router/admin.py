"""The runtime admin API (/admin/*, on with --admin-api-key-file): list engines, drain one (no new requests, the
in-flight ones finish; ?wait=S answers when it is empty or S seconds passed), undrain it, add an engine by URL
(probed like a --static-engines one) and remove an added or static one. Per replica, like the router's other
local state. Every call needs `Authorization: Bearer <admin key>` (401 otherwise, an OpenAI-style error)."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import itertools
import json

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from ragserve.http.errors import ApiError
from ragserve.router_args import url_list
from ragserve.token_auth import read_token
from ragserve_router.engines import GRPC, STATIC, EngineRecord
from ragserve_router.pool import EnginePool, Health

MAX_WAIT_S = 600.0


def view(pool: EnginePool, record: EngineRecord) -> dict:
    health = pool.health[record.engine_id]
    return {
        "engine_id": record.engine_id,
        "url": record.url,
        "source": record.source,
        "models": record.models,
        "healthy": health.healthy,
        "draining": record.engine_id in pool.draining,
        "inflight": health.inflight,
        "breaker": pool.breaker(record.engine_id).state,
    }


def install_admin(app: FastAPI, pool: EnginePool, key_file: str) -> None:
    """The /admin routes, guarded by the key in `key_file` (read now: a bad file stops start-up)."""
    expected = f"Bearer {read_token(key_file)}".encode()
    added = itertools.count()

    def admin_key(request: Request) -> None:
        sent = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(sent, expected):
            raise ApiError(401, "missing or invalid admin key: send 'Authorization: Bearer <admin key>'",
                           code="invalid_admin_key")  # fmt: skip

    def engine(engine_id: str) -> EngineRecord:
        record = pool.get(engine_id)
        if record is None:
            raise ApiError(404, f"no engine {engine_id!r}", code="engine_not_found", param="engine_id")
        return record

    api = APIRouter(prefix="/admin", dependencies=[Depends(admin_key)])

    @api.get("/engines")
    async def engines() -> JSONResponse:
        return JSONResponse({"engines": [view(pool, r) for r in pool.all()]})

    @api.post("/engines")
    async def add(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body() or b"{}")
            (url,) = url_list(body["url"])
        except (ValueError, TypeError, KeyError, AttributeError, argparse.ArgumentTypeError):
            raise ApiError(
                400, "'url' must be one http(s):// engine base URL", code="invalid_url", param="url"
            ) from None
        if any(r.url == url for r in pool.all()):
            raise ApiError(409, f"an engine at {url} is already known", code="engine_exists", param="url")
        record = EngineRecord(f"admin-{next(added)}", url, [], source=STATIC)
        pool.discovered[record.engine_id] = record
        pool.health[record.engine_id] = Health(healthy=False)  # until a probe answers
        await pool.probe(record)
        return JSONResponse(view(pool, record), status_code=201)

    @api.delete("/engines/{engine_id}")
    async def remove(engine_id: str) -> JSONResponse:
        record = engine(engine_id)
        if record.source == GRPC:
            raise ApiError(409, "a registered engine leaves by deregistering; drain it instead", code="registered",
                           param="engine_id")  # fmt: skip
        pool.discovered.pop(engine_id, None)
        pool.draining.discard(engine_id)
        return JSONResponse({**view(pool, record), "removed": True})

    @api.post("/engines/{engine_id}/drain")
    async def drain(engine_id: str, wait: float = 0.0) -> JSONResponse:
        record = engine(engine_id)
        if not 0 <= wait <= MAX_WAIT_S:
            raise ApiError(400, f"wait must be 0..{MAX_WAIT_S:g} seconds", code="invalid_wait", param="wait")
        pool.draining.add(engine_id)
        deadline = asyncio.get_running_loop().time() + wait
        while pool.health[engine_id].inflight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        out = view(pool, record)
        return JSONResponse({**out, "drained": out["inflight"] == 0})

    @api.post("/engines/{engine_id}/undrain")
    async def undrain(engine_id: str) -> JSONResponse:
        record = engine(engine_id)
        pool.draining.discard(engine_id)
        return JSONResponse(view(pool, record))

    app.include_router(api)
