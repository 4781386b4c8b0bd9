"""End to end under load: a hot prefix spreads over real engines; an engine killed under load costs no request."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow  # many processes, each loading a model

DOCS = [" ".join(f"e2e-passage{d} sentence{i} states fact {i * 7 % 13}." for i in range(60)) for d in range(4)]


def rag(doc: int, question: str, **extra) -> dict:
    messages = [
        {"role": "system", "content": f"Answer from the context.\n\nContext:\n{DOCS[doc]}"},
        {"role": "user", "content": question},
    ]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


def engines(router) -> int:
    return httpx.get(router.url + "/ready", timeout=5).json()["engines"]


def test_hot_prefix_spreads_under_load(fleet, metrics):
    router = fleet.router
    assert httpx.post(router.url + "/v1/chat/completions", json=rag(3, "warm"), timeout=120).status_code == 200
    before = metrics(router.url, "ragserve_router_routing_decisions_total", policy="kv_aware", reason="spread")
    used: list[str] = []
    barrier = threading.Barrier(12)

    def one(i: int) -> None:
        body = rag(3, f"hot question {i}", stream=True, max_tokens=128, ignore_eos=True)
        barrier.wait()
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=300) as resp:
            assert resp.status_code == 200
            used.append(resp.headers["x-ragserve-engine"])
            resp.read()

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(12)))
    assert len(set(used)) >= 2, used
    after = metrics(router.url, "ragserve_router_routing_decisions_total", policy="kv_aware", reason="spread")
    assert after > before


def test_engine_killed_under_load(cluster, until):
    """SIGKILL one of two engines under load: no client errors; it leaves; a restart rejoins."""
    router = cluster.router("--heartbeat-interval-ms", "300")
    pair = cluster.real_engines(router, 2, "--num-gpu-blocks", "1024", "--max-model-len", "4096")
    until(lambda: engines(router) == 2, timeout=60, message="two engines registered")
    victim = pair[0]
    stop = threading.Event()
    codes: list[int] = []

    def load(i: int) -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                resp = client.post(router.url + "/v1/chat/completions", json=rag(i % 4, f"load {i} {len(codes)}"))
                codes.append(resp.status_code)

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(load, i) for i in range(6)]
        until(lambda: len(codes) >= 6, timeout=60, message="load running")
        victim.stop(signal.SIGKILL)
        until(lambda: engines(router) == 1, timeout=30, message="dead engine dropped")
        after_drop = len(codes)
        until(lambda: len(codes) >= after_drop + 6, timeout=60, message="load served after the drop")
        stop.set()
        for f in futures:
            f.result()
    assert len(codes) >= 10 and set(codes) == {200}, sorted(set(codes))
    [restarted] = cluster.real_engines(router, 1, "--num-gpu-blocks", "1024", ports=[victim.port])
    until(lambda: engines(router) == 2, timeout=60, message="restarted engine rejoined")
