"""Count every HTTP response once, by the status the client finally got (ASGI middleware; router and engine).

A response counts when the app is done with it, so errors raised anywhere (auth, rate limits, body limits,
validation, routing) count like any other answer. An event stream counts as its status once `data: [DONE]`
has been written, whatever the client does afterwards; a response cut short counts as 499 when the client
left first and as `broken` (the server failed mid-body) otherwise. The reason of an error is its OpenAI
error body's `code`. Probes and scrapes (`skip`) are not counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CLIENT_CLOSED = 499
DONE = b"data: [DONE]"
PROBES = ("/metrics", "/health", "/ready")
_REASON = re.compile(r"[a-z0-9_]{1,48}")
_MAX_ERROR_BODY = 65536


@dataclass
class Outcome:
    status: int
    reason: str  # "" for a success
    state: dict  # what the app left in request.state (labels such as the model)


@dataclass
class ResponseSeen:
    """What a server wrote of one answer, and whether its client left first: the answer's Outcome."""

    status: int | None = None
    stream: bool = False
    done: bool = False  # [DONE] written
    complete: bool = False  # last body message written
    gone: bool = False  # the client disconnected
    tail: bytes = b""
    error_body: bytes = b""

    def sent(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started(message["status"], message.get("headers") or [])
        elif message["type"] == "http.response.body":
            self.wrote(bytes(message.get("body", b"")), message.get("more_body", False))

    def started(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.stream = dict(headers).get(b"content-type", b"").startswith(b"text/event-stream")

    def wrote(self, body: bytes, more: bool) -> None:
        if self.gone:  # after a disconnect nothing is written
            return
        if self.stream:
            self.done = self.done or DONE in self.tail + body
            self.tail = (self.tail + body)[-len(DONE) :]
        elif len(self.error_body) < _MAX_ERROR_BODY and (self.status or 0) >= 400:
            self.error_body += body[: _MAX_ERROR_BODY - len(self.error_body)]
        self.complete = not more

    def outcome(self, broken: int) -> tuple[int, str]:
        if self.status is None:  # the app raised before answering: the server sends a 500
            return (CLIENT_CLOSED, "client_closed") if self.gone else (500, "internal_error")
        if self.stream and self.done or not self.stream and self.complete:
            return self.status, error_reason(self.status, self.error_body)
        if self.gone:
            return CLIENT_CLOSED, "client_closed"
        return broken, "stream_broken"


def error_reason(status: int, body: bytes) -> str:
    """An answer's reason label: "" for a success, else its OpenAI error body's code (or http_<status>)."""
    if status == CLIENT_CLOSED:
        return "client_closed"
    if status < 400:
        return ""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return code if isinstance(code, str) and _REASON.fullmatch(code) else f"http_{status}"


class CountResponses:
    """`app.add_middleware(CountResponses, count=...)`: count(Outcome) once per answered request."""

    def __init__(
        self, app: ASGIApp, count: Callable[[Outcome], None], broken: int = 502, skip: tuple[str, ...] = PROBES
    ) -> None:
        self.app, self.count, self.broken, self.skip = app, count, broken, skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.skip:
            await self.app(scope, receive, send)
            return
        seen = ResponseSeen()
        state = scope.setdefault("state", {})  # request.state writes here

        async def receive_() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not seen.complete:  # servers say so after the end too
                seen.gone = True
            return message

        async def send_(message: Message) -> None:
            await send(message)
            seen.sent(message)

        try:
            await self.app(scope, receive_, send_)
        finally:
            status, reason = seen.outcome(self.broken)
            self.count(Outcome(status, reason, state))
