"""Routing outcomes through a real router: prefix affinity, hot-prefix spreading, static engines, policies."""

from __future__ import annotations

import threading

import httpx
import pytest

DOCS = [" ".join(f"doc{d}-fact{i}" for i in range(150)) for d in range(6)]


def rag(doc: int, question: str, **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": f"Answer from the context.\n\nContext:\n{DOCS[doc]}"},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
        **extra,
    }


def post(router, body: dict, **kw) -> httpx.Response:
    resp = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60, **kw)
    assert resp.status_code == 200, resp.text
    return resp


def ready(router) -> dict:
    return httpx.get(router.url + "/ready", timeout=5).json()


@pytest.fixture(scope="module")
def registered(module_cluster):
    """A kv_aware router with three engines that register and stream KV events."""
    router = module_cluster.router("--heartbeat-interval-ms", "300", "--guard-abs", "2", "--allow-policy-header")
    engines = [module_cluster.engine(f"kv-{i}", router=router) for i in range(3)]
    deadline = 100
    while ready(router)["engines"] < 3 and deadline:
        threading.Event().wait(0.1)
        deadline -= 1
    return router, engines


def test_requests_sharing_a_prefix_land_where_it_is_cached(registered, metrics, until):
    router, _ = registered
    homes = {}
    for doc in range(3):
        first = post(router, rag(doc, "What is the first fact?"))
        homes[doc] = first.headers["x-ragserve-engine"]
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        until(
            lambda d=doc: metrics(router.url, "ragserve_router_kv_events_total", kind="stored") >= d + 1,
            message="KV events applied",
        )
    for doc in range(3):
        for q in range(3):
            resp = post(router, rag(doc, f"Question number {q} about it?"))
            usage = resp.json()["usage"]
            assert resp.headers["x-ragserve-engine"] == homes[doc]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 48
    predicted = metrics.total(router.url, "ragserve_router_predicted_cached_tokens_total")
    actual = metrics.total(router.url, "ragserve_router_actual_cached_tokens_total")
    assert actual > 0 and predicted == actual  # the router's hashes are the engine's hashes


def test_cache_salt_changes_the_prefix(registered):
    router, _ = registered
    home = post(router, rag(3, "q?")).headers["x-ragserve-engine"]
    assert post(router, rag(3, "q2?")).headers["x-ragserve-engine"] == home
    salted = post(router, rag(3, "q3?", cache_salt="tenant-b")).json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_hot_prefix_spreads_once_the_guard_trips(registered, metrics):
    """Held streams keep requests in flight; with --guard-abs 2 the hot document must spread."""
    router, engines = registered
    guard_before = metrics(
        router.url, "ragserve_router_routing_decisions_total", policy="kv_aware", reason="imbalance_guard"
    )
    post(router, rag(4, "warm up"))
    for e in engines:
        httpx.post(e.url + "/control/hold")
    used: list[str] = []
    streams = []
    client = httpx.Client(timeout=60)
    try:
        for i in range(9):
            body = rag(4, f"hot {i}", stream=True)
            req = client.build_request("POST", router.url + "/v1/chat/completions", json=body)
            resp = client.send(req, stream=True)
            lines = resp.iter_lines()
            next(line for line in lines if line)  # in flight, held by the engine
            used.append(resp.headers["x-ragserve-engine"])
            streams.append((resp, lines))
    finally:
        for e in engines:
            httpx.post(e.url + "/control/release")
        for resp, lines in streams:
            assert [line for line in lines if line][-1] == "data: [DONE]"
            resp.close()
        client.close()
    assert len(set(used)) >= 2, used
    assert max(used.count(e) for e in set(used)) <= 6
    assert (
        metrics(router.url, "ragserve_router_routing_decisions_total", policy="kv_aware", reason="imbalance_guard")
        > guard_before
    )


def test_context_header_pins_the_prefix_policy(registered):
    router, _ = registered
    headers = {"X-Ragserve-Policy": "prefix", "X-Context-Hash": "doc-abc"}
    picks = {post(router, rag(d, "q"), headers=headers).headers["x-ragserve-engine"] for d in range(4)}
    assert len(picks) == 1


def test_session_policy_keeps_a_user_on_one_engine(registered):
    router, _ = registered
    headers = {"X-Ragserve-Policy": "session"}
    picks = {post(router, rag(d, "q", user="alice"), headers=headers).headers["x-ragserve-engine"] for d in range(4)}
    assert len(picks) == 1


def test_static_engines_are_routed_by_the_approximate_index(cluster, until):
    engines = [cluster.engine(f"st-{i}") for i in range(3)]
    router = cluster.router("--static-engines", ",".join(e.url for e in engines))
    until(lambda: ready(router)["healthy_engines"] == 3, message="static engines probed")
    homes = {}
    for doc in range(6):
        homes[doc] = post(router, rag(doc, "first")).headers["x-ragserve-engine"]
    assert len(set(homes.values())) >= 2  # different documents spread
    for doc in range(6):
        resp = post(router, rag(doc, "again, another question"))
        assert resp.headers["x-ragserve-engine"] == homes[doc]
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
