"""Request-body limits and JSON parsing shared by the engine server and the router: failures are OpenAI 4xx.

JSON is parsed only after a depth check on the raw bytes (no recursion limit is ever hit), and
NaN/Infinity are refused; what the parsed body may hold is ragserve.http.limits.
"""

from __future__ import annotations

import json
import re

from ragserve.http.errors import ApiError
from ragserve.http.limits import MAX_DEPTH

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal (escapes included)
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


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


def json_depth(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a JSON text (brackets outside string literals), counted up to limit + 1."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    depth = deepest = 0
    for byte in _INNERMOST.sub(b"", brackets):  # one regex pass takes the innermost level off
        depth += 1 if byte in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest >= limit:
                break
    return deepest + 1


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)  # one decoder: json.loads builds one per call


def parse_json_object(raw: bytes) -> dict:
    if json_depth(raw) > MAX_DEPTH:
        raise ApiError(400, f"request body is nested deeper than {MAX_DEPTH} levels", "invalid_json", "body")
    try:
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    return body
