"""The engine's ValueErrors (sampling parameters, prompt too long) as OpenAI 400s naming the field,
and its failures as 500s tagged with their scope (contract: `x-ragserve-error-scope`).

Error bodies, ApiError and the exception handlers are the shared ragserve.http.errors.
"""

from __future__ import annotations

import re

from ragserve.http.errors import ENGINE_SCOPE, REQUEST_SCOPE, ApiError, error_body
from ragserve_engine.engine_client import EngineError

_PARAM = re.compile(r"invalid sampling parameter (\w+)=")


def bad_request(exc: ValueError, param: str | None = None) -> ApiError:
    message = str(exc)
    if getattr(exc, "param", None):  # a GrammarError
        return ApiError(400, message, "invalid_value", exc.param)
    match = _PARAM.match(message)
    if match:
        return ApiError(400, message, "invalid_value", match.group(1))
    if "max_model_len" in message:
        return ApiError(400, message, "context_length_exceeded", "max_tokens" if "max_tokens" in message else param)
    return ApiError(400, message, "invalid_value", param)


def failure_scope(exc: BaseException) -> str:
    """An EngineError failed every request; anything else raised while serving one request is its own."""
    return ENGINE_SCOPE if isinstance(exc, EngineError) else REQUEST_SCOPE


def failure(exc: BaseException) -> ApiError:
    """A generation that failed before the response started, as a 500 with its scope."""
    scope = failure_scope(exc)
    return ApiError(500, f"{scope} error: {exc}", f"{scope}_error", scope=scope)


def failure_event(exc: BaseException) -> dict:
    """The SSE error event that ends a stream whose generation failed (no [DONE] follows)."""
    scope = failure_scope(exc)
    return error_body(500, f"{scope} error: {exc}", f"{scope}_error", scope=scope)
