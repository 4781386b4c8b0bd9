"""`ragserve sim-engine` against the real router: it must speak an engine's surface exactly.

A real `ragserve router` (kv_aware) admits two simulated engines of one `--count 2` process (its tokenizer and
probe-hash checks), routes to them, and applies their KV events so its predicted cached tokens equal the sims'
usage.prompt_tokens_details.cached_tokens, also after LRU evictions. Responses (JSON and SSE) and /metrics
have exactly the keys and metric families of a real tiny engine's.
"""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.engine_server import LONG_CONTEXT, running_engine
from tests.helpers.net import free_port
from tests.helpers.process import start, until, wait_http
from tests.helpers.prom import router_metric
from tests.helpers.tiny_models import tiny_model

MODEL = "tiny-llama"  # tests.helpers.engine_server's served name, so bodies compare with the real engine's
NUM_BLOCKS = 64  # 1,024 tokens per sim: a few chats evict


def chat(doc: int, question: str = "What is a block table?", **extra) -> dict:
    system = f"Document {doc}. " + LONG_CONTEXT
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sim")
    http_port, grpc_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{http_port}"
    argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(http_port)]
    argv += ["--grpc-port", str(grpc_port), "--policy", "kv_aware", "--heartbeat-interval-ms", "300"]
    router = start("router", [*argv, "--registry-allow-unauthenticated"], tmp / "router.log")
    urls_file = tmp / "urls.json"
    argv = [sys.executable, "-m", "ragserve.cli", "sim-engine", "--model", str(tiny_model("llama"))]
    argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--free-ports", "--count", "2"]
    argv += ["--engine-id", "sim", "--num-gpu-blocks", str(NUM_BLOCKS), "--router", f"127.0.0.1:{grpc_port}"]
    argv += ["--urls-file", str(urls_file), "--prefill-tokens-per-s", "50000", "--decode-base-s", "0.002"]
    sims = start("sim-engine", argv, tmp / "sim.log")
    try:
        wait_http(router_url + "/health", proc=router)
        until(urls_file.exists, timeout=60, what="sim engines listening", proc=sims)
        urls = json.loads(urls_file.read_text())
        until(lambda: httpx.get(router_url + "/ready").json().get("healthy_engines") == 2, timeout=60,
              what="both sims registered", proc=sims)  # fmt: skip
        yield router_url, urls, sims
    finally:
        assert sims.stop() == 0, sims.output()[-3000:]
        assert router.stop() == 0, router.output()[-3000:]


def settled(router: str) -> None:
    """Until the router's applied KV ops stop changing (the sims publish a request's events before answering it,
    so this is the last of them arriving over loopback gRPC)."""
    seen: list[float] = []

    def still() -> bool:
        seen.append(router_metric(router, "ragserve_router_kv_events_total"))
        return len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]

    until(still, interval=0.2, what="KV events applied")


def routed(router: str, body: dict) -> httpx.Response:
    resp = httpx.post(router + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    settled(router)
    return resp


def cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_router_admits_both_sims_as_separate_engines(fleet):
    router, urls, _ = fleet
    assert sorted(urls) == ["sim-0", "sim-1"] and len(set(urls.values())) == 2
    assert router_metric(router, "ragserve_router_registrations_refused_total") == 0


def test_kv_aware_predicts_the_sims_hits_exactly_also_after_evictions(fleet):
    router, _, _ = fleet
    first = routed(router, chat(1))
    assert cached(first) == 0
    again = routed(router, chat(1, "And a free queue?"))
    assert again.headers["x-ragserve-engine"] == first.headers["x-ragserve-engine"]
    hit = cached(again)
    assert hit > 0 and hit % 16 == 0
    for doc in range(2, 8):  # more documents than two 64-block pools hold: both sims evict
        routed(router, chat(doc))
    assert router_metric(router, "ragserve_router_kv_events_total", kind="removed") > 0
    hits = [cached(routed(router, chat(doc, "Why chained hashes?"))) for doc in (7, 6, 1)]
    assert hits[0] > 0  # still cached
    predicted = router_metric(router, "ragserve_router_predicted_cached_tokens_total")
    actual = router_metric(router, "ragserve_router_actual_cached_tokens_total")
    assert predicted == actual == hit + sum(hits)


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("real"), "--num-gpu-blocks", str(NUM_BLOCKS)) as proc:
        yield proc.url


def shape(value):
    """The keys of a JSON value, recursively (list items merged); scalars and nulls alike are "value"."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        merged: dict = {}
        for item in value:
            merged |= s if isinstance(s := shape(item), dict) else {"": s}
        return [merged]
    return "value"


def sse(url: str, body: dict) -> list:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_responses_have_the_real_engines_shape(fleet, real_engine):
    _, urls, _ = fleet
    sim = urls["sim-0"]
    for path, body in (
        ("/v1/chat/completions", chat(20)),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "ignore_eos": True}),
    ):
        mine, theirs = (httpx.post(u + path, json=body, timeout=30) for u in (sim, real_engine))
        assert mine.status_code == theirs.status_code == 200
        assert shape(mine.json()) == shape(theirs.json())
    body = chat(21, stream=True, stream_options={"include_usage": True})
    mine, theirs = sse(sim, body), sse(real_engine, body)
    assert [shape(c) for c in mine[:1] + mine[-2:]] == [shape(c) for c in theirs[:1] + theirs[-2:]]
    assert mine[-1]["usage"]["prompt_tokens"] == theirs[-1]["usage"]["prompt_tokens"]  # the same tokenizer
    bad = {"model": "nope", "prompt": "Hi"}
    mine, theirs = (httpx.post(u + "/v1/completions", json=bad, timeout=30) for u in (sim, real_engine))
    assert (mine.status_code, mine.json()) == (theirs.status_code, theirs.json())
    given = httpx.post(sim + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "first_token_id": 5}, timeout=30)
    assert given.status_code == 400 and "first_token_id" in given.json()["error"]["message"]  # not simulated: said


def families(url: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)}


def test_metrics_are_the_real_engines_families(fleet, real_engine):
    _, urls, _ = fleet
    mine = families(urls["sim-1"])
    assert mine == families(real_engine)
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= mine


def test_the_sims_connections_send_without_nagle():
    """The sims serve on sockets they bind themselves (fleet.bind): accepted connections must have TCP_NODELAY,
    or uvicorn's two writes (headers, body) wait for a delayed ACK, 40 ms, on a busy keep-alive connection."""
    import asyncio
    import socket

    from ragserve_engine.sim.fleet import bind

    async def accepted_nodelay() -> int:
        sock = bind("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_client(_reader, writer) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        try:
            return await seen
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) == 1
