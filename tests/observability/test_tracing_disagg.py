"""A disaggregated request's trace (docs/disaggregation.md): real router, --role prefill and --role decode engines
(tiny model) and cachestore, exporting OTLP to a receiver in this process. One trace: router.route holds
router.prefill_leg (the prefill engine's engine.request under it) and the decode engine's engine.request."""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.engine_server import start_engine
from tests.helpers.net import free_port
from tests.helpers.otlp import Receiver
from tests.helpers.process import start, until, wait_http
from tests.observability.test_tracing import CHAT, complete, one


@pytest.fixture
def pd_stack(tmp_path):
    with Receiver() as receiver:
        otlp = ("--otlp-traces-endpoint", receiver.endpoint)
        store = CacheStoreProcess(tmp_path / "cachestore.log", free_port(), *otlp)
        http_port, grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(http_port)]
        argv += ["--grpc-port", str(grpc_port), "--registry-allow-unauthenticated", "--disagg-min-prompt-tokens", "32"]
        router = start("router", [*argv, *otlp], tmp_path / "router.log")
        common = ("--num-gpu-blocks", "256", "--cachestore", store.address, "--router", f"127.0.0.1:{grpc_port}", *otlp)
        engines = [
            start_engine(tmp_path, *common, "--role", "prefill", "--engine-id", "pd-p"),
            start_engine(tmp_path, *common, "--role", "decode", "--engine-id", "pd-d"),
        ]
        try:
            store.wait_serving()
            for engine in engines:
                engine.wait_ready()
            url = f"http://127.0.0.1:{http_port}"
            wait_http(url + "/health", proc=router)
            until(lambda: httpx.get(url + "/ready").json()["healthy_engines"] == 2, what="engines registered")
            yield receiver, url
        finally:
            for proc in (*engines, router, store):
                proc.stop()


def test_prefill_leg_has_its_span(pd_stack):
    receiver, url = pd_stack
    resp = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "pd-1"}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ragserve-engine"] == "pd-d"
    traced = lambda: [s for s in receiver.named("router.route") if s.attributes["ragserve.request_id"] == "pd-1"]  # noqa: E731
    trace_id = until(traced, what="the router's span")[0].trace_id
    spans = until(
        lambda: len([s for s in complete(receiver, trace_id, {"router.prefill_leg"}) if s.name == "engine.request"])
        == 2 and receiver.trace(trace_id),
        what="both engines' spans",
    )  # fmt: skip
    route, leg = one(spans, "router.route"), one(spans, "router.prefill_leg")
    assert leg.parent_id == route.span_id
    assert leg.attributes == {"ragserve.decode_engine": "pd-d", "ragserve.prefill_engine": "pd-p"}
    requests = {s.parent_id for s in spans if s.name == "engine.request"}
    assert requests == {leg.span_id, route.span_id}  # the prefill engine's under the leg, the decode engine's not
