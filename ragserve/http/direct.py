"""Routes answered by the HTTP protocol itself, past uvicorn's ASGI cycle (issue 34: the router's generate routes).

For every request uvicorn builds an ASGI scope, a RequestResponseCycle and message dicts, and Starlette wraps them
again. At 25 req/s that code runs cold and costs ~0.27 ms a request more than a bare protocol answering from a
task (bench/results/http_stack_cost-gap40.md). DirectHttpProtocol answers the paths in its `routes` itself: a
DirectExchange stands in for uvicorn's cycle (so uvicorn's framing, keep-alive timer, pipelining, flow control and
graceful shutdown still apply), the handler gets a DirectRequest and its Starlette Response is written as bytes.
Every other path goes through uvicorn's cycle and the ASGI app, as before (JoinedHttpProtocol).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools
from starlette.responses import Response, StreamingResponse
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from ragserve.http.direct_request import DirectRequest
from ragserve.http.errors import ApiError, internal_error
from ragserve.http.joined import JoinedHttpProtocol
from ragserve.http.outcomes import Outcome, ResponseSeen

log = logging.getLogger(__name__)
Handler = Callable[[DirectRequest], Awaitable[Response]]


@dataclass
class Direct:
    """The direct routes (path -> handler, any method: the handler answers 405 itself), whose they are (an unexpected
    error's answer names it) and what counts answers."""

    routes: dict[str, Handler]
    component: str
    count: Callable[[Outcome], None]
    broken: int = 502  # the status a stream cut by the server counts as


class DirectExchange:
    """One request of a direct route, in the place of uvicorn's RequestResponseCycle: the protocol fills `body`,
    `more_body` and `message_event`, reads `response_complete` and sets `disconnected` and `keep_alive`."""

    def __init__(self, protocol: DirectHttpProtocol, request: DirectRequest, keep_alive: bool, expect: bool) -> None:
        self.transport, self.flow, self.protocol = protocol.transport, protocol.flow, protocol
        self.request = request
        self.body, self.more_body, self.message_event = bytearray(), True, asyncio.Event()
        self.keep_alive, self.waiting_for_100_continue = keep_alive, expect
        self.response_complete, self._disconnected = False, False
        self.seen = ResponseSeen()

    @property
    def disconnected(self) -> bool:
        return self._disconnected

    @disconnected.setter
    def disconnected(self, value: bool) -> None:
        self._disconnected = value
        if value:
            self.seen.gone = True
            if (on_gone := self.request.on_gone) is not None:
                on_gone()

    async def run(self, handler: Handler, direct: Direct) -> None:
        try:
            await self._serve(handler, direct.component)
        except BaseException as exc:
            if not self.response_complete:  # nothing or part of an answer written: the client sees the connection end
                self.transport.close()
            if not isinstance(exc, Exception):
                raise
            log.exception("answering %s failed", self.request.path)
        finally:
            status, reason = self.seen.outcome(direct.broken)
            direct.count(Outcome(status, reason, self.request.state_dict))

    async def _serve(self, handler: Handler, component: str) -> None:
        response = await self._answer(handler, component)
        try:
            if not self._disconnected:
                await self._write(response)
        finally:
            if response.background is not None:
                await response.background()

    async def _answer(self, handler: Handler, component: str) -> Response:
        request = self.request
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response(getattr(request.state, "request_id", None))
        except Exception:
            if self._disconnected:  # e.g. the body's read cut short: nobody to answer
                return Response(status_code=499)
            log.exception("internal error on %s", request.path)
            return internal_error(component)

    def _head(self, response: Response, chunked: bool) -> bytes:
        headers = response.raw_headers
        self.seen.started(response.status_code, headers)
        head, closes = [STATUS_LINE[response.status_code]], False
        for name, value in (*self.protocol.server_state.default_headers, *headers):
            if name == b"connection" and b"close" in value.lower():
                self.keep_alive, closes = False, True
            head += name, b": ", value, b"\r\n"
        if not self.keep_alive and not closes:
            head.append(b"connection: close\r\n")
        if chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        head.append(b"\r\n")
        if self.protocol.access_log:
            self.protocol.access_logger.info('%s - "%s %s HTTP/1.1" %d', self.request.client_text,
                                             self.request.method, self.request.path, response.status_code)  # fmt: skip
        return b"".join(head)

    async def _write(self, response: Response) -> None:
        if isinstance(response, StreamingResponse):
            await self._stream(response)
            return
        body = b"" if self.request.method == "HEAD" else response.body
        self.transport.write(self._head(response, chunked=False) + body)
        self.seen.wrote(body, more=False)
        self._complete()

    async def _stream(self, response: StreamingResponse) -> None:
        """Chunked, each chunk written as it comes, waiting while the client's socket is full; a client that leaves
        cancels the wait for the next chunk (the body's generator is closed: it lets its engine go)."""
        self.transport.write(self._head(response, chunked=True))
        task, chunks = asyncio.current_task(), response.body_iterator
        self.request.on_gone = task.cancel
        try:
            async for chunk in chunks:
                data = chunk if isinstance(chunk, bytes) else chunk.encode(response.charset)
                if data:
                    self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
                    self.seen.wrote(data, more=True)
                if self.flow.write_paused:
                    await self.flow.drain()
                if self._disconnected:
                    return
            self.transport.write(b"0\r\n\r\n")
            self.seen.wrote(b"", more=False)
            self._complete()
        except asyncio.CancelledError:
            if not self._disconnected:
                raise
            task.uncancel()
        finally:
            self.request.on_gone = None
            if (close := getattr(chunks, "aclose", None)) is not None:
                await close()

    def _complete(self) -> None:
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.protocol.on_response_complete()


class DirectHttpProtocol(JoinedHttpProtocol):
    """JoinedHttpProtocol that answers `direct`'s paths itself (set by server_config on a subclass)."""

    direct: Direct

    def on_headers_complete(self) -> None:
        path = httptools.parse_url(self.url).path.decode("ascii", "replace")
        if "%" in path:
            path = urllib.parse.unquote(path)
        handler = self.direct.routes.get(path)
        if handler is None or self.parser.should_upgrade():
            super().on_headers_complete()
            return
        method = self.parser.get_method().decode("ascii")
        request = DirectRequest(method, path, self.headers, self.client)
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        exchange = DirectExchange(self, request, keep_alive, self.expect_100_continue)
        request.exchange, existing, self.cycle = exchange, self.cycle, exchange  # type: ignore[assignment]
        task = (exchange, handler)
        if existing is None or existing.response_complete:
            self._start_asgi_task(*task)  # type: ignore[arg-type]
        else:  # pipelined behind an answer still going out
            self.flow.pause_reading()
            self.pipeline.appendleft(task)  # type: ignore[arg-type]

    def _start_asgi_task(self, cycle, app) -> None:  # type: ignore[no-untyped-def]
        if not isinstance(cycle, DirectExchange):
            super()._start_asgi_task(cycle, app)
            return
        task = self.loop.create_task(cycle.run(app, self.direct))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)


def direct_protocol(direct: Direct) -> type[DirectHttpProtocol]:
    return type("RoutedHttpProtocol", (DirectHttpProtocol,), {"direct": direct})
