"""The generate endpoints as plain ASGI, in front of the FastAPI app.

A POST to one of them goes straight to its handler, past FastAPI's routing, dependency injection and its
middleware stack (about half of the router's framework CPU per request, bench/results/profile-router-hop-*.txt);
another method is answered 405; any other path goes to the FastAPI app. The checks are the
dependencies the app's routes had, in the same order: the request id (a 401 or 429 carries it), the API key, the
rate limit and tenant (`admit`). An ApiError is answered with the same OpenAI error body as the app's error
handlers (ragserve.http.errors); anything else is logged and answered 500 `internal_error`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ragserve.http.errors import ApiError, error_response
from ragserve_router.routing import valid_request_id

log = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]


def assign_request_id(request: Request) -> None:
    """The client's X-Request-Id when well formed, else a new one (128 random bits in hex, as uuid4().hex but without
    its os.urandom call: an id, not a secret); error answers carry it too."""
    given = valid_request_id(request.headers.get("x-request-id"))
    request.state.request_id = given or f"{random.getrandbits(128):032x}"


class FastRoutes:
    def __init__(self, app: ASGIApp, routes: dict[str, Handler], admit: Callable[[Request], None]) -> None:
        self.app, self.routes, self.admit = app, routes, admit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            if scope["method"] != "POST":
                allow = {"Allow": "POST"}
                raise ApiError(405, f"{scope['method']} {scope['path']}: Method Not Allowed", None, None, allow)
            assign_request_id(request)
            self.admit(request)
            response = await handler(request)
        except ApiError as exc:
            response = exc.response(getattr(request.state, "request_id", None))
        except Exception:
            log.exception("internal error on %s", scope["path"])
            response = error_response(500, "internal router error", "internal_error")
        await response(scope, receive, send)
