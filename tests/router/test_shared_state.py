"""Two router replicas sharing a real redis-server make the same routing choices for real engines."""

from __future__ import annotations

import signal

import httpx
import pytest

DOCS = [" ".join(f"shared{d}-item{i}" for i in range(150)) for d in range(4)]


def rag(doc: int, question: str) -> dict:
    messages = [{"role": "system", "content": DOCS[doc]}, {"role": "user", "content": question}]
    return {"model": "tiny", "messages": messages, "max_tokens": 2}


def post(router, body: dict, headers: dict | None = None) -> httpx.Response:
    resp = httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def cached(resp: httpx.Response) -> int:
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def engines(router) -> int:
    return httpx.get(router.url + "/ready", timeout=5).json()["engines"]


def test_two_routers_share_registry_and_kv_index(cluster, metrics, until):
    redis = cluster.redis()
    flags = ("--redis", redis, "--heartbeat-interval-ms", "300", "--redis-prefix", "t1:")
    r1 = cluster.router(*flags, name="router-1")
    r2 = cluster.router(*flags, name="router-2")
    # engines register with replica 1 only; replica 2 learns about them from Redis
    fleet = cluster.real_engines(r1, 2, ids=["sh-0", "sh-1"])
    until(lambda: engines(r1) == 2 and engines(r2) == 2, timeout=60, message="both replicas see 2 engines")
    assert [m["id"] for m in httpx.get(r2.url + "/v1/models").json()["data"]] == ["tiny"]

    for doc in range(4):
        first, other = (r1, r2) if doc % 2 == 0 else (r2, r1)
        stored = metrics(r1.url, "ragserve_router_kv_events_total", kind="stored")
        resp = post(first, rag(doc, "first question"))
        home = resp.headers["x-ragserve-engine"]
        assert cached(resp) <= 16  # at most the chat template's block
        until(
            lambda s=stored: metrics(r1.url, "ragserve_router_kv_events_total", kind="stored") > s,
            message="the engine's KV events in Redis",
        )
        resp = post(other, rag(doc, "a follow-up from another client"))
        assert resp.headers["x-ragserve-engine"] == home
        assert cached(resp) >= resp.json()["usage"]["prompt_tokens"] - 48  # the engine really had the prefix

    # an engine that dies leaves both replicas' view of the registry
    fleet[0].stop(signal.SIGKILL)
    until(lambda: engines(r1) == 1 and engines(r2) == 1, message="dead engine dropped everywhere")


def test_router_refuses_to_start_without_its_redis(cluster, port):
    router = cluster.router("--redis", f"redis://:secret@127.0.0.1:{port}/0", wait=False)
    assert router.popen.wait(30) == 2
    out = router.output()
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in out
    assert "secret" not in out and "Traceback" not in out


def test_losing_redis_degrades_routing_but_never_fails_requests(cluster, metrics, until):
    """Two engines: with Redis, a document's follow-up goes where its KV is (prefix_hit); without it, the KV
    index is gone (kv_aware routes on cost and load alone, claiming no cached prefix), while the last known
    registry keeps both engines serving."""
    import grpc

    from ragserve.v1 import registry_pb2, registry_pb2_grpc

    redis = cluster.redis()
    flags = ("--redis", redis, "--heartbeat-interval-ms", "300", "--redis-prefix", "t2:", "--allow-policy-header")
    router = cluster.router(*flags)
    cluster.real_engines(router, 2, ids=["deg-0", "deg-1"])
    until(lambda: engines(router) == 2, timeout=60, message="engines registered")
    stored = metrics(router.url, "ragserve_router_kv_events_total", kind="stored")
    home = post(router, rag(0, "before")).headers["x-ragserve-engine"]
    until(
        lambda: metrics(router.url, "ragserve_router_kv_events_total", kind="stored") > stored,
        message="the engine's KV events in Redis",
    )
    resp = post(router, rag(0, "before, again"))
    assert (resp.headers["x-ragserve-engine"], resp.headers["x-ragserve-route-reason"]) == (home, "prefix_hit")
    next(p for p in cluster.procs if p.name == "redis").stop(signal.SIGKILL)
    for i in range(3):  # the index is unreachable: no engine is credited with the prefix, requests still served
        resp = post(router, rag(0, f"after {i}"))
        assert resp.headers["x-ragserve-route-reason"] == "cost", resp.headers
        assert resp.headers["x-ragserve-engine"] in {"deg-0", "deg-1"}
    # both last known engines keep serving (round robin over the registry this replica still holds)
    served = {
        post(router, rag(1, f"rr {i}"), {"x-ragserve-policy": "round_robin"}).headers["x-ragserve-engine"]
        for i in range(4)
    }
    assert served == {"deg-0", "deg-1"} and engines(router) == 2
    with grpc.insecure_channel(router.grpc) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Heartbeat(registry_pb2.HeartbeatRequest(engine_id="never-registered"), timeout=20)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in info.value.details()
    assert "Traceback" not in router.output()
