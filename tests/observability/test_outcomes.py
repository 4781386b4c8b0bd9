"""ragserve.http.outcomes on a real uvicorn server and sockets: the race a stream's count used to lose.

The app below never ends its streams by itself (it waits on an event), so the client's disconnect is what ends
them: a stream whose `data: [DONE]` was written counts 200 however it ends; one cut before counts 499.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from ragserve.http.errors import ApiError, install_error_handlers
from ragserve.http.outcomes import CountResponses, Outcome
from tests.helpers.net import free_port
from tests.helpers.process import until


@pytest.fixture(scope="module")
def server():
    counted: list[Outcome] = []
    app = FastAPI()
    install_error_handlers(app, "test", __import__("logging").getLogger("test"))
    app.add_middleware(CountResponses, count=counted.append)

    async def events(done: bool, end: bool):
        yield b"data: {}\n\n"
        if done:
            yield b"data: [DONE]\n\n"
        if not end:
            await asyncio.Event().wait()  # only a disconnect ends it

    @app.get("/stream/{kind}")
    async def stream(kind: str):
        body = events(done=kind in ("done", "complete"), end=kind in ("complete", "broken"))
        return StreamingResponse(body, media_type="text/event-stream")

    @app.get("/error")
    async def error():
        raise ApiError(422, "bad", "custom_code")

    @app.get("/ok")
    async def ok():
        return JSONResponse({"ok": True})

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    until(lambda: uv.started, timeout=10, what="uvicorn")
    yield f"127.0.0.1:{port}", counted
    uv.should_exit = True
    thread.join(10)


def read_until_then_close(address: str, path: str, marker: bytes) -> bytes:
    host, port = address.split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        got = b""
        while marker not in got:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
    return got  # the socket is closed here, the stream still open on the server


def outcome(counted: list[Outcome], n: int) -> tuple[int, str]:
    until(lambda: len(counted) >= n, timeout=10, what=f"{n} answers counted")
    assert len(counted) == n
    return counted[-1].status, counted[-1].reason


def test_streams(server):
    address, counted = server
    n = len(counted)  # what the module's other tests counted before
    read_until_then_close(address, "/stream/done", b"data: [DONE]")
    assert outcome(counted, n + 1) == (200, "")  # left right after [DONE]: complete
    read_until_then_close(address, "/stream/mid", b"data: {}")
    assert outcome(counted, n + 2) == (499, "client_closed")  # left mid-stream
    assert httpx.get(f"http://{address}/stream/complete").status_code == 200
    assert outcome(counted, n + 3) == (200, "")
    httpx.get(f"http://{address}/stream/broken")  # ended without [DONE]: the server failed mid-body
    assert outcome(counted, n + 4) == (502, "stream_broken")


def test_plain_answers(server):
    address, counted = server
    n = len(counted)
    assert httpx.get(f"http://{address}/ok").status_code == 200
    assert outcome(counted, n + 1) == (200, "")
    assert httpx.get(f"http://{address}/error").status_code == 422
    assert outcome(counted, n + 2) == (422, "custom_code")
    assert httpx.get(f"http://{address}/nowhere").status_code == 404
    assert outcome(counted, n + 3) == (404, "not_found")
    assert httpx.post(f"http://{address}/ok").status_code == 405
    assert outcome(counted, n + 4) == (405, "http_405")
    httpx.get(f"http://{address}/health")  # probes are not answers to count
    httpx.get(f"http://{address}/ok")
    assert outcome(counted, n + 5) == (200, "")
