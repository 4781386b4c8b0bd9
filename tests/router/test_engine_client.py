"""The router's client to engines (engine_client.py): one connection pool per engine, against real simulated
engines (`ragserve sim-engine --count 3`). Requests to an engine use only its own pool; a pool nobody used
for the keep-alive time is closed when another engine's is made, but never one with a response still open."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from ragserve.router_args import RouterConfig
from ragserve_router import engine_client
from ragserve_router.engine_client import engine_http_client
from tests.helpers.process import start, until
from tests.helpers.tiny_models import tiny_model

MODEL = "tiny"


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


def body(max_tokens: int = 1, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def peers(pool) -> set[int]:
    """Remote ports of the pool's open connections."""
    ports = set()
    for conn in pool.transport._pool.connections:
        stream = conn._connection._network_stream if conn._connection else None
        if stream is not None:
            ports.add(stream.get_extra_info("server_addr")[1])
    return ports


def test_each_engine_has_its_own_pool(sims):
    async def run() -> None:
        client = engine_http_client(RouterConfig())
        try:
            for _ in range(3):
                for url in sims[:2]:
                    assert (await client.post(url + "/v1/completions", json=body())).status_code == 200
            pools = client._transport.pools
            assert len(pools) == 2
            for url in sims[:2]:
                port = int(url.rsplit(":", 1)[1])
                pool = pools[(b"http", b"127.0.0.1", port)]
                assert peers(pool) == {port} and pool.active == 0
        finally:
            await client.aclose()

    asyncio.run(run())


def test_an_unused_pool_is_closed_but_not_one_still_streaming(sims, monkeypatch):
    monkeypatch.setattr(engine_client, "KEEPALIVE_EXPIRY_S", 0.0)  # every pool unused "long enough" at once

    async def run() -> None:
        client = engine_http_client(RouterConfig())
        try:
            streaming = client.build_request("POST", sims[0] + "/v1/completions", json=body(64, stream=True))
            resp = await client.send(streaming, stream=True)
            assert resp.status_code == 200
            assert (await client.post(sims[1] + "/v1/completions", json=body())).status_code == 200
            first, second = (client._transport.pools[o] for o in list(client._transport.pools))
            assert (first.active, second.active) == (1, 0)
            # a third engine's pool: the idle second one goes, the first keeps its open stream
            assert (await client.post(sims[2] + "/v1/completions", json=body())).status_code == 200
            pools = client._transport.pools
            assert first in pools.values() and second not in pools.values() and len(pools) == 2
            text = (await resp.aread()).decode()
            await resp.aclose()
            assert text.rstrip().endswith("data: [DONE]") and text.count('"text"') >= 64
            assert first.active == 0
        finally:
            await client.aclose()

    asyncio.run(run())
