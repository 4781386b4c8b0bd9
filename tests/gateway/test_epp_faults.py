"""The picker when engines fail: the gateway falls back down the picked list to a live engine (and the router
accounts the request where it was served); with no engine left, readiness goes NOT_SERVING and requests get 503."""

from __future__ import annotations

import signal

from tests.gateway.conftest import ENGINE_FLAGS, endpoint, epp_router, registered
from tests.helpers import envoy, process

CHAT = "/v1/chat/completions"


def body(text: str) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def test_fallback_to_the_next_endpoint_then_503_when_none_is_ready(gateway_cluster, metrics):
    picker = epp_router(gateway_cluster, "--heartbeat-interval-ms", "300")
    engines = gateway_cluster.real_engines(picker.router, 2, *ENGINE_FLAGS, ids=["fb-0", "fb-1"])
    for engine in engines:
        gateway_cluster.wait_registered(engine)
    ids = {endpoint(e): e.name for e in engines}
    pick = picker.envoy.pick(CHAT, body("Which engine answers?"))
    assert len(pick.endpoints) == 2 and set(pick.endpoints) == set(ids)
    primary = next(e for e in engines if endpoint(e) == pick.endpoints[0])
    primary.stop(signal.SIGKILL)  # dies between the pick and the gateway's connection
    served = picker.envoy.serve(pick)
    assert served.status == 200 and served.endpoint == pick.endpoints[1]
    fallback = ids[pick.endpoints[1]]
    assert metrics(picker.router.url, "ragserve_router_requests_total", model="tiny", engine=fallback,
                   policy="kv_aware", code="200", reason="") == 1  # fmt: skip
    assert metrics(picker.router.url, "ragserve_router_requests_in_flight") == 0
    next(e for e in engines if e is not primary).stop(signal.SIGKILL)
    process.until(lambda: registered(picker.router) == 0, what="both engines dropped")
    ready = lambda: envoy.health_status(picker.envoy.chan, "readiness")  # noqa: E731
    process.until(lambda: ready() == "NOT_SERVING", what="picker not ready")
    assert envoy.health_status(picker.envoy.chan, "envoy.service.ext_proc.v3.ExternalProcessor") == "NOT_SERVING"
    assert envoy.health_status(picker.envoy.chan, "liveness") == "SERVING"
    refused = picker.envoy.pick(CHAT, body("Anyone?"))
    assert refused.immediate.status.code == 503 and refused.error()["code"] == "no_engine"
    picker.envoy.close()
