"""The generate endpoints, answered by the HTTP protocol itself (ragserve/http/direct.py), past uvicorn's ASGI
cycle, FastAPI's routing, dependency injection and middleware stack and Starlette's Request and Response plumbing.

`front` puts in front of each handler the checks the app's routes had as dependencies, in the same order: the
method (405 but for POST), the request id (a 401 or 429 carries it), the API key, the rate limit and tenant
(`admit`). An ApiError is answered with its OpenAI error body, anything else with a 500 `internal_error`
(ragserve.http.direct).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ragserve.http.direct import Handler
from ragserve.http.direct_request import DirectRequest
from ragserve.http.errors import ApiError
from ragserve_router.routing import valid_request_id


def assign_request_id(request: DirectRequest) -> None:
    """The client's X-Request-Id when well formed, else a new one (128 random bits in hex, as uuid4().hex but without
    its os.urandom call: an id, not a secret); error answers carry it too."""
    given = valid_request_id(request.headers.get("x-request-id"))
    request.state.request_id = given or f"{random.getrandbits(128):032x}"


def front(handler: Handler, admit: Callable[[DirectRequest], None]) -> Handler:
    async def checked(request: DirectRequest):
        if request.method != "POST":
            allow = {"Allow": "POST"}
            raise ApiError(405, f"{request.method} {request.path}: Method Not Allowed", None, None, allow)
        assign_request_id(request)
        admit(request)
        return await handler(request)

    return checked
