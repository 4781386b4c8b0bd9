"""The engine's ValueErrors (sampling parameters, prompt too long) as OpenAI 400s naming the field.

Error bodies, ApiError and the exception handlers are the shared ragserve.http.errors.
"""

from __future__ import annotations

import re

from ragserve.http.errors import ApiError

_PARAM = re.compile(r"invalid sampling parameter (\w+)=")


def bad_request(exc: ValueError, param: str | None = None) -> ApiError:
    message = str(exc)
    match = _PARAM.match(message)
    if match:
        return ApiError(400, message, "invalid_value", match.group(1))
    if "max_model_len" in message:
        return ApiError(400, message, "context_length_exceeded", "max_tokens" if "max_tokens" in message else param)
    return ApiError(400, message, "invalid_value", param)
