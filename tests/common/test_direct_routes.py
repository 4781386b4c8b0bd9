"""Routes answered by the HTTP protocol itself (ragserve/http/direct.py), on real sockets: the bytes stock uvicorn and
Starlette give for the same Response, keep-alive and pipelining mixed with the ASGI app's paths, 100-continue, the
body stream, a client that leaves (the handler's callback, a stream's generator closed, its background run), errors,
and every answer counted once by its final status."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from ragserve.http.body import read_body
from ragserve.http.direct import Direct, direct_protocol
from ragserve.http.errors import ApiError
from tests.common.test_joined_writes import _complete, exchange, serve

EVENTS: list[str] = []
COUNTED: list[tuple[int, str]] = []


async def events(gate: asyncio.Event | None = None, fail: bool = False):
    try:
        yield b"data: 1\n\n"
        if gate is not None:
            await gate.wait()  # only a cancel ends it
        if fail:
            raise RuntimeError("the stream breaks on purpose")
        yield "data: [DONE]\n\n"
    finally:
        EVENTS.append("generator closed")


def responses(path: str, body: bytes) -> Response:
    if path == "/json":
        return JSONResponse({"ok": True, "got": len(body)}, headers={"X-Engine": "e1"})
    if path == "/stream":
        return StreamingResponse(events(), media_type="text/event-stream",
                                 background=BackgroundTask(EVENTS.append, "background"))  # fmt: skip
    if path == "/close":
        return Response(b"ok", headers={"Connection": "close"})
    return Response(b"no such path", status_code=404)


async def direct_handler(request):
    path = request.path
    if path == "/fail":
        raise RuntimeError("broken on purpose")
    if path == "/refused":
        raise ApiError(429, "slow down", "rate_limit_exceeded", None, {"Retry-After": "3"})
    body = await read_body(request, 1 << 20 if path == "/big" else 64)
    request.state.model = "m"
    if path == "/big":
        return JSONResponse({"ok": True, "got": len(body)})
    if path == "/wait":  # until the client leaves
        left = asyncio.Event()
        request.on_gone = left.set
        await left.wait()
        EVENTS.append("on_gone")
        return Response(status_code=499)
    if path == "/hold":  # a stream that waits after its first event
        return StreamingResponse(events(asyncio.Event()), media_type="text/event-stream",
                                 background=BackgroundTask(EVENTS.append, "background"))  # fmt: skip
    if path == "/breaks":  # a stream whose body fails after its first event
        return StreamingResponse(events(fail=True), media_type="text/event-stream")
    return responses(path, body)


async def asgi_app(scope, receive, send) -> None:  # the same answers through stock uvicorn and Starlette
    body = b""
    while (message := await receive()).get("more_body"):
        body += message.get("body", b"")
    body += message.get("body", b"")
    await responses(scope["path"], body)(scope, receive, send)


ROUTES = ("/json", "/stream", "/close", "/fail", "/refused", "/wait", "/hold", "/breaks", "/big")


@pytest.fixture(scope="module")
def servers():
    direct = Direct(dict.fromkeys(ROUTES, direct_handler), "test", lambda o: COUNTED.append((o.status, o.reason)))
    servers = [serve(direct_protocol(direct), asgi_app), serve("httptools", asgi_app)]
    yield servers
    for server, thread, _ in servers:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def ports(servers):
    """The two servers' ports, once neither runs a request of an earlier test (a stream's end is counted and its
    background run after its client has read it)."""
    until(lambda: not any(server.server_state.tasks for server, _, _ in servers), "earlier requests done")
    EVENTS.clear()
    COUNTED.clear()
    return servers[0][2], servers[1][2]


def post(path: str, body: bytes = b"{}", extra: str = "", version: str = "1.1") -> bytes:
    head = f"POST {path} HTTP/{version}\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def until(check, what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize(
    "raw,until_close,answers",
    [
        (post("/json", b'{"a": 1}'), False, 1),
        (post("/stream"), False, 1),
        (post("/close"), True, 1),
        (post("/json", extra="Connection: close\r\n"), True, 1),
        (post("/json", version="1.0"), True, 1),
        (post("/json") + post("/stream") + post("/json"), False, 3),  # pipelined on one connection
    ],
)
def test_answers_are_byte_identical_to_stock_uvicorn_and_starlette(ports, raw, until_close, answers):
    direct, stock = ports
    ours = exchange(direct, raw, until_close, answers)
    assert ours == exchange(stock, raw, until_close, answers)
    assert ours.startswith(b"HTTP/1.1 200 OK\r\n")


def test_direct_and_asgi_paths_share_a_keep_alive_connection(ports):
    # /nope is not a direct route: the ASGI app answers it, in its place
    got = exchange(ports[0], post("/json") + post("/nope") + post("/json"), answers=3)
    assert got.count(b"HTTP/1.1 200 OK") == 2 and got.count(b"HTTP/1.1 404") == 1
    assert got.index(b"HTTP/1.1 404") > got.index(b"HTTP/1.1 200") and got.endswith(b'{"ok":true,"got":2}')


def test_errors_are_openai_bodies_and_every_answer_is_counted(ports):
    got = exchange(ports[0], post("/refused") + post("/fail") + post("/json", b"x" * 100) + post("/json"), answers=4)
    assert b"HTTP/1.1 429" in got and b"retry-after: 3" in got and b'"code":"rate_limit_exceeded"' in got
    assert b"HTTP/1.1 500" in got and b'"code":"internal_error"' in got and b"internal test error" in got
    assert b"HTTP/1.1 413" in got and b'"code":"body_too_large"' in got
    until(lambda: len(COUNTED) == 4, "4 answers counted")
    assert COUNTED == [(429, "rate_limit_exceeded"), (500, "internal_error"), (413, "body_too_large"), (200, "")]


def test_100_continue_then_the_body(ports):
    body = b'{"a": "b"}'
    with socket.create_connection(("127.0.0.1", ports[0]), timeout=30) as s:
        s.sendall(post("/json", body, "Expect: 100-continue\r\n")[: -len(body)])
        assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        got = b""
        while not _complete(got, 1):
            got += s.recv(65536)
    assert got.endswith(b'{"ok":true,"got":10}')


def test_a_client_that_leaves_calls_on_gone_and_is_counted_499(ports):
    with socket.create_connection(("127.0.0.1", ports[0]), timeout=30) as s:
        s.sendall(post("/wait"))
        time.sleep(0.2)
    until(lambda: COUNTED, "the answer counted")
    assert COUNTED == [(499, "client_closed")] and EVENTS == ["on_gone"], (COUNTED, EVENTS)


def test_a_client_that_leaves_mid_stream_closes_the_generator_and_runs_the_background(ports):
    with socket.create_connection(("127.0.0.1", ports[0]), timeout=30) as s:
        s.sendall(post("/hold"))
        got = b""
        while b"data: 1" not in got:
            got += s.recv(65536)
    until(lambda: COUNTED, "the answer counted")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in got
    assert EVENTS == ["generator closed", "background"] and COUNTED == [(499, "client_closed")]


def test_a_whole_stream_is_counted_by_its_status(ports):
    got = exchange(ports[0], post("/stream"))
    assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    until(lambda: COUNTED, "the answer counted")
    assert COUNTED == [(200, "")] and EVENTS == ["generator closed", "background"]


def test_a_stream_that_fails_mid_body_ends_the_connection_and_counts_broken(ports):
    got = exchange(ports[0], post("/breaks") + post("/json"), until_close=True)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"data: 1\n\n\r\n")  # cut: no last chunk
    until(lambda: COUNTED, "the answer counted")
    assert COUNTED == [(502, "stream_broken")] and EVENTS == ["generator closed"]


def test_a_chunked_body_and_one_past_the_read_buffer_are_read_whole(ports):
    head = b"POST /json HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunked = head + b'5\r\n{"a":\r\n3\r\n 1}\r\n0\r\n\r\n'
    assert exchange(ports[0], chunked).endswith(b'{"ok":true,"got":8}')
    big = b"x" * 300_000  # past uvicorn's 64 KiB: reading pauses until the handler reads on
    with socket.create_connection(("127.0.0.1", ports[0]), timeout=30) as s:
        s.sendall(post("/big", big) + post("/json"))
        got = b""
        while not _complete(got, 2):
            got += s.recv(65536)
    assert b'{"ok":true,"got":300000}' in got and got.endswith(b'{"ok":true,"got":2}')
