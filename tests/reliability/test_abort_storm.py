"""An abort storm leaks nothing: 200 streams through the router whose clients leave after the first chunk
leave the engine with no running or waiting request and no KV block in use, and the router with none in
flight, while streams of clients that stay complete whole; the engine then serves normally."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from ragserve.metric_names import KV_CACHE_USAGE, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from tests.helpers.engine_server import scrape
from tests.reliability.conftest import ready, start_engines


def gauges(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {name: sum(v for k, v in samples.items() if k.startswith(name + "{")) for name in
            (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE)}  # fmt: skip


def test_two_hundred_aborted_streams_leave_no_request_and_no_block_behind(cluster, metrics, until):
    router = cluster.router()
    (engine,) = start_engines(cluster, router, ["storm"], "--max-model-len", "512", "--num-gpu-blocks", "256")
    until(lambda: ready(router)["healthy_engines"] == 1, timeout=60, message="engine registered")

    def leave_after_first_chunk(i: int) -> bool:
        body = {"model": "tiny", "prompt": f"request {i} " + "and more words " * 20, "max_tokens": 400,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as resp:
            return resp.status_code == 200 and any(line.startswith("data: ") for line in resp.iter_lines())

    def stay(i: int) -> int:
        """A client that reads its whole stream: the tokens it got."""
        body = {"model": "tiny", "prompt": f"bystander {i}", "max_tokens": 24, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert resp.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        return json.loads(lines[-2][6:])["usage"]["completion_tokens"]

    with ThreadPoolExecutor(64) as pool:
        bystanders = [pool.submit(stay, i) for i in range(4)]
        assert all(pool.map(leave_after_first_chunk, range(200)))
        assert [b.result() for b in bystanders] == [24] * 4
    until(lambda: not any(gauges(engine.url).values()), timeout=30, message="engine gauges back to 0")
    assert metrics(router.url, "ragserve_router_requests_in_flight") == 0
    body = {"model": "tiny", "prompt": "after the storm", "max_tokens": 4}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=60).status_code == 200
