"""The HTTP server protocol of the router, the engine and the sims (ragserve/http/joined.py) on real sockets: byte
for byte the answers stock uvicorn gives, a non-streamed answer's head and body in one write, a stream's head at
once (before its first chunk)."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ragserve.http.joined import JoinedHttpProtocol

WRITES: list[bytes] = []  # what the recording protocol's transports were asked to write, in order
GO = threading.Event()  # lets /stream's body go


class _Recorder:
    def __init__(self, transport) -> None:
        self.transport = transport

    def write(self, data: bytes) -> None:
        WRITES.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self.transport, name)


class Recording(JoinedHttpProtocol):
    def connection_made(self, transport) -> None:
        super().connection_made(_Recorder(transport))


async def app(scope, receive, send) -> None:
    path = scope["path"]
    if path == "/json":
        body = b'{"ok": true}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif path == "/parts":  # a length, the body in two messages
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-length", b"6")]})
        await send({"type": "http.response.body", "body": b"abc", "more_body": True})
        await send({"type": "http.response.body", "body": b"def"})
    elif path == "/close":
        headers = [(b"content-length", b"2"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/stream":  # no length: chunked, its head before the body
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        while not GO.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/fail":  # nothing sent: uvicorn's 500
        raise RuntimeError("broken on purpose")


def serve(protocol, application=app) -> tuple[uvicorn.Server, threading.Thread, int]:
    """uvicorn on a thread with this protocol (a class or uvicorn's name for one), on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(application, http=protocol, lifespan="off", log_level="critical", date_header=False,
                            server_header=False, loop="asyncio")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    return server, thread, sock.getsockname()[1]


@pytest.fixture(scope="module")
def ports():
    servers = [serve(Recording), serve(HttpToolsProtocol)]
    yield servers[0][2], servers[1][2]
    for server, thread, _ in servers:
        server.should_exit = True
        thread.join(timeout=10)


def exchange(port: int, raw: bytes, until_close: bool = False, answers: int = 1) -> bytes:
    """Send raw, read until the connection closes or `answers` answers (each ends with its length or 0 chunk)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(raw)
        got = b""
        while data := s.recv(65536):
            got += data
            if not until_close and _complete(got, answers):
                break
        return got


def _complete(got: bytes, answers: int) -> bool:
    n, rest = 0, got
    while (end := rest.find(b"\r\n\r\n")) >= 0:
        head, rest = rest[:end].lower(), rest[end + 4 :]
        if b"transfer-encoding: chunked" in head:
            if (stop := rest.find(b"0\r\n\r\n")) < 0:
                return False
            rest = rest[stop + 5 :]
        else:
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) if b"content-length" in head else 0
            if len(rest) < length:
                return False
            rest = rest[length:]
        n += 1
    return n >= answers


def get(path: str, method: str = "GET", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


@pytest.mark.parametrize(
    "raw,until_close,answers",
    [
        (get("/json"), False, 1),
        (get("/parts"), False, 1),
        (get("/json", "HEAD", "Connection: close\r\n"), True, 1),
        (get("/close"), True, 1),
        (get("/fail"), True, 1),
        (get("/json") + get("/parts") + get("/json"), False, 3),  # pipelined on one connection
        (get("/json", extra="Connection: close\r\n"), True, 1),
    ],
)
def test_answers_are_byte_identical_to_uvicorns(ports, raw, until_close, answers):
    joined, stock = ports
    ours = exchange(joined, raw, until_close, answers)
    assert ours == exchange(stock, raw, until_close, answers)
    assert ours.startswith(b"HTTP/1.1 ")


def test_a_non_streamed_answer_is_one_write(ports):
    WRITES.clear()
    got = exchange(ports[0], get("/json"))
    assert [got] == WRITES and got.endswith(b'\r\n\r\n{"ok": true}')
    WRITES.clear()
    got = exchange(ports[0], get("/parts"))  # the head with the first part, then the rest
    assert len(WRITES) == 2 and WRITES[0].endswith(b"\r\n\r\nabc") and WRITES[1] == b"def"


def test_a_streams_head_goes_out_before_its_body(ports):
    GO.clear()
    WRITES.clear()
    with socket.create_connection(("127.0.0.1", ports[0]), timeout=30) as s:
        s.sendall(get("/stream"))
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(65536)  # the app is still waiting for GO: only the head can have come
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
        GO.set()
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            rest += s.recv(65536)
    assert rest == b"9\r\ndata: 1\n\n\r\n0\r\n\r\n" and WRITES[0] == head
