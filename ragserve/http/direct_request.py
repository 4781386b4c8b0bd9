"""The request a direct route's handler reads (ragserve/http/direct.py): the parts of Starlette's Request the
servers use (headers, state, client, the body as a stream), and `on_gone`, called when the client disconnects."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.datastructures import Address, Headers, State
from starlette.requests import ClientDisconnect


class DirectRequest:
    def __init__(self, method: str, path: str, raw_headers: list[tuple[bytes, bytes]], client: Any) -> None:
        self.method, self.path = method, path
        self.headers = Headers(raw=raw_headers)
        self.state_dict: dict[str, Any] = {}  # what handlers leave in `state` (the answer's Outcome reads it)
        self.state = State(self.state_dict)
        self.client = Address(*client) if client else None
        self.exchange: Any = None  # its ragserve.http.direct.DirectExchange, set by the protocol
        self.on_gone: Callable[[], None] | None = None  # one watcher at a time (proxy.race_disconnect, a stream)

    @property
    def disconnected(self) -> bool:
        return self.exchange.disconnected

    @property
    def client_text(self) -> str:
        return f"{self.client.host}:{self.client.port}" if self.client else "-"

    async def stream(self) -> AsyncIterator[bytes]:
        """The body's parts as they arrive (reading resumes while it waits: uvicorn pauses it past 64 KiB unread);
        ClientDisconnect when the client leaves before its end."""
        x = self.exchange
        if x.waiting_for_100_continue and not x.transport.is_closing():
            x.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            x.waiting_for_100_continue = False
        while True:
            if x.body:
                chunk, x.body = bytes(x.body), bytearray()
                yield chunk
            elif not x.more_body:
                return
            elif x.disconnected:
                raise ClientDisconnect()
            else:
                x.flow.resume_reading()
                await x.message_event.wait()
                x.message_event.clear()
