"""Request-body limits and JSON parsing shared by the engine server and the router: failures are OpenAI 4xx."""

from __future__ import annotations

import json

from ragserve.http.errors import ApiError


async def read_body(request, limit: int) -> bytes:
    """The body of a Starlette request, refused with 413 past `limit` bytes (declared or streamed)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes", "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    return body
