"""Tenant quotas with a real router and a real engine: requests at once (--tenant-max-concurrent) and the tokens of
streamed answers whose client did not ask for usage (the router asks the engine and hides it from the client,
whose stream stays byte for byte the one it asked for)."""

from __future__ import annotations

import re
import time

import httpx

from tests.helpers.process import frozen
from tests.reliability.conftest import ready, start_engines
from tests.router.test_flow_control import IN_FLIGHT, Holder, completion

STREAM_TOKENS = 40  # completion tokens of each streamed answer


def normalized(stream: bytes) -> bytes:
    """A stream without what differs between two runs of one greedy request: its id and creation time."""
    stream = re.sub(rb'"id": "[^"]+"', b'"id": "-"', stream)
    return re.sub(rb'"created": \d+', b'"created": 0', stream)


def streamed(text: str) -> dict:
    return completion(text, max_tokens=STREAM_TOKENS, stream=True, temperature=0)


def admitted_until_429(url: str, body: dict, headers: dict | None = None) -> tuple[int, list[bytes], httpx.Response]:
    """Streams sent one after another until the quota refuses one: how many ran, their bytes, the refusal."""
    streams = []
    with httpx.Client(timeout=60) as client:
        for _ in range(100):
            resp = client.post(url + "/v1/completions", json=body, headers=headers or {})
            if resp.status_code != 200:
                return len(streams), streams, resp
            streams.append(resp.content)
    raise AssertionError("the quota never refused")


def test_the_concurrency_quota_refuses_the_extra_request_of_a_tenant_only(cluster, metrics, until):
    router = cluster.router("--tenant-header", "X-Tenant", "--tenant-max-concurrent", "2",
                            "--heartbeat-interval-ms", "5000")  # fmt: skip
    (engine,) = start_engines(cluster, router, ["conc-0"], "--max-model-len", "1024")
    until(lambda: ready(router)["healthy_engines"] == 1, timeout=120, message="engine registered")
    a, b = {"X-Tenant": "a"}, {"X-Tenant": "b"}
    with frozen([engine]):  # nothing finishes while the places are counted
        first, second = (Holder(router.url, metrics, until, a, in_flight=n) for n in (1, 2))
        over = httpx.post(router.url + "/v1/completions", json=completion("one too many"), headers=a, timeout=60)
        assert over.status_code == 429 and over.json()["error"]["code"] == "quota_concurrency", over.text
        assert int(over.headers["retry-after"]) >= 1
        assert metrics(router.url, "ragserve_router_quota_limited_total", reason="concurrency") == 1
        other = Holder(router.url, metrics, until, b, in_flight=3)  # another tenant is admitted
        first.release()  # one of a's requests ends: a has a place again
        until(lambda: metrics(router.url, IN_FLIGHT) == 2, message="a's first request released")
        again = Holder(router.url, metrics, until, a, in_flight=3)
        for holder in (second, other, again):
            holder.release()
        until(lambda: metrics(router.url, IN_FLIGHT) == 0, message="all released")
    for _ in range(3):  # requests that run to their end give their place back too
        assert httpx.post(router.url + "/v1/completions", json=completion("x"), headers=a, timeout=60).is_success
    assert metrics(router.url, "ragserve_router_quota_limited_total", reason="concurrency") == 1


def test_a_stream_without_include_usage_is_charged_and_the_client_sees_no_usage(cluster, until):
    per_minute = 400
    router = cluster.router("--tenant-tokens-per-minute", str(per_minute), "--tenant-header", "X-Tenant",
                            "--heartbeat-interval-ms", "300")  # fmt: skip
    (engine,) = start_engines(cluster, router, ["usage-0"], "--max-model-len", "1024")
    until(lambda: ready(router)["healthy_engines"] == 1, timeout=120, message="engine registered")
    body = streamed("count these tokens")
    direct = httpx.post(engine.url + "/v1/completions", json=body, timeout=60)
    usage = httpx.post(engine.url + "/v1/completions", json={**body, "stream": False}, timeout=60).json()["usage"]
    prompt, cost = usage["prompt_tokens"], usage["total_tokens"]
    assert usage["completion_tokens"] == STREAM_TOKENS

    started = time.monotonic()
    count, streams, refused = admitted_until_429(router.url, body)
    refill = per_minute / 60 * (time.monotonic() - started)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_tokens", refused.text
    # the k-th stream was admitted with its prompt in the bucket, the k+1-th not (a few tokens refill meanwhile);
    # charged the prompt only, some 20 streams would have run
    assert per_minute - prompt < count * cost <= per_minute + refill + cost - prompt, (count, cost, refill)
    for stream in streams:  # byte for byte what the engine streams a client that did not ask for usage
        assert b'"usage"' not in stream
        assert normalized(stream) == normalized(direct.content)

    asked = {**body, "stream_options": {"include_usage": True}}  # a client that asks gets it, as directly
    with_usage = httpx.post(engine.url + "/v1/completions", json=asked, timeout=60)
    through = httpx.post(router.url + "/v1/completions", json=asked, headers={"X-Tenant": "asks"}, timeout=60)
    assert b'"usage": {' in through.content
    assert normalized(through.content) == normalized(with_usage.content)
