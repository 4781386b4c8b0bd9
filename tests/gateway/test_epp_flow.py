"""Flow control on the endpoint picker's traffic (the routing path the HTTP gateway shares): the router queue by
class, shedding, a full queue, tenant quotas (requests at once, tokens) with Retry-After and x-ratelimit headers,
and streamed answers charged whether or not their client asked for usage. A request decided by the picker holds
its engine place until its answer has gone through, so the places are held by picks not yet served."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.gateway.conftest import ENGINE_FLAGS, epp_router
from tests.helpers import process

CHAT = "/v1/chat/completions"
DEPTH = "ragserve_router_queue_depth"


def chat(text: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}


def headers_of(immediate) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}


@pytest.fixture(scope="module")
def engine(gateway_cluster):
    (engine,) = gateway_cluster.real_engines(None, 1, *ENGINE_FLAGS, ids=["flow-gw-0"])
    return engine


def picker(cluster, engine, *flags: str):
    p = epp_router(cluster, "--static-engines", engine.url, "--probe-interval", "0.2", *flags, tls=False,
                   name="epp-flow")  # fmt: skip
    ready = lambda: httpx.get(p.router.url + "/ready", timeout=5).json()["healthy_engines"] == 1  # noqa: E731
    process.until(ready, what="static engine healthy")
    return p


def test_the_queue_admits_by_class_sheds_and_refuses_when_full(gateway_cluster, engine, metrics, until):
    p = picker(gateway_cluster, engine, "--max-inflight-per-engine", "1", "--queue-size", "2")
    url = p.router.url
    held = p.envoy.pick(CHAT, chat("hold the only place"))
    assert held.immediate is None
    shed = p.envoy.pick(CHAT, chat("shed"), headers={"x-ragserve-priority": "-1"})
    assert shed.immediate.status.code == 429 and shed.error()["code"] == "saturated"
    assert int(headers_of(shed.immediate)["retry-after"]) >= 1
    with ThreadPoolExecutor(2) as pool:
        standard = pool.submit(p.envoy.pick, CHAT, chat("standard"))
        until(lambda: metrics(url, DEPTH, **{"class": "standard"}) == 1, message="standard queued")
        critical = pool.submit(p.envoy.pick, CHAT, chat("critical"), {"x-ragserve-priority": "1"})
        until(lambda: metrics(url, DEPTH, **{"class": "critical"}) == 1, message="critical queued")
        full = p.envoy.pick(CHAT, chat("no room"))
        assert full.immediate.status.code == 429 and full.error()["code"] == "queue_full"
        assert p.envoy.serve(held).status == 200  # its place goes to the critical request, not the older one
        first = critical.result(timeout=60)
        assert first.immediate is None and not standard.done()
        assert metrics(url, DEPTH, **{"class": "standard"}) == 1
        assert p.envoy.serve(first).status == 200
        second = standard.result(timeout=60)
    assert second.immediate is None and p.envoy.serve(second).status == 200
    assert metrics(url, "ragserve_router_shed_total", **{"class": "standard", "reason": "queue_full"}) == 1
    p.envoy.close()
    p.router.stop()


def normalized(stream: bytes) -> bytes:
    stream = re.sub(rb'"id": "[^"]+"', b'"id": "-"', stream)
    return re.sub(rb'"created": \d+', b'"created": 0', stream)


def test_quotas_hold_on_picker_traffic_and_streams_are_charged_unseen(gateway_cluster, engine, metrics):
    per_minute = 400
    p = picker(gateway_cluster, engine, "--tenant-header", "x-tenant", "--tenant-max-concurrent", "1",
               "--tenant-tokens-per-minute", str(per_minute))  # fmt: skip
    a, b = {"x-tenant": "a"}, {"x-tenant": "b"}
    first = p.envoy.pick(CHAT, chat("a's first"), headers=a)
    over = p.envoy.pick(CHAT, chat("a's second"), headers=a)
    assert over.immediate.status.code == 429 and over.error()["code"] == "quota_concurrency"
    assert int(headers_of(over.immediate)["retry-after"]) >= 1
    other = p.envoy.pick(CHAT, chat("b's"), headers=b)
    assert other.immediate is None  # another tenant is not held back
    served = p.envoy.serve(first)
    assert served.added["x-ratelimit-limit-tokens"] == str(per_minute)  # admitted answers carry the bucket's state
    assert int(served.added["x-ratelimit-remaining-tokens"]) < per_minute
    assert p.envoy.serve(other).status == 200

    body = chat("count these tokens", max_tokens=40, stream=True, temperature=0, ignore_eos=True)
    direct = httpx.post(engine.url + CHAT, json=body, timeout=60).content
    usage = httpx.post(engine.url + CHAT, json={**body, "stream": False}, timeout=60).json()["usage"]
    cost, prompt = usage["total_tokens"], usage["prompt_tokens"]
    tenant, count, started = {"x-tenant": "streams"}, 0, time.monotonic()
    while (pick := p.envoy.pick(CHAT, body, headers=tenant)).immediate is None:
        assert b'"include_usage": true' in pick.body_echo  # the engine is asked for the usage
        streamed = p.envoy.serve(pick)
        assert streamed.status == 200 and b'"usage"' not in streamed.body  # the client sees none of it
        assert normalized(streamed.body) == normalized(direct)  # byte for byte the stream it asked for
        count += 1
        assert count < 50, "the quota never refused"
    assert pick.error()["code"] == "quota_tokens"
    refill = per_minute / 60 * (time.monotonic() - started)
    assert per_minute - prompt < count * cost <= per_minute + refill + cost - prompt, (count, cost, refill)
    p.envoy.close()
    p.router.stop()
