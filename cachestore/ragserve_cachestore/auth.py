"""Shared-token auth: every call carries metadata `authorization: Bearer <token>`.

The gRPC health service stays open so Kubernetes gRPC probes (which send no
metadata) work; everything else, reflection included, needs the token.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
UNAUTHENTICATED_MESSAGE = "missing or invalid token: send metadata 'authorization: Bearer <token>'"


def read_token(path: str | Path) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read auth token file {path}: {exc}") from None
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        if self._authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _denying(handler)

    def _authorized(self, metadata) -> bool:
        sent = next((value for key, value in metadata if key == "authorization"), "")
        sent = sent.encode() if isinstance(sent, str) else sent
        return hmac.compare_digest(sent, self._expected)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that answers UNAUTHENTICATED."""

    def deny(request_or_iterator, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
