"""Shared-token auth: every call carries metadata `authorization: Bearer <token>` (the check is ragserve.token_auth).

The gRPC health service stays open so Kubernetes gRPC probes (which send no
metadata) work; everything else, reflection included, needs the token.
"""

from __future__ import annotations

import grpc

from ragserve.token_auth import HEALTH_PREFIX, UNAUTHENTICATED_MESSAGE, authorized, denying


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        if authorized(handler_call_details.invocation_metadata or (), self._token):
            return handler
        return denying(handler, UNAUTHENTICATED_MESSAGE)
