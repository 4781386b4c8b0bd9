"""The router's and engines' counters agree with what clients saw (real router, two real engines).

A known mix: answers streamed and not, every 4xx the router gives itself (auth, rate limit, body size, bad
JSON, missing or unknown model, bad policy header, unknown path, wrong method), 4xx from the engines, a client
that leaves mid-stream and one that leaves right after `data: [DONE]`. Counters by (code, reason) must equal
the client's tally exactly; latency quantiles must fall within one bucket of what the client measured.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragserve.metric_names import ENGINE_REQUESTS, LATENCY_BUCKETS, TIME_TO_FIRST_TOKEN
from tests.helpers.prom import histogram_quantile, within_one_bucket

ROUTER = "ragserve_router_"
KEY, LIMITED = "sk-metrics-test", "sk-limited"
MESSAGES = [{"role": "user", "content": "Retrieved passage: the paged KV cache splits sequences into blocks. " * 3}]


class Client:
    """Sends requests and keeps the tally of what came back: (status, error code) and latencies."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"})
        self.router: Counter = Counter()  # every answer: (status, reason)
        self.engine: Counter = Counter()  # answers an engine gave (also counted by the engines)
        self.e2e: list[float] = []  # proxied requests
        self.ttft: list[float] = []  # streams

    def record(self, status: int, body: bytes, by_engine: bool, started: float) -> None:
        reason = ""
        if status >= 400:
            reason = "client_closed" if status == 499 else json.loads(body)["error"]["code"] or f"http_{status}"
        self.router[(str(status), reason)] += 1
        if by_engine:
            self.engine[(str(status), reason)] += 1
            self.e2e.append(time.monotonic() - started)

    def send(self, method: str, path: str, **kw) -> httpx.Response:
        started = time.monotonic()
        resp = self.http.request(method, path, **kw)
        self.record(resp.status_code, resp.content, "x-ragserve-engine" in resp.headers, started)
        return resp

    def stream(self, body: dict, leave: str = "") -> list[str]:
        """A streamed chat; leave="mid": close after the first event, "done": close right after [DONE]."""
        started, lines = time.monotonic(), []
        with self.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:") and not lines:
                    self.ttft.append(time.monotonic() - started)
                lines.append(line)
                if leave == "mid" and line.startswith("data:") or line == "data: [DONE]":
                    break
        self.record(499 if leave == "mid" else 200, b"", True, started)
        return lines


def scrape(url: str) -> dict[str, list]:
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    out: dict[str, list] = {}
    for family in families:
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def by_code_reason(pages: list[dict], name: str) -> Counter:
    tally: Counter = Counter()
    for page in pages:
        for s in page.get(name, []):
            if s.value:
                tally[(s.labels["code"], s.labels["reason"])] += int(s.value)
    return tally


def buckets(pages: list[dict], name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for page in pages:
        for s in page.get(name + "_bucket", []):
            le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
            out[le] = out.get(le, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def stack(module_cluster, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{KEY} name=test\n{LIMITED} name=limited rps=0.001 burst=1\n")
    flags = ["--api-keys-file", str(keys), "--max-body-bytes", "32KiB", "--allow-policy-header"]
    router = module_cluster.router(*flags, "--heartbeat-interval-ms", "300", "--registry-allow-unauthenticated")
    engines = module_cluster.real_engines(router, 2)
    client = Client(router.url)
    from tests.helpers.process import until

    until(lambda: client.send("GET", "/v1/models").json()["data"], timeout=60, what="engines registered")
    return router, engines, client


def test_zero_before_traffic(cluster):
    """A router and an engine of its own (not the module's `stack`, which other tests send traffic to), so
    the zeros hold in any test order."""
    router = cluster.router("--heartbeat-interval-ms", "300")
    engines = cluster.real_engines(router, 1)
    page = scrape(router.url)
    retries = {s.labels["reason"]: s.value for s in page[ROUTER + "retries_total"]}
    assert retries == {"connect": 0, "timeout": 0, "server_error": 0}
    assert {s.labels["kind"] for s in page[ROUTER + "kv_events_total"]} == {"stored", "removed", "cleared"}
    assert page[ROUTER + "rate_limited_total"][0].value == 0
    for engine in engines:
        page = scrape(engine.url)
        assert [(s.labels["code"], s.value) for s in page[ENGINE_REQUESTS + "_total"]] == [("200", 0.0)]
        assert page[TIME_TO_FIRST_TOKEN + "_count"][0].value == 0


def test_counters_equal_the_clients_tally(stack):
    router, engines, client = stack
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}
    for i in range(3):  # answered, not streamed; then streamed in full
        assert client.send("POST", "/v1/chat/completions", json={**chat, "user": str(i)}).status_code == 200
        assert client.stream({**chat, "user": str(i)})[-1] == "data: [DONE]"
    completion = {"model": "tiny", "prompt": "The cache", "max_tokens": 4}
    assert client.send("POST", "/v1/completions", json=completion).status_code == 200
    # the router's own answers
    statuses = [
        client.send("POST", "/v1/chat/completions", json=chat, headers={"Authorization": ""}).status_code,
        client.send("POST", "/v1/chat/completions", json=chat, headers={"Authorization": "Bearer nope"}).status_code,
        client.send(
            "POST", "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {LIMITED}"}
        ).status_code,
        client.send(
            "POST", "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {LIMITED}"}
        ).status_code,
        client.send("POST", "/v1/completions", json={**completion, "prompt": "x" * 40_000}).status_code,
        client.send("POST", "/v1/chat/completions", content=b"{not json").status_code,
        client.send("POST", "/v1/chat/completions", json={"messages": MESSAGES}).status_code,
        client.send("POST", "/v1/chat/completions", json={**chat, "model": "no-such-model"}).status_code,
        client.send("POST", "/v1/chat/completions", json=chat, headers={"X-Ragserve-Policy": "nope"}).status_code,
        client.send("GET", "/v1/nothing-here").status_code,
        client.send("GET", "/v1/completions").status_code,
    ]
    assert statuses == [401, 401, 200, 429, 413, 400, 400, 404, 400, 404, 405]
    # the engines' 4xx, passed through
    for bad in ({"temperature": -1}, {"logit_bias": {"1": 5}}, {"max_tokens": 10**7}):
        assert client.send("POST", "/v1/chat/completions", json={**chat, **bad}).status_code == 400
    # clients that leave: mid-stream (the engine is still generating) and right after [DONE]
    client.stream({**chat, "max_tokens": 400, "ignore_eos": True}, leave="mid")
    assert client.stream(chat, leave="done")[-1] == "data: [DONE]"

    from tests.helpers.process import until

    def settled() -> bool:
        pages = [scrape(e.url) for e in engines]
        return by_code_reason([scrape(router.url)], ROUTER + "requests_total") == client.router and (
            by_code_reason(pages, ENGINE_REQUESTS + "_total") == client.engine
        )

    until(settled, timeout=30, interval=0.2, fail=False)
    router_page, engine_pages = scrape(router.url), [scrape(e.url) for e in engines]
    assert by_code_reason([router_page], ROUTER + "requests_total") == client.router
    assert by_code_reason(engine_pages, ENGINE_REQUESTS + "_total") == client.engine
    assert len(client.router) >= 10 and ("499", "client_closed") in client.router

    # latency quantiles within one bucket of the client's range
    e2e = buckets([router_page], ROUTER + "request_duration_seconds")
    assert e2e[math.inf] == len(client.e2e)
    ttft = buckets([router_page], ROUTER + "time_to_first_token_seconds")
    assert ttft[math.inf] == len(client.ttft)
    engine_ttft = buckets(engine_pages, TIME_TO_FIRST_TOKEN)  # without the HTTP hops: never slower
    for q in (0.5, 0.9, 0.99):
        assert within_one_bucket(histogram_quantile(q, e2e), min(client.e2e), max(client.e2e), LATENCY_BUCKETS)
        assert within_one_bucket(histogram_quantile(q, ttft), min(client.ttft), max(client.ttft), LATENCY_BUCKETS)
        assert within_one_bucket(histogram_quantile(q, engine_ttft), 0, max(client.e2e), LATENCY_BUCKETS)


def test_the_token_cache_counts_a_context_tokenized_once_and_found_again(stack):
    """Two chats over one long context (its own system message): the router tokenizes it once and finds it the
    second time (ragserve.token_cache)."""
    router, _, client = stack

    def figures() -> tuple[float, float, float]:
        page = scrape(router.url)
        pieces = {s.labels["result"]: s.value for s in page[ROUTER + "token_cache_pieces_total"]}
        return pieces["hit"], pieces["miss"], page[ROUTER + "token_cache_chars"][0].value

    context = "Context: the router keys each prompt's blocks exactly as the engine does. " * 30
    hit, miss, chars = figures()
    for question in ("What does the router key?", "And how?"):
        messages = [{"role": "system", "content": context}, {"role": "user", "content": question}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 2}
        assert client.send("POST", "/v1/chat/completions", json=body).status_code == 200
    after = figures()
    assert after[:2] == (hit + 1, miss + 1) and after[2] >= chars + len(context)
