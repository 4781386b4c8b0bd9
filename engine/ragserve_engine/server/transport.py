"""Request plumbing: body-size limit, JSON parsing into pydantic models, client disconnects."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ragserve.http.body import parse_json_object, read_body
from ragserve.http.errors import validation_error

M = TypeVar("M", bound=BaseModel)


class ClientDisconnected(Exception):
    pass


async def parse(request: Request, model: type[M], limit: int) -> M:
    return (await parse_body(request, model, limit))[0]


async def parse_body(request: Request, model: type[M], limit: int) -> tuple[M, dict]:
    """The request parsed, and its JSON body as sent (the body streams once)."""
    body = parse_json_object(await read_body(request, limit))
    try:
        return model.model_validate(body), body
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, coro):
    """Run coro; cancel it (aborting its generation) if the client disconnects first."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
