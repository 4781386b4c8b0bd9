"""Two engine servers sharing a `ragserve cachestore`: B serves A's context from the store, and the
vLLM external prefix-cache metrics and `cached_tokens` show it."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.engine_server import metric, scrape, start_engine
from tests.helpers.net import free_port
from tests.helpers.process import until

CONTEXT = list(range(5000, 5000 + 16 * 20))  # 20 full blocks


@pytest.fixture
def cachestore(tmp_path):
    metrics_port = free_port()
    args = ["--memory", "256MiB", "--metrics-port", str(metrics_port)]
    store = CacheStoreProcess(tmp_path / "cachestore.log", free_port(), *args).wait_serving()
    yield store.address, f"http://127.0.0.1:{metrics_port}"
    store.stop()


def puts(metrics_url: str) -> float:
    text = httpx.get(metrics_url + "/metrics", timeout=5).text
    families = text_string_to_metric_families(text)
    return sum(s.value for f in families for s in f.samples if s.name == "ragserve_cachestore_puts_total")


def complete(url: str, ids: list[int]) -> dict:
    resp = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def test_peer_blocks_show_as_external_hits(tmp_path, cachestore):
    address, metrics_url = cachestore
    engines = [start_engine(tmp_path, "--num-gpu-blocks", "128", "--cachestore", address) for _ in range(2)]
    try:
        for proc in engines:
            proc.wait_ready()
        a, b = engines
        assert complete(a.url, [*CONTEXT, 11, 12])["prompt_tokens_details"]["cached_tokens"] == 0
        until(lambda: puts(metrics_url) >= 20, what="engine A's blocks offloaded to the cachestore")
        usage = complete(b.url, [*CONTEXT, 21, 22, 23])
        assert usage["prompt_tokens_details"]["cached_tokens"] == 20 * 16
        samples = scrape(b.url)
        assert metric(samples, "vllm:external_prefix_cache_hits_total") == 20 * 16
        assert metric(samples, "vllm:external_prefix_cache_queries_total") >= 20 * 16
        assert metric(scrape(a.url), "vllm:external_prefix_cache_hits_total") == 0
    finally:
        for proc in engines:
            assert proc.stop() == 0, proc.output()[-3000:]
