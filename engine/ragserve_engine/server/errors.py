"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, never a traceback."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ragserve_engine.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_error",
}
_PARAM = re.compile(r"invalid sampling parameter (\w+)=")


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.code, self.param)


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def bad_request(exc: ValueError, param: str | None = None) -> ApiError:
    """The engine's ValueErrors (sampling parameters, prompt too long) as a 400 naming the field."""
    message = str(exc)
    match = _PARAM.match(message)
    if match:
        return ApiError(400, message, "invalid_value", match.group(1))
    if "max_model_len" in message:
        return ApiError(400, message, "context_length_exceeded", "max_tokens" if "max_tokens" in message else param)
    return ApiError(400, message, "invalid_value", param)


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return ApiError(400, f"{loc or 'body'}: {first.get('msg', 'invalid value')}", "invalid_value", loc or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return error_response(500, "internal engine error", "internal_error")
