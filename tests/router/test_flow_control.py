"""Flow control with a real router and a real engine: the router queue admits by priority class and, within a
class, the tenant served the fewest tokens first (VTC); sheddable requests get 429 rather than wait; a tenant's
token quota admits what fits and answers the rest 429 with a Retry-After the bucket computed.

The situations are built, not timed: --max-inflight-per-engine 1, the engine frozen (SIGSTOP; a long heartbeat
interval keeps it registered), and a request the router admitted holds the only place; the queue fills (its depth
gauge says when), then that request's client leaves, the engine resumes and the queued requests run one at a
time, so the order they complete in is the order they were admitted in (a tiny engine decodes a long stream in
well under a second: only a frozen engine holds a place for as long as the queue takes to build)."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.process import frozen
from tests.reliability.conftest import ready, start_engines

DEPTH = "ragserve_router_queue_depth"
IN_FLIGHT = "ragserve_router_requests_in_flight"


def completion(text: str, max_tokens: int = 2, **extra) -> dict:
    return {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "ignore_eos": True, **extra}


class Holder:
    """A request the router admitted to the (frozen) engine, holding its only place until release(): a raw socket,
    so that leaving is closing it, whatever the engine is doing."""

    def __init__(
        self, router_url: str, metrics, until, headers: dict | None = None, in_flight: int = 1, max_tokens: int = 400
    ) -> None:
        host, port = router_url.removeprefix("http://").split(":")
        data = json.dumps(completion("hold the engine", max_tokens=max_tokens, stream=True)).encode()
        lines = ["POST /v1/completions HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
        lines += [f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self.sock = socket.create_connection((host, int(port)))
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
        until(lambda: metrics(router_url, IN_FLIGHT) == in_flight, message="the holder admitted")

    def release(self) -> None:
        self.sock.close()  # the client leaves: the router frees the place


class Queue:
    """Requests sent one by one, each queued (the depth gauge grew) before the next is sent; done records the
    order they complete in."""

    def __init__(self, router_url: str, metrics, until) -> None:
        self.url, self.metrics, self.until = router_url, metrics, until
        self.pool = ThreadPoolExecutor(16)
        self.done: list[str] = []
        self.lock = threading.Lock()
        self.futures = {}

    def depth(self) -> float:
        return self.metrics.total(self.url, DEPTH)

    def send(self, name: str, body: dict, headers: dict, queued: bool = True) -> None:
        before = self.depth()
        self.futures[name] = self.pool.submit(self._post, name, body, headers)
        if queued:
            self.until(lambda: self.depth() == before + 1, message=f"{name} queued")

    def _post(self, name: str, body: dict, headers: dict) -> httpx.Response:
        resp = httpx.post(self.url + "/v1/completions", json=body, headers=headers, timeout=120)
        with self.lock:
            self.done.append(name)
        return resp

    def result(self, name: str) -> httpx.Response:
        return self.futures[name].result(timeout=120)


@pytest.fixture
def one_engine(cluster, until):
    def start(*flags: str):
        router = cluster.router("--max-inflight-per-engine", "1", "--heartbeat-interval-ms", "5000", *flags)
        (engine,) = start_engines(cluster, router, ["flow-0"], "--max-model-len", "1024")
        until(lambda: ready(router)["healthy_engines"] == 1, timeout=120, message="engine registered")
        return router, engine

    return start


def test_critical_is_admitted_before_waiting_standard_and_sheddable_is_refused(one_engine, metrics, until):
    router, engine = one_engine()
    queue = Queue(router.url, metrics, until)
    with frozen([engine]):
        holder = Holder(router.url, metrics, until)
        for i in range(3):
            queue.send(f"standard-{i}", completion(f"standard request {i}"), {})
        queue.send("critical", completion("critical request"), {"X-Ragserve-Priority": "1"})
        assert metrics(router.url, DEPTH, **{"class": "critical"}) == 1
        assert metrics(router.url, DEPTH, **{"class": "standard"}) == 3

        shed = httpx.post(router.url + "/v1/completions", json=completion("shed me"), timeout=60,
                          headers={"X-Ragserve-Priority": "-1"})  # fmt: skip
        assert shed.status_code == 429 and shed.json()["error"]["code"] == "saturated", shed.text
        assert int(shed.headers["retry-after"]) >= 1
        flex = completion("flex tier", service_tier="flex")
        flex = httpx.post(router.url + "/v1/completions", json=flex, timeout=60)
        assert flex.status_code == 429  # OpenAI's service_tier "flex" is sheddable too
        shed_total = metrics(router.url, "ragserve_router_shed_total", **{"class": "sheddable", "reason": "saturated"})
        assert shed_total == 2
        holder.release()
        until(lambda: queue.depth() == 3, message="the freed place went to a waiter")

    for name in queue.futures:
        assert queue.result(name).status_code == 200, queue.result(name).text
    assert queue.done == ["critical", "standard-0", "standard-1", "standard-2"]
    assert queue.depth() == 0
    assert metrics(router.url, "ragserve_router_queue_wait_seconds_count", **{"class": "critical"}) == 1


def test_a_light_tenant_waits_behind_one_request_of_a_heavy_tenant_not_its_backlog(one_engine, metrics, until):
    router, engine = one_engine("--tenant-header", "X-Tenant")
    heavy, light = {"X-Tenant": "heavy"}, {"X-Tenant": "light"}
    queue = Queue(router.url, metrics, until)
    long_prompt = " ".join(f"word{j}" for j in range(150))  # ~10x the light tenant's tokens
    with frozen([engine]):
        holder = Holder(router.url, metrics, until, heavy)
        for i in range(5):
            queue.send(f"heavy-{i}", completion(f"heavy {i} {long_prompt}"), heavy)
        queue.send("light", completion("light"), light)
        holder.release()
        until(lambda: queue.depth() == 5, message="the freed place went to a waiter")
    for name in queue.futures:
        assert queue.result(name).status_code == 200
    # FIFO would run the light tenant's request last; VTC lifts it to the heavy tenant's counter on arrival, so
    # it goes right after the heavy tenant's oldest request (which wins the tie by arriving first)
    assert queue.done == ["heavy-0", "light", "heavy-1", "heavy-2", "heavy-3", "heavy-4"]


def test_a_token_quota_admits_what_fits_and_answers_429_with_the_buckets_retry_after(cluster, until):
    per_minute, rate = 600, 600 / 60
    router = cluster.router("--tenant-tokens-per-minute", str(per_minute), "--heartbeat-interval-ms", "300")
    start_engines(cluster, router, ["quota-0"], "--max-model-len", "1024")
    until(lambda: ready(router)["healthy_engines"] == 1, timeout=120, message="engine registered")
    body = completion("count these tokens " * 6, max_tokens=4)
    admitted, started, last = 0, time.monotonic(), None
    with httpx.Client(timeout=60) as client:
        for _ in range(100):
            resp = client.post(router.url + "/v1/completions", json=body)
            if resp.status_code != 200:
                break
            last = resp
            admitted += resp.json()["usage"]["total_tokens"]
        elapsed = time.monotonic() - started
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "quota_tokens", resp.text
        prompt = last.json()["usage"]["prompt_tokens"]
        assert last.headers["x-ratelimit-limit-tokens"] == str(per_minute)
        assert per_minute - prompt <= admitted <= per_minute + rate * elapsed + 4  # what fits, +- one request
        assert 0.9 * per_minute <= admitted <= 1.1 * per_minute
        remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
        retry = int(resp.headers["retry-after"])
        assert retry in (math.ceil((prompt - remaining - 1) / rate), math.ceil((prompt - remaining) / rate))
        assert resp.headers["x-ratelimit-reset-tokens"].endswith("s")
        time.sleep(retry)
        again = client.post(router.url + "/v1/completions", json=body)
        assert again.status_code == 200, again.text  # the bucket held the prompt after Retry-After seconds


def test_a_tenant_joining_late_starts_at_the_served_tenants_counter(one_engine, until, metrics):
    """VTC's arrival rule: "early" was served alone (its counter grew); "late" arrives at an empty queue and starts
    at early's counter, not at 0, so its backlog does not all run ahead of early's next request."""
    router, engine = one_engine("--tenant-header", "X-Tenant")
    early, late = {"X-Tenant": "early"}, {"X-Tenant": "late"}
    long_prompt = " ".join(f"word{j}" for j in range(150))
    for i in range(3):  # early alone: some 500 weighted tokens served
        resp = httpx.post(router.url + "/v1/completions", json=completion(f"{i} {long_prompt}"), headers=early)
        assert resp.status_code == 200
    queue = Queue(router.url, metrics, until)
    with frozen([engine]):
        holder = Holder(router.url, metrics, until, late)
        for i in range(3):
            queue.send(f"late-{i}", completion(f"late {i}"), late)
        queue.send("early", completion("early again"), early)
        holder.release()
        until(lambda: queue.depth() == 3, message="the freed place went to a waiter")
    for name in queue.futures:
        assert queue.result(name).status_code == 200
    # starting at 0, late's three short requests would all run before early's; lifted, they take turns
    assert queue.done == ["late-0", "early", "late-1", "late-2"]
