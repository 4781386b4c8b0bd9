"""The router's HTTP/1.1 client to engines (engine_client.py, engine_wire.py) over real sockets.

Against real simulated engines (`ragserve sim-engine --count 3`): one pool per engine, keep-alive reuse, a
chunked SSE stream handed on as it comes, an unused pool closed but never one still streaming. Against a small
asyncio server for what a healthy engine does not do on cue: close a keep-alive connection between two requests
(the request goes again on a new connection), die in the middle of a body, send nothing (read timeout).
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest

from ragserve.router_args import RouterConfig
from ragserve_router import engine_client
from ragserve_router.engine_client import EngineHTTP
from tests.helpers.process import start, until
from tests.helpers.tiny_models import tiny_model

MODEL = "tiny"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sims")
    urls_file = tmp / "urls.json"
    argv = [sys.executable, "-m", "ragserve.cli", "sim-engine", "--model", str(tiny_model("llama"))]
    argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--free-ports", "--count", "3"]
    argv += ["--engine-id", "sim", "--urls-file", str(urls_file), "--decode-base-s", "0.01"]
    proc = start("sim-engine", argv, tmp / "sim.log")
    try:
        until(urls_file.exists, timeout=60, what="sim engines listening", proc=proc)
        yield [url for _, url in sorted(json.loads(urls_file.read_text()).items())]
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]


def body(max_tokens: int = 1, stream: bool = False) -> bytes:
    req = {"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    return json.dumps(req).encode()


def origin(url: str) -> tuple[str, str, int]:
    return ("http", "127.0.0.1", int(url.rsplit(":", 1)[1]))


async def complete(http: EngineHTTP, url: str, max_tokens: int = 1) -> dict:
    resp = await http.post(url + "/v1/completions", JSON, body(max_tokens))
    try:
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
        return json.loads(await resp.aread())
    finally:
        await resp.aclose()


def test_each_engine_has_its_own_pool_and_reuses_its_connection(sims):
    async def run() -> None:
        http = EngineHTTP(RouterConfig())
        try:
            for _ in range(3):
                for url in sims[:2]:
                    assert (await complete(http, url, 3))["usage"]["completion_tokens"] == 3
            assert set(http.pools) == {origin(u) for u in sims[:2]}
            for url in sims[:2]:
                pool = http.pools[origin(url)]
                assert pool.active == 0 and len(pool.idle) == 1  # three requests, one connection
                assert pool.idle[0].transport.get_extra_info("peername")[1] == origin(url)[2]
        finally:
            await http.aclose()

    asyncio.run(run())


def test_a_chunked_stream_is_handed_on_as_it_comes_and_its_connection_reused(sims):
    async def run() -> None:
        http = EngineHTTP(RouterConfig())
        try:
            resp = await http.post(sims[0] + "/v1/completions", JSON, body(16, stream=True))
            assert resp.status_code == 200 and "chunked" in resp.headers["transfer-encoding"]
            assert resp.headers["content-type"].startswith("text/event-stream")
            conn = resp.conn
            pieces = [piece async for piece in resp.aiter_raw()]
            await resp.aclose()
            text = b"".join(pieces).decode()
            events = [e for e in text.split("\n\n") if e]
            assert len(pieces) > 1 and events[-1] == "data: [DONE]" and len(events) >= 17
            assert "\r\n" not in text  # the chunk framing is taken off
            pool = http.pools[origin(sims[0])]
            assert pool.idle == [conn] and pool.active == 0
            await complete(http, sims[0])
            assert pool.idle == [conn]
        finally:
            await http.aclose()

    asyncio.run(run())


def test_an_unused_pool_is_closed_but_not_one_still_streaming(sims, monkeypatch):
    monkeypatch.setattr(engine_client, "KEEPALIVE_EXPIRY_S", 0.0)  # every pool unused "long enough" at once

    async def run() -> None:
        http = EngineHTTP(RouterConfig())
        try:
            resp = await http.post(sims[0] + "/v1/completions", JSON, body(64, stream=True))
            assert resp.status_code == 200
            await complete(http, sims[1])
            first, second = http.pools[origin(sims[0])], http.pools[origin(sims[1])]
            assert (first.active, second.active) == (1, 0)
            # a third engine's pool: the idle second one goes, the first keeps its open stream
            await complete(http, sims[2])
            assert first in http.pools.values() and second not in http.pools.values() and len(http.pools) == 2
            assert second.idle == []
            text = (await resp.aread()).decode()
            await resp.aclose()
            assert text.rstrip().endswith("data: [DONE]") and text.count('"text"') >= 64
            assert first.active == 0
        finally:
            await http.aclose()

    asyncio.run(run())


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Peer:
    """A server that runs a script per connection, in turn: bytes answer the next request (b"": read it, answer
    nothing), None closes the connection; at the script's end it stays open until the client closes it."""

    def __init__(self, answers: list[list[bytes | None]]) -> None:
        self.answers, self.connections = answers, 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        script = self.answers[self.connections]
        self.connections += 1
        try:
            for answer in script:
                if answer is None:
                    break
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
            else:
                await reader.read()  # keep it open until the client closes it
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def post_ok(http: EngineHTTP, url: str) -> bytes:
    resp = await http.post(url + "/v1/completions", JSON, b"{}")
    try:
        assert resp.status_code == 200
        return await resp.aread()
    finally:
        await resp.aclose()


def test_a_keepalive_connection_the_peer_closes_as_a_request_goes_out_is_retried_on_a_new_one():
    async def run() -> None:
        peer = Peer([[OK, b"", None], [OK]])  # the first connection: answers one request, closes on the next
        async with peer as url:
            http = EngineHTTP(RouterConfig())
            try:
                assert await post_ok(http, url) == b"{}"
                assert await post_ok(http, url) == b"{}"  # written on the pooled one, closed unanswered: again
                assert http.pools[origin(url)].active == 0 and peer.connections == 2
            finally:
                await http.aclose()

    asyncio.run(run())


def test_a_keepalive_connection_the_peer_closed_while_idle_is_not_used():
    async def run() -> None:
        peer = Peer([[OK, None], [OK]])  # the first connection: answers one request, then closes
        async with peer as url:
            http = EngineHTTP(RouterConfig())
            try:
                await post_ok(http, url)
                pool = http.pools[origin(url)]
                while pool.idle:  # until the router sees the close
                    await asyncio.sleep(0.01)
                assert await post_ok(http, url) == b"{}"
                assert peer.connections == 2 and pool.active == 0 and len(pool.idle) == 1
            finally:
                await http.aclose()

    asyncio.run(run())


def test_a_peer_that_dies_in_the_middle_of_a_body_is_an_error_and_the_connection_is_dropped():
    async def run() -> None:
        cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10
        chunked_cut = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
        async with Peer([[cut, None], [chunked_cut, None]]) as url:
            http = EngineHTTP(RouterConfig(upstream_timeout=30))
            try:
                for expected in (b"x" * 10, b"hello"):
                    resp = await http.post(url + "/v1/completions", JSON, b"{}")
                    got = []
                    with pytest.raises(httpx.RemoteProtocolError):
                        async for piece in resp.aiter_raw():
                            got.append(piece)
                    await resp.aclose()
                    assert b"".join(got) == expected
                    pool = http.pools[origin(url)]
                    assert pool.active == 0 and pool.idle == []
            finally:
                await http.aclose()

    asyncio.run(run())


def test_an_engine_that_answers_nothing_times_out_and_one_not_listening_is_a_connect_error():
    async def run() -> None:
        async with Peer([[b""]]) as url:  # reads the request, answers nothing
            http = EngineHTTP(RouterConfig(upstream_timeout=0.2))
            try:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(url + "/v1/completions", JSON, b"{}")
            finally:
                await http.aclose()
        http = EngineHTTP(RouterConfig())
        with pytest.raises(httpx.ConnectError):
            await http.post(url + "/v1/completions", JSON, b"{}")  # the server is gone

    asyncio.run(run())
