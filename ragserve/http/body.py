"""Request-body limits and JSON parsing shared by the engine server and the router: failures are OpenAI 4xx.

JSON is parsed only after a depth check on the raw bytes (no recursion limit is ever hit), and
NaN/Infinity are refused; what the parsed body may hold is ragserve.http.limits.
"""

from __future__ import annotations

import json
import re

from ragserve.http.errors import ApiError
from ragserve.http.limits import MAX_DEPTH

_ESCAPE = re.compile(rb"\\.", re.S)  # a string's escape pair (\" and \\ among them)
_QUOTED = re.compile(rb'"[^"]*"')  # a string literal once its escapes are gone
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')
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


def too_deep(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether a JSON text nests deeper than `limit` (brackets outside string literals). A text with no more
    opening brackets than `limit` in all is not looked at closer."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    structure = _ESCAPE.sub(b"", raw) if b"\\" in raw else raw
    brackets = _QUOTED.sub(b"", structure.translate(None, _NOT_STRUCTURE)).replace(b'"', b"")
    if not brackets:
        return False
    depth = 1  # the innermost level, which one regex pass takes off
    if depth > limit:
        return True
    for byte in _INNERMOST.sub(b"", brackets):
        depth += 1 if byte in b"[{" else -1
        if depth > limit:
            return True
    return False


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)  # one decoder: json.loads builds one per call


def parse_json_object(raw: bytes) -> dict:
    if too_deep(raw):
        raise ApiError(400, f"request body is nested deeper than {MAX_DEPTH} levels", "invalid_json", "body")
    try:
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    return body
