"""/metrics parses with prometheus_client and moves with traffic."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

FAMILIES = {
    "ragserve_router_requests": "counter",
    "ragserve_router_request_errors": "counter",
    "ragserve_router_engine_errors": "counter",
    "ragserve_router_retries": "counter",
    "ragserve_router_routing_decisions": "counter",
    "ragserve_router_predicted_cached_tokens": "counter",
    "ragserve_router_actual_cached_tokens": "counter",
    "ragserve_router_time_to_first_token_seconds": "histogram",
    "ragserve_router_request_duration_seconds": "histogram",
    "ragserve_router_routing_seconds": "histogram",
    "ragserve_router_engines_registered": "gauge",
    "ragserve_router_engines_healthy": "gauge",
    "ragserve_router_registrations_refused": "counter",
}


def test_metrics_families_and_values(cluster, metrics, until):
    router = cluster.router("--heartbeat-interval-ms", "300")
    cluster.engine("m-0", router=router)
    until(lambda: metrics(router.url, "ragserve_router_engines_healthy") == 1, message="engine healthy")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2}
    httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30).raise_for_status()
    with httpx.stream("POST", router.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        resp.read()
    httpx.post(router.url + "/v1/chat/completions", json={**body, "model": "missing"})

    resp = httpx.get(router.url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name, kind in FAMILIES.items():
        assert families[name].type == kind, name
    ok = {"model": "tiny", "engine": "m-0", "policy": "kv_aware", "code": "200"}
    assert metrics(router.url, "ragserve_router_requests_total", **ok) == 2
    assert metrics(router.url, "ragserve_router_request_errors_total", model="", kind="model_not_found") == 1
    assert metrics(router.url, "ragserve_router_time_to_first_token_seconds_count", model="tiny") == 1
    assert metrics(router.url, "ragserve_router_request_duration_seconds_count", model="tiny") == 2
    assert metrics(router.url, "ragserve_router_routing_seconds_count") == 2
    assert metrics(router.url, "ragserve_router_engines_registered", source="grpc") == 1
    assert metrics.total(router.url, "ragserve_router_routing_decisions_total") == 2
    assert metrics(router.url, "ragserve_router_requests_in_flight") == 0
