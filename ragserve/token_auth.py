"""Shared-token auth for ragserve's gRPC services: every call carries metadata `authorization: Bearer <token>`.

One check for the cachestore (a sync server) and the router's registry (grpc.aio). The gRPC health
service stays open so Kubernetes gRPC probes (which send no metadata) work.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
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


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends."""
    return (("authorization", f"Bearer {token}"),)


def authorized(metadata: Iterable[tuple[str, str | bytes]], token: str) -> bool:
    sent = next((value for key, value in metadata if key == "authorization"), "")
    sent = sent.encode() if isinstance(sent, str) else sent
    return hmac.compare_digest(sent, f"Bearer {token}".encode())


class AioTokenAuth(grpc.aio.ServerInterceptor):
    """grpc.aio interceptor: calls without the token (token None: every call) answer UNAUTHENTICATED."""

    def __init__(self, token: str | None, message: str = UNAUTHENTICATED_MESSAGE) -> None:
        self.token = token
        self.message = message

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        if self.token is not None and authorized(handler_call_details.invocation_metadata or (), self.token):
            return handler
        return denying(handler, self.message, aio=True)


def denying(handler: grpc.RpcMethodHandler, message: str, aio: bool = False) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that answers UNAUTHENTICATED."""

    def deny(request_or_iterator, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_aio(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        deny_aio if aio else deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
