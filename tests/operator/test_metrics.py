"""Reading engine load from Prometheus exposition (rendered by prometheus_client, served over loopback)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest, start_http_server

from ragserve.prom_text import EngineLoad as PodMetrics
from ragserve.prom_text import engine_load as parse_metrics
from ragserve.prom_text import samples
from ragserve_operator.scaling.pod_metrics import pod_metrics_url, scrape_pods


def exposition(
    waiting: dict[str, float], running: float = 0.0, kv: float = 0.0, queued: float = 0.0
) -> CollectorRegistry:
    """A registry with the engine's load gauges (one series per served model)."""
    registry = CollectorRegistry()
    labels = ["model_name"]
    w = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry)
    r = Gauge("vllm:num_requests_running", "running", labels, registry=registry)
    k = Gauge("vllm:kv_cache_usage_perc", "kv usage", labels, registry=registry)
    q = Gauge("ragserve:num_queued_prefill_tokens", "queued prompt tokens", labels, registry=registry)
    for i, (model, n) in enumerate(waiting.items()):
        w.labels(model).set(n)
        q.labels(model).set(queued)
        r.labels(model).set(running if i == 0 else 0)
        k.labels(model).set(kv if i == 0 else kv / 2)
    Gauge("vllm:num_requests_waiting_total_bogus", "not ours", registry=registry).set(99)
    return registry


def test_parse_sums_requests_and_takes_the_highest_kv_usage():
    text = generate_latest(exposition({"a": 3, "b": 2}, running=5, kv=0.5, queued=700)).decode()
    assert parse_metrics(text) == PodMetrics(waiting=5.0, running=5.0, kv_usage=0.5, queued_prefill_tokens=1400.0)


def test_parse_names_what_is_missing():
    with pytest.raises(ValueError, match="vllm:kv_cache_usage_perc"):
        parse_metrics("vllm:num_requests_waiting 1\nvllm:num_requests_running 0\n")


def pod(ip: str | None, port: int = 8000, ready: bool = True, phase: str = "Running", deleting: bool = False) -> dict:
    meta = {"name": "p", "deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {"name": "p"}
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_pod_metrics_url():
    assert pod_metrics_url(pod("10.1.2.3", 8123)) == "http://10.1.2.3:8123/metrics"
    assert pod_metrics_url(pod("fd00::7")) == "http://[fd00::7]:8000/metrics"
    assert pod_metrics_url(pod("10.1.2.3", ready=False)) is None
    assert pod_metrics_url(pod(None)) is None
    assert pod_metrics_url(pod("10.1.2.3", phase="Pending")) is None


@pytest.mark.asyncio
async def test_scrape_pods_over_http(port):
    server, thread = start_http_server(port, addr="127.0.0.1", registry=exposition({"m": 7}, running=2, kv=0.25))
    try:
        pods = [
            pod("127.0.0.1", port),
            pod("127.0.0.1", port, ready=False),  # counts, without metrics
            pod("127.0.0.1", 1),  # nothing listens there: counts, without metrics
            pod("127.0.0.1", port, deleting=True),  # terminating: does not count
            pod("127.0.0.1", port, phase="Failed"),
        ]
        samples = await scrape_pods(pods, timeout_s=2.0)
    finally:
        server.shutdown()
        thread.join()
    assert samples == [PodMetrics(waiting=7.0, running=2.0, kv_usage=0.25, queued_prefill_tokens=0.0), None, None]


def test_label_values_with_escapes_and_braces_parse_like_prometheus_client():
    registry = CollectorRegistry()
    g = Gauge("vllm:kv_cache_usage_perc", "kv usage", ["model_name"], registry=registry)
    g.labels('a "quoted", \\ {odd} model\nname').set(0.75)
    text = generate_latest(registry).decode()
    (sample,) = [s for s in samples(text) if s.name == "vllm:kv_cache_usage_perc"]
    assert sample.labels == {"model_name": 'a "quoted", \\ {odd} model\nname'} and sample.value == 0.75


def test_the_v0_kv_usage_name_and_optional_metrics():
    text = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.4\n'
    assert parse_metrics(text, required=False) == PodMetrics(0.0, 0.0, 0.4, queued_prefill_tokens=0.0)
    with pytest.raises(ValueError, match="vllm:num_requests_waiting, vllm:num_requests_running"):
        parse_metrics(text)


def test_a_malformed_line_is_an_error():
    with pytest.raises(ValueError, match="malformed"):
        parse_metrics("vllm:num_requests_waiting{model_name=unquoted} 1\n")
