"""OpenAI-shaped errors, {"error": {"message", "type", "param", "code"}}, and the FastAPI handlers that send them.

Clients never see a traceback or an internal address: anything unexpected is a logged 500.
Engines tag every error with its scope (`x-ragserve-error-scope`): `request` when the request
itself caused it (every 4xx, and a 5xx while processing only that request), `engine` when the
engine as a whole failed; the router retries and penalises health only for `engine`.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}  # every other status: "server_error"
ERROR_SCOPE_HEADER = "x-ragserve-error-scope"
REQUEST_SCOPE = "request"
ENGINE_SCOPE = "engine"


class ApiError(Exception):
    """An error the client caused or must be told about."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        scope: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.scope = scope  # None: decided by the app (see install_error_handlers)

    def response(self, request_id: str | None = None, scope: str | None = None) -> JSONResponse:
        headers = dict(self.headers)
        if request_id:
            headers["X-Request-Id"] = request_id
        if scope := self.scope or scope:
            headers[ERROR_SCOPE_HEADER] = scope
        return error_response(self.status, self.message, self.code, self.param, headers)


def internal_error(component: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The answer to an unexpected exception in a handler (the exception itself goes to the component's log)."""
    return error_response(500, f"internal {component} error", "internal_error", None, headers)


def default_scope(status: int) -> str:
    return REQUEST_SCOPE if status < 500 else ENGINE_SCOPE


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None, scope: str | None = None
) -> dict:
    error = {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}
    return {"error": error | ({"scope": scope} if scope else {})}


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    """A pydantic validation failure as a 400 naming the first bad field."""
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return ApiError(400, f"{loc or 'body'}: {first.get('msg', 'invalid value')}", "invalid_value", loc or None)


def install_error_handlers(app: FastAPI, component: str, log: logging.Logger, scoped: bool = False) -> None:
    """ApiError, validation, routing (404/405) and unexpected errors as OpenAI error bodies.

    An ApiError answer carries X-Request-Id when the request set `request.state.request_id`.
    `scoped` (the engine): every answer carries the error-scope header; an ApiError without a
    scope is `request` below 500 and `engine` from 500; an unexpected exception in a handler
    happened while processing only that request: `request`."""

    def scope(status: int) -> str | None:
        return default_scope(status) if scoped else None

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(getattr(request.state, "request_id", None), scope(exc.status))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(scope=scope(400))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, message, code).response(scope=scope(exc.status_code))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return internal_error(component, {ERROR_SCOPE_HEADER: REQUEST_SCOPE} if scoped else None)
