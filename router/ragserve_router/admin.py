"""The runtime admin API (/admin/*, on with --admin-api-key-file): list engines, drain one (no new requests, the
in-flight ones finish; ?wait=S answers when it is empty or S seconds passed), undrain it, add an engine by URL
(probed like a --static-engines one) and remove an added, static or discovered one. A change is written to the
router state, so with Redis every replica applies it (admin_view.py). Every call needs
`Authorization: Bearer <admin key>` (401 otherwise, an OpenAI-style error)."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import time
from collections.abc import Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from ragserve.http.errors import ApiError
from ragserve.router_args import url_list
from ragserve.token_auth import read_token
from ragserve_router.admin_view import AdminChange, AdminView, admin_id
from ragserve_router.engines import GRPC, EngineRecord
from ragserve_router.pool import REPORT_TRANSIT_S, EnginePool

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

    async def change(make: Callable[[AdminView], AdminChange]) -> None:
        """Write to the shared state, then apply here at once (other replicas at their next sync)."""
        try:
            await pool.state.admin_change(make(await pool.state.admin_view()))
            view = await pool.state.admin_view()
        except Exception as exc:  # Redis unreachable: nothing changed anywhere
            raise ApiError(503, f"router state unreachable, nothing changed: {exc}", code="state_unavailable") from None
        await pool.apply_admin(view)

    async def drained(engine_id: str, since: float) -> bool:
        """Nothing of this replica's in flight, and the engine itself reported idle after the drain began (when
        it reports its load: other replicas' requests count too)."""
        record = pool.get(engine_id)
        if record is None or pool.health[engine_id].inflight:
            return record is None
        transit = REPORT_TRANSIT_S  # a heartbeat may have been taken before it arrived
        if record.source != GRPC:
            await pool.probe(record)  # scrapes the load of an engine that does not heartbeat, now
            transit = 0.0
        load = record.load
        if not load.reported_at:
            return True  # reports no load: this replica's count is all there is
        return load.reported_at - transit >= since and load.num_running + load.num_waiting == 0

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
        await change(lambda _: AdminChange.add_engine(url))
        return JSONResponse(view(pool, engine(admin_id(url))), status_code=201)

    @api.delete("/engines/{engine_id}")
    async def remove(engine_id: str) -> JSONResponse:
        record = engine(engine_id)
        if record.source == GRPC:
            raise ApiError(409, "a registered engine leaves by deregistering; drain it instead", code="registered",
                           param="engine_id")  # fmt: skip
        out = view(pool, record)
        await change(lambda current: AdminChange.remove_engine(record.url, current))
        return JSONResponse({**out, "draining": False, "removed": True})

    @api.post("/engines/{engine_id}/drain")
    async def drain(engine_id: str, wait: float = 0.0) -> JSONResponse:
        record = engine(engine_id)
        if not 0 <= wait <= MAX_WAIT_S:
            raise ApiError(400, f"wait must be 0..{MAX_WAIT_S:g} seconds", code="invalid_wait", param="wait")
        since = time.time()
        await change(lambda _: AdminChange.drain(record.url, True))
        deadline = time.monotonic() + wait
        empty = await drained(engine_id, since)
        while not empty and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            empty = await drained(engine_id, since)
        return JSONResponse({**view(pool, record), "drained": empty})

    @api.post("/engines/{engine_id}/undrain")
    async def undrain(engine_id: str) -> JSONResponse:
        record = engine(engine_id)
        await change(lambda _: AdminChange.drain(record.url, False))
        return JSONResponse(view(pool, record))

    app.include_router(api)
