"""Routing outcomes through a real router in front of real engines: prefix affinity, cache_salt, the
prefix and session policies, static engines routed by the approximate index."""

from __future__ import annotations

import httpx

DOCS = [" ".join(f"routing-doc{d} fact{i} is {i * 7 % 11}." for i in range(60)) for d in range(10)]


def rag(doc: int | str, question: str, **extra) -> dict:
    context = DOCS[doc] if isinstance(doc, int) else doc
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": f"Answer from the context.\n\nContext:\n{context}"},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
        **extra,
    }


def post(router, body: dict, **kw) -> httpx.Response:
    resp = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120, **kw)
    assert resp.status_code == 200, resp.text
    return resp


def cached(resp: httpx.Response) -> int:
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def ready(router) -> dict:
    return httpx.get(router.url + "/ready", timeout=5).json()


def test_requests_sharing_a_prefix_land_where_it_is_cached(fleet, metrics, until):
    router = fleet.router
    stored = lambda: metrics(router.url, "ragserve_router_kv_events_total", kind="stored")  # noqa: E731
    homes = {}
    for doc in range(3):
        before = stored()
        first = post(router, rag(doc, "What is the first fact?"))
        homes[doc] = first.headers["x-ragserve-engine"]
        assert cached(first) <= 16  # at most the chat template's first block, which every document shares
        until(lambda b=before: stored() > b, message="the engine's KV events reached the router")
    predicted_before = metrics.total(router.url, "ragserve_router_predicted_cached_tokens_total")
    actual_before = metrics.total(router.url, "ragserve_router_actual_cached_tokens_total")
    for doc in range(3):
        for q in range(3):
            resp = post(router, rag(doc, f"Question number {q} about it?"))
            usage = resp.json()["usage"]
            assert resp.headers["x-ragserve-engine"] == homes[doc]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 48
    predicted = metrics.total(router.url, "ragserve_router_predicted_cached_tokens_total") - predicted_before
    actual = metrics.total(router.url, "ragserve_router_actual_cached_tokens_total") - actual_before
    assert actual > 0 and predicted == actual  # the router's index agrees with what the engines really reused


def test_cache_salt_separates_tenants(fleet):
    router = fleet.router
    home = post(router, rag(3, "q?")).headers["x-ragserve-engine"]
    assert cached(post(router, rag(3, "q2?"))) > 0
    first_salted = post(router, rag(3, "q3?", cache_salt="tenant-b"))
    assert cached(first_salted) == 0  # the same text under another salt shares nothing
    again = post(router, rag(3, "q4?", cache_salt="tenant-b"))
    assert cached(again) > 0 and again.headers["x-ragserve-engine"] == first_salted.headers["x-ragserve-engine"]
    assert post(router, rag(3, "q5?")).headers["x-ragserve-engine"] == home


def test_context_header_pins_the_prefix_policy(fleet):
    headers = {"X-Ragserve-Policy": "prefix", "X-Context-Hash": "doc-abc"}
    picks = {post(fleet.router, rag(d, "q"), headers=headers).headers["x-ragserve-engine"] for d in range(4, 8)}
    assert len(picks) == 1


def test_session_policy_keeps_a_user_on_one_engine(fleet):
    headers = {"X-Ragserve-Policy": "session"}
    picks = {post(fleet.router, rag(d, "q", user="alice"), headers=headers).headers["x-ragserve-engine"]
             for d in range(4, 8)}  # fmt: skip
    assert len(picks) == 1


def test_static_engines_are_routed_by_the_approximate_index(fleet, cluster, until):
    """A router without the registry (plain URLs) learns where prefixes are from its own decisions."""
    router = cluster.router("--static-engines", ",".join(e.url for e in fleet.engines))
    until(lambda: ready(router)["healthy_engines"] == 3, message="static engines probed")
    docs = [" ".join(f"static-doc{d} entry{i} holds {i * 5 % 9}." for i in range(60)) for d in range(6)]
    homes = {doc: post(router, rag(docs[doc], "first")).headers["x-ragserve-engine"] for doc in range(6)}
    assert len(set(homes.values())) >= 2  # different documents spread
    for doc in range(6):
        resp = post(router, rag(docs[doc], "again, another question"))
        assert resp.headers["x-ragserve-engine"] == homes[doc]
        assert cached(resp) > 0  # and the engine it chose really had the prefix
