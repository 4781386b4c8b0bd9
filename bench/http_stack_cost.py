"""What the router's HTTP stack costs per request, to bound a protocol-level generate path (issue 34).

Six servers answer the same POST (the router's answer headers, a completion body) on one keep-alive
connection, one request at a time; each server is a forked process and its user + system CPU per request
is read from /proc:

- `router-stack`: what the router runs around its handler: ragserve.http.direct's protocol (the generate routes
  answered past uvicorn's ASGI cycle), fast_routes.front, read_body and a Starlette Response, counted.
- `asgi-stack`: the router's stack before the direct routes (up to 136bccf): uvicorn with JoinedHttpProtocol,
  CountResponses, a plain ASGI app building a Starlette Request (what FastRoutes did), read_body, a Starlette
  Response.
- `raw-asgi`: the same uvicorn protocol with a bare ASGI app (no middleware, no Starlette objects).
- `uvicorn-protocol-task`: uvicorn's httptools protocol (its parsing, header handling, keep-alive timer) answering
  from a task per request, with no cycle, request or response objects: what the direct routes' own objects and
  writing cost on top of it.
- `bare-protocol-task`: an asyncio protocol on httptools that keeps the headers and answers from a task per
  request: the least a protocol-level generate path (an async handler) could cost.
- `bare-protocol`: the same writing the answer as the request completes, with no task and no headers kept.

Servers are interleaved within each repeat; the table gives the median over --repeats. --gap-ms sleeps
between requests: at 40 ms (25 req/s, one at a time) the server's code runs cold, as the router's does in
bench/router_hop.py at that rate (bench/router_phases.py); the round trip is then the median request's.

    flock /tmp/cpu.lock .venv/bin/python bench/http_stack_cost.py --repeats 5
    flock /tmp/cpu.lock .venv/bin/python bench/http_stack_cost.py --repeats 3 --requests 300 --gap-ms 40 \
        --out bench/results/http_stack_cost-gap40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

import httptools
import uvloop
from report import rotated
from scale_procs import cpu_s

BODY = json.dumps(
    {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
     "choices": [{"text": " hello world", "index": 0, "finish_reason": "length"}],
     "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28}}
).encode()  # fmt: skip
HEADERS = {"content-type": "application/json", "X-Ragserve-Engine": "sim-3", "X-Request-Id": "f" * 32,
           "X-Ragserve-Route-Reason": "prefix_hit", "X-Ragserve-Predicted-Ttft-Ms": "12"}  # fmt: skip
PROMPT = json.dumps({"model": "m", "prompt": "the quick brown fox " * 8, "max_tokens": 16, "temperature": 0})
REQUEST = (
    "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    f"authorization: Bearer key\r\nuser-agent: bench\r\ncontent-length: {len(PROMPT)}\r\n\r\n{PROMPT}"
).encode()


def router_stack(sock: socket.socket) -> None:
    from starlette.responses import Response

    from ragserve.http.body import read_body
    from ragserve.http.direct import Direct, direct_protocol
    from ragserve_router.fast_routes import front

    async def completions(request):
        raw = await read_body(request, 1 << 20)
        request.state.tenant = request.headers.get("authorization") and "-"
        return Response(BODY if raw else b"", status_code=200, headers=HEADERS)

    direct = Direct({"/v1/completions": front(completions, lambda r: None)}, "router", lambda o: None)
    _serve_uvicorn(no_app, direct_protocol(direct), sock)


def asgi_stack(sock: socket.socket) -> None:
    from starlette.requests import Request
    from starlette.responses import Response

    from ragserve.http.body import read_body
    from ragserve.http.joined import JoinedHttpProtocol
    from ragserve.http.outcomes import CountResponses
    from ragserve_router.fast_routes import assign_request_id

    async def app(scope, receive, send) -> None:
        request = Request(scope, receive)
        assign_request_id(request)
        raw = await read_body(request, 1 << 20)
        request.state.tenant = request.headers.get("authorization") and "-"
        await Response(BODY if raw else b"", status_code=200, headers=HEADERS)(scope, receive, send)

    _serve_uvicorn(CountResponses(app, count=lambda o: None), JoinedHttpProtocol, sock)


def raw_asgi(sock: socket.socket) -> None:
    from ragserve.http.joined import JoinedHttpProtocol

    head = [(k.lower().encode(), v.encode()) for k, v in HEADERS.items()]
    head.append((b"content-length", str(len(BODY)).encode()))

    async def app(scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": BODY})

    _serve_uvicorn(app, JoinedHttpProtocol, sock)


async def no_app(scope, receive, send) -> None:
    """The ASGI app of a server whose protocol answers /v1/completions itself: the bench asks for nothing else."""
    raise AssertionError(f"{scope['path']}: only /v1/completions is asked for")


def _serve_uvicorn(app, protocol, sock: socket.socket) -> None:
    import uvicorn

    config = uvicorn.Config(app, loop="none", http=protocol, lifespan="off", log_level="warning")
    asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))


class Bare(asyncio.Protocol):
    ANSWER = ("HTTP/1.1 200 OK\r\n" + "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
              + f"content-length: {len(BODY)}\r\n\r\n").encode() + BODY  # fmt: skip

    def connection_made(self, transport) -> None:
        self.transport, self.parser, self.body = transport, httptools.HttpRequestParser(self), []

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.body = []
        self.transport.write(self.ANSWER)


class BareTask(Bare):
    """Bare, plus what any real generate path does: the headers kept, the answer written by a task per request
    (an async handler: the router's awaits its engine)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.headers: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_message_complete(self) -> None:
        body, headers, self.body, self.headers = b"".join(self.body), self.headers, [], []
        asyncio.get_running_loop().create_task(self.handle(headers, body))

    async def handle(self, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if body and headers:
            self.transport.write(self.ANSWER)


def uvicorn_protocol_task(sock: socket.socket) -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Answering(HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            self.cycle = None  # no cycle: on_body and on_message_complete are ours

        def on_body(self, body: bytes) -> None:
            pass

        def on_message_complete(self) -> None:
            asyncio.get_running_loop().create_task(self.handle())

        async def handle(self) -> None:
            self.transport.write(Bare.ANSWER)
            self.on_response_complete()

    _serve_uvicorn(no_app, Answering, sock)


def bare(protocol: type[asyncio.Protocol]):
    def serve(sock: socket.socket) -> None:
        async def main() -> None:
            server = await asyncio.get_running_loop().create_server(protocol, sock=sock)
            await server.serve_forever()

        asyncio.run(main())

    return serve


SERVERS = {
    "router-stack": router_stack,
    "asgi-stack": asgi_stack,
    "raw-asgi": raw_asgi,
    "uvicorn-protocol-task": uvicorn_protocol_task,
    "bare-protocol-task": bare(BareTask),
    "bare-protocol": bare(Bare),
}


def one(name: str, requests: int, gap_s: float = 0.0) -> dict:
    """CPU us per request of server `name`, and the client's round trip (median)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    pid = os.fork()
    if pid == 0:
        uvloop.install()
        SERVERS[name](sock)
        os._exit(0)
    port = sock.getsockname()[1]
    sock.close()
    try:
        client = _connect(port)
        for _ in range(300):  # warm-up
            _exchange(client)
        cpu0, rtts = cpu_s(pid), []
        for _ in range(requests):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            _exchange(client)
            rtts.append(time.perf_counter() - t0)
        cpu = cpu_s(pid) - cpu0
        client.close()
        return {"cpu_us_per_req": 1e6 * cpu / requests, "rtt_us": 1e6 * statistics.median(rtts)}
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _connect(port: int) -> socket.socket:
    for _ in range(200):
        try:
            client = socket.create_connection(("127.0.0.1", port))
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return client
        except ConnectionRefusedError:
            time.sleep(0.05)
    raise SystemExit(f"no server on port {port}")


def _exchange(client: socket.socket) -> None:
    client.sendall(REQUEST)
    got = b""
    while not got.endswith(BODY):
        chunk = client.recv(65536)
        if not chunk:
            raise SystemExit("the server closed the connection")
        got += chunk


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--gap-ms", type=float, default=0.0, help="idle time before each request")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "http_stack_cost"))
    args = p.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in SERVERS}
    for rep in range(args.repeats):
        for name in rotated(list(SERVERS), rep):
            runs[name].append(one(name, args.requests, args.gap_ms / 1000))
            print(name, rep, runs[name][-1], flush=True)
    gap = f", {args.gap_ms:g} ms idle before each" if args.gap_ms else ""
    lines = [f"# HTTP stack cost per request (bench/http_stack_cost.py, {args.requests} sequential requests{gap}, "
             f"median of {args.repeats} interleaved repeats, {time.strftime('%Y-%m-%d', time.gmtime())})", "",
             "| server | CPU us / req | each repeat | round trip us |", "|---|---:|---|---:|"]  # fmt: skip
    for name, rs in runs.items():
        each = ", ".join(f"{r['cpu_us_per_req']:.0f}" for r in rs)
        cpu, rtt = (statistics.median(r[k] for r in rs) for k in ("cpu_us_per_req", "rtt_us"))
        lines.append(f"| {name} | {cpu:.0f} | {each} | {rtt:.0f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps(runs, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
