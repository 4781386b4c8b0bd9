"""End to end under load: a hot prefix spreads over real engines; an engine killed under load costs no request."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.process import frozen
from tests.router.conftest import case_file, decisions, measure_prefill

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


def test_hot_prefix_spreads_under_load(cluster, metrics, until):
    """A burst on one document, each request with its own ~1,900-token case file: the engine holding the document
    is not the fastest for all of them once its queue holds their case files, so the burst spreads. The engines are
    stopped while the router routes the burst (no first token, heartbeat or finished request moves what it sees),
    so each decision is made on the queue the earlier ones left: deterministic, not a race with prefill speed."""
    router = cluster.router("--heartbeat-interval-ms", "1000")  # 3 s before a silent engine is dropped
    flags = ["--num-gpu-blocks", "1024", "--max-model-len", "4096"]
    trio = cluster.real_engines(router, 3, *flags, ids=["spread-0", "spread-1", "spread-2"])
    until(lambda: engines(router) == 3, timeout=60, message="three engines registered")
    measure_prefill(router, trio, lambda k: case_file(1000 + k))  # rates measured alike, not by calibration alone
    warm = httpx.post(router.url + "/v1/chat/completions", json=rag(3, "warm"), timeout=120)
    assert warm.status_code == 200
    home = warm.headers["x-ragserve-engine"]
    before = metrics(router.url, "ragserve_router_routing_decisions_total", policy="kv_aware", reason="spread")
    routed: list[tuple[str, str]] = []

    def one(i: int) -> None:
        body = rag(3, f"{case_file(i)}\nWhich item is heaviest?", stream=True)
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=300) as resp:
            assert resp.status_code == 200
            h = resp.headers
            routed.append((h["x-ragserve-engine"], h["x-ragserve-route-reason"], h["x-ragserve-predicted-ttft-ms"]))
            resp.read()

    burst, decided = 6, decisions(metrics, router.url)
    with ThreadPoolExecutor(burst) as pool:
        with frozen(trio):
            futures = [pool.submit(one, i) for i in range(burst)]
            until(lambda: decisions(metrics, router.url) >= decided + burst, timeout=2, message="burst routed")
        for f in futures:
            f.result()
    assert len({engine for engine, *_ in routed}) == 3, routed
    assert {reason for engine, reason, _ in routed if engine == home} == {"prefix_hit"}, routed
    after = metrics(router.url, "ragserve_router_routing_decisions_total", policy="kv_aware", reason="spread")
    # each other engine's first request was a spread (it held less of the prompt); later ones there are prefix hits
    assert 2 <= after - before <= sum(engine != home for engine, *_ in routed), routed


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
