"""The engine against the real router (`ragserve router` process): admitted, its KV events make the
router's predicted cache hits equal the engine's actual ones, also after a router restart (snapshot)."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from tests.helpers.engine_server import LONG_CONTEXT, MODEL_NAME, start_engine
from tests.helpers.net import free_port
from tests.helpers.process import start, until
from tests.helpers.prom import router_metric

CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "system", "content": LONG_CONTEXT}, {"role": "user", "content": "What is a block table?"}],
    "max_tokens": 2,
    "temperature": 0,
}


@pytest.fixture
def stack(tmp_path):
    http_port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    routers: list[subprocess.Popen] = []

    def start_router() -> subprocess.Popen:
        argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(http_port)]
        argv += ["--grpc-port", str(grpc_port), "--heartbeat-interval-ms", "300", "--registry-token-file", str(token)]
        routers.append(start("router", argv, tmp_path / f"router-{len(routers)}.log").popen)
        return routers[-1]

    token = tmp_path / "registry-token"
    token.write_text("s3cret-registry-token\n")  # contract 3: router and engine share it
    start_router()
    engine = start_engine(tmp_path, "--num-gpu-blocks", "512", "--router", f"127.0.0.1:{grpc_port}",
                          "--engine-id", "eng-real", "--registry-token-file", str(token))  # fmt: skip
    try:
        engine.wait_ready()
        yield url, engine, start_router, routers
    finally:
        engine.stop()
        for proc in routers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


def engines_ready(url: str) -> int:
    try:
        return httpx.get(url + "/ready", timeout=2).json().get("healthy_engines", 0)
    except (httpx.HTTPError, ValueError):
        return 0


def hit_through_router(url: str) -> dict:
    """Send the chat twice; the second must be predicted by the router's index exactly as the engine hits."""
    first = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert first.status_code == 200, first.text
    until(lambda: router_metric(url, "ragserve_router_kv_events_total", kind="stored") > 0, what="KV events")
    second = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert second.headers["x-ragserve-engine"] == "eng-real"
    return second.json()["usage"]


def test_router_admits_the_engine_and_predicts_its_hits(stack):
    url, engine, start_router, routers = stack
    until(lambda: engines_ready(url) == 1, timeout=60, what="engine registered with the router")
    assert router_metric(url, "ragserve_router_registrations_refused_total") == 0
    usage = hit_through_router(url)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == (usage["prompt_tokens"] - 1) // 16 * 16 > 0
    predicted = router_metric(url, "ragserve_router_predicted_cached_tokens_total", engine="eng-real")
    actual = router_metric(url, "ragserve_router_actual_cached_tokens_total", engine="eng-real")
    assert predicted == actual == cached

    routers[-1].send_signal(signal.SIGTERM)  # a router restart loses the in-memory index
    assert routers[-1].wait(30) == 0
    start_router()
    until(lambda: engines_ready(url) == 1, timeout=60, what="engine re-registered after the router restart")
    until(lambda: router_metric(url, "ragserve_router_kv_events_total", kind="stored") > 0, what="snapshot")
    resp = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert router_metric(url, "ragserve_router_predicted_cached_tokens_total", engine="eng-real") == cached
    assert "sending a KV snapshot" in engine.output()
