"""The HTTP/1.1 server protocol of the router, the engine and the sims: uvicorn's httptools one, with an answer's
head and body in one write.

uvicorn writes a response's status line and headers when the app starts the response and its body separately:
two writes, two TCP segments and two wake-ups of the client for every non-streamed answer. Here the head of an
answer with a Content-Length (every non-streamed one) is held until its first body part and both go out in one
write. A head without a length (a stream) still goes out at once, as the engine's did. Everything else (framing,
checks, keep-alive, pipelining) is uvicorn's own code.
"""

from __future__ import annotations

from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class _Gather:
    """A stand-in for the transport during one send: writes and a close are kept; the rest goes to the transport."""

    def __init__(self, transport: Any, parts: list[bytes]) -> None:
        self.transport, self.parts, self.closing = transport, parts, False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closing = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def _has_length(message: dict) -> bool:
    return any(name.lower() == b"content-length" for name, _ in message.get("headers", ()))


class JoinedCycle(RequestResponseCycle):
    head: list[bytes] | None = None  # a held response head (set on the instance)

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and not self.response_started and _has_length(message):
            self.head = []
            await self._gathered(message, self.head)
            return
        if self.head is None:
            await super().send(message)
            return
        parts, self.head = self.head, None
        await self._gathered(message, parts, flush=True)

    async def _gathered(self, message: Any, parts: list[bytes], flush: bool = False) -> None:
        """uvicorn's send with its writes gathered in `parts`; flush: then written (and the close done) at once."""
        transport = self.transport
        self.transport = gather = _Gather(transport, parts)
        try:
            await super().send(message)
        finally:
            self.transport = transport
            if flush and not self.disconnected:
                transport.write(b"".join(parts))
            if gather.closing:
                transport.close()


class JoinedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose request cycles join an answer's head and body (JoinedCycle)."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        cycle.__class__ = JoinedCycle
        super()._start_asgi_task(cycle, app)


def server_config(
    app: Any, log_level: str, graceful_s: float, tls: dict, http: type = JoinedHttpProtocol, **where: Any
) -> uvicorn.Config:
    """uvicorn as the router, the engine and the sims run it: on the caller's event loop, with JoinedHttpProtocol
    (or the router's ragserve.http.direct protocol), no lifespan, an access log only at debug; `tls` from
    ragserve.tls.uvicorn_tls; `where`: host and port (none when the caller passes its own sockets)."""
    return uvicorn.Config(
        app,
        loop="none",
        http=http,
        lifespan="off",
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=graceful_s,
        **where,
        **tls,
    )
