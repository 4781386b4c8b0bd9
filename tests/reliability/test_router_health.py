"""A client cannot poison the router's view of the engines: 50 bad requests through a real router and two
real engines leave both healthy, none is replayed on another engine, and concurrent traffic sees no error."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.reliability.conftest import ready, start_engines

POISON = [  # the bodies of issue 14: each failed on one engine, was replayed on the next and took engines out
    {"model": "tiny", "prompt": ["Hello there", "\ud800"], "max_tokens": 4},
    {"model": "tiny", "prompt": "Hello", "cache_salt": "\ud800", "max_tokens": 4},
    {"model": "tiny", "prompt": "Hello", "max_tokens": 10**9},
    {"model": "tiny", "prompt": "Hello", "stop": ["x"] * 10_000, "max_tokens": 4},
    {"model": "tiny", "prompt": [10**9], "max_tokens": 4},
]


def test_fifty_poison_requests_leave_every_engine_healthy(cluster, metrics, until):
    router = cluster.router("--heartbeat-interval-ms", "300", "--breaker-failures", "1")
    start_engines(cluster, router, ["hp-a", "hp-b"], "--max-model-len", "256")
    until(lambda: ready(router)["healthy_engines"] == 2, timeout=60, message="two engines registered")
    stop = threading.Event()

    def normal(i: int) -> list[int]:
        codes = []
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                body = {"model": "tiny", "prompt": f"client {i} request {len(codes)}", "max_tokens": 4}
                codes.append(client.post(router.url + "/v1/completions", json=body).status_code)
        return codes

    with ThreadPoolExecutor(4) as pool:
        bystanders = [pool.submit(normal, i) for i in range(4)]
        try:
            with httpx.Client(timeout=60) as client:
                # json.dumps escapes the lone surrogates, so the body is valid JSON (as in the issue)
                bodies = [json.dumps(POISON[i % len(POISON)]) for i in range(50)]
                answers = [client.post(router.url + "/v1/completions", content=body) for body in bodies]
        finally:
            stop.set()
        codes = [c for f in bystanders for c in f.result()]

    for answer in answers:
        scope = answer.headers.get("x-ragserve-error-scope")
        assert 400 <= answer.status_code < 500 or scope == "request", (answer.status_code, answer.text)
        assert "error" in answer.json()
    assert codes and set(codes) == {200}, sorted(set(codes))
    assert ready(router)["healthy_engines"] == 2
    assert metrics.total(router.url, "ragserve_router_retries_total") == 0  # never replayed elsewhere
    assert metrics.total(router.url, "ragserve_router_engine_errors_total") == 0
