"""The router as a Gateway API endpoint picker, driven by an Envoy-like ext_proc client (tests/helpers/envoy.py)
against real engines, the picked endpoint serving each request: the cases of GIE's conformance tests that apply
to a picker (destination in header and metadata, fallbacks, subset hints, 503, 429, health) and ragserve's own
(KV-aware placement of repeated RAG context, predicted = reported cached tokens, bad bodies, cut streams)."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import ENGINE_FLAGS, endpoint, epp_router, registered
from tests.helpers import envoy, process

DOCS = [" ".join(f"gateway-doc{d} fact{i} is {i * 5 % 13}." for i in range(60)) for d in range(6)]
CHAT = "/v1/chat/completions"


def rag(doc: int, question: str, **extra) -> dict:
    messages = [
        {"role": "system", "content": f"Answer from the context.\n\nContext:\n{DOCS[doc]}"},
        {"role": "user", "content": question},
    ]
    return {"model": "tiny", "messages": messages, "max_tokens": 2, **extra}


@pytest.fixture(scope="module")
def fleet(gateway_cluster):
    """A kv_aware router with TLS on its picker port (self-signed) and two real engines registered with it."""
    picker = epp_router(gateway_cluster, "--heartbeat-interval-ms", "300", "--max-body-bytes", "64KiB")
    engines = gateway_cluster.real_engines(picker.router, 2, *ENGINE_FLAGS, ids=["gw-0", "gw-1"])
    for engine in engines:
        gateway_cluster.wait_registered(engine)
    process.until(lambda: envoy.health_status(picker.envoy.chan, "readiness") == "SERVING", what="picker ready")
    yield picker, engines
    picker.envoy.close()


def in_flight(metrics, router) -> float:
    return metrics(router.url, "ragserve_router_requests_in_flight")


def test_picked_endpoint_is_in_header_and_metadata_and_serves(fleet, metrics):
    picker, engines = fleet
    pick = picker.envoy.pick(CHAT, rag(0, "What is fact 3?"), headers={"x-request-id": "gw-req-1"}, chunks=4)
    assert pick.immediate is None
    assert pick.header == pick.metadata  # the same value in both places
    assert set(pick.endpoints) == {endpoint(e) for e in engines}  # primary first, then the fallback
    assert pick.body_echo == pick.body  # the body goes on unchanged
    assert in_flight(metrics, picker.router) == 1  # reserved at the decision, like the HTTP gateway's
    served = picker.envoy.serve(pick)
    assert served.status == 200 and served.endpoint == pick.endpoints[0]
    assert pick.set_headers["x-request-id"] == "gw-req-1"  # the engine logs the client's request id
    assert in_flight(metrics, picker.router) == 0
    engine_id = {endpoint(e): e.name for e in engines}[served.endpoint]
    assert metrics(picker.router.url, "ragserve_router_requests_total", model="tiny", engine=engine_id,
                   policy="kv_aware", code="200", reason="") >= 1  # fmt: skip


def test_streamed_answer_feeds_ttft_and_usage(fleet, metrics):
    picker, engines = fleet
    url = picker.router.url
    ttft = lambda: metrics(url, "ragserve_router_time_to_first_token_seconds_count", model="tiny")  # noqa: E731
    before, prompt_before = ttft(), metrics.total(url, "ragserve_router_prompt_tokens_total")
    body = rag(1, "Which fact is largest?", stream=True, stream_options={"include_usage": True})
    served = picker.envoy.serve(picker.envoy.pick(CHAT, body))
    assert served.status == 200 and served.body.rstrip().endswith(b"data: [DONE]")
    usage = [line for line in served.body.split(b"\n\n") if b'"usage"' in line and b'"prompt_tokens"' in line][-1]
    prompt_tokens = httpx.Response(200, content=usage[5:]).json()["usage"]["prompt_tokens"]
    assert ttft() == before + 1
    assert metrics.total(url, "ragserve_router_prompt_tokens_total") - prompt_before == prompt_tokens
    assert in_flight(metrics, picker.router) == 0


def test_repeated_context_lands_on_the_warm_engine(fleet, metrics, until):
    picker, _ = fleet
    url = picker.router.url
    stored = lambda: metrics(url, "ragserve_router_kv_events_total", kind="stored")  # noqa: E731
    before = stored()
    first = picker.envoy.serve(picker.envoy.pick(CHAT, rag(2, "First question?")))
    until(lambda: stored() > before, message="the engine's KV events reached the router")
    predicted_before = metrics.total(url, "ragserve_router_predicted_cached_tokens_total")
    actual_before = metrics.total(url, "ragserve_router_actual_cached_tokens_total")
    reported = 0
    for q in range(3):
        served = picker.envoy.serve(picker.envoy.pick(CHAT, rag(2, f"Question {q} about it?")))
        assert served.endpoint == first.endpoint
        reported += httpx.Response(200, content=served.body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    predicted = metrics.total(url, "ragserve_router_predicted_cached_tokens_total") - predicted_before
    actual = metrics.total(url, "ragserve_router_actual_cached_tokens_total") - actual_before
    assert reported > 0 and predicted == actual == reported


def test_subset_hint_is_honoured(fleet):
    picker, engines = fleet
    for doc in (3, 4):  # whichever engine holds a document, only the hinted one is picked
        for engine in engines:
            pick = picker.envoy.pick(CHAT, rag(doc, "q?"), subset=[endpoint(engine)])
            assert pick.endpoints == [endpoint(engine)] and pick.metadata == endpoint(engine)
            assert picker.envoy.serve(pick).status == 200
    for subset in (["10.0.0.1:8000"], []):  # nothing eligible: 503
        pick = picker.envoy.pick(CHAT, rag(3, "q?"), subset=subset)
        assert pick.immediate.status.code == 503 and pick.error()["code"] == "no_engine"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b'{"model": "tiny", "messages": [', 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "missing_model"),
        (b'{"model": "tiny", "messages": "hi"}', 400, "invalid_value"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found"),
        (b'{"model": "tiny", "prompt": "' + b"x" * 70_000 + b'"}', 413, "body_too_large"),
    ],
)
def test_bad_bodies_get_an_openai_error(fleet, metrics, body, status, code):
    picker, _ = fleet
    pick = picker.envoy.pick(CHAT, body, chunks=5)
    assert pick.immediate.status.code == status
    assert pick.error()["code"] == code and pick.error()["message"]
    assert {h.header.key: h.header.raw_value for h in pick.immediate.headers.set_headers}["content-type"] == (
        b"application/json"
    )
    assert in_flight(metrics, picker.router) == 0


def test_cut_streams_release_their_slot(fleet, metrics):
    picker, _ = fleet
    url = picker.router.url
    cut = lambda: metrics(url, "ragserve_router_requests_total", model="tiny", engine="", policy="kv_aware",  # noqa: E731
                          code="499", reason="client_closed")  # fmt: skip
    before = cut()
    decided = picker.envoy.pick(CHAT, rag(5, "q?"))  # cut after the decision, before any answer
    assert in_flight(metrics, picker.router) == 1
    decided.stream.cut()
    midway = picker.envoy.pick(CHAT, rag(5, "Count to ten.", max_tokens=8, stream=True))
    served = picker.envoy.serve(midway, cut_after=1)  # cut in the middle of the streamed answer
    assert served.status == 200 and b"[DONE]" not in served.body  # cut before the end
    process.until(lambda: in_flight(metrics, picker.router) == 0, timeout=10, what="slots released")
    assert cut() == before + 1  # the first; the second is counted with its engine


def test_health_services(fleet):
    picker, _ = fleet
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert envoy.health_status(picker.envoy.chan, service) == "SERVING"
    with pytest.raises(Exception, match="NOT_FOUND"):
        envoy.health_status(picker.envoy.chan, "no.such.Service")


def test_sheddable_requests_get_429_while_every_engine_is_saturated(fleet, gateway_cluster, metrics):
    """A second router (plaintext picker) over the same engines, saturated at one waiting prompt per engine: with
    a request decided and not answered on each engine, a sheddable one (priority < 0) gets 429 from the picker and
    from the HTTP gateway alike; others are still routed; once the held ones end, the sheddable one is routed."""
    _, engines = fleet
    static = ",".join(e.url for e in engines)
    shedder = epp_router(gateway_cluster, "--static-engines", static, "--saturation-queue-depth", "0",
                         "--probe-interval", "0.2", tls=False, name="epp-shedder")  # fmt: skip
    process.until(lambda: registered(shedder.router) == 2 and healthy(shedder.router) == 2, what="static engines")
    sheddable = {"x-ragserve-priority": "-1"}
    held = [shedder.envoy.pick(CHAT, rag(d, "q?"), subset=[endpoint(e)]) for d, e in enumerate(engines)]
    assert [p.endpoints for p in held] == [[endpoint(e)] for e in engines]  # one waiting prompt on each
    shed = shedder.envoy.pick(CHAT, rag(3, "q?"), headers=sheddable)
    assert shed.immediate.status.code == 429 and shed.error()["code"] == "saturated"
    over_http = httpx.post(shedder.router.url + CHAT, json=rag(3, "q?"), headers=sheddable, timeout=60)
    assert over_http.status_code == 429 and over_http.json()["error"]["code"] == "saturated"
    critical = shedder.envoy.pick(CHAT, rag(3, "q?"), headers={"x-ragserve-priority": "5"})
    assert critical.immediate is None
    for pick in (*held, critical):
        assert shedder.envoy.serve(pick).status == 200
    assert in_flight(metrics, shedder.router) == 0
    again = shedder.envoy.pick(CHAT, rag(3, "q?"), headers=sheddable)
    assert again.immediate is None and shedder.envoy.serve(again).status == 200
    bad = shedder.envoy.pick(CHAT, rag(3, "q?"), headers={"x-ragserve-priority": "low"})
    assert bad.immediate.status.code == 400 and bad.error()["code"] == "invalid_priority"
    shedder.envoy.close()
    shedder.router.stop()


def healthy(router) -> int:
    return httpx.get(router.url + "/ready", timeout=5).json()["healthy_engines"]


def test_rate_limits_are_the_http_gateways(fleet, gateway_cluster):
    """--rate-limit-rps holds on the picker as on the HTTP gateway, per client (Envoy's x-forwarded-for) when keys
    are off: a client past its burst gets 429 with Retry-After, another client is still routed."""
    _, engines = fleet
    static = ",".join(e.url for e in engines)
    limited = epp_router(gateway_cluster, "--static-engines", static, "--rate-limit-rps", "0.01",
                         "--rate-limit-burst", "2", tls=False, name="epp-limited")  # fmt: skip
    process.until(lambda: healthy(limited.router) == 2, what="static engines")
    first = {"x-forwarded-for": "10.0.0.1, 10.1.1.1"}
    for _ in range(2):
        pick = limited.envoy.pick(CHAT, rag(4, "q?"), headers=first)
        assert pick.immediate is None and limited.envoy.serve(pick).status == 200
    over = limited.envoy.pick(CHAT, rag(4, "q?"), headers=first)
    assert over.immediate.status.code == 429 and over.error()["code"] == "rate_limit_exceeded"
    headers = {h.header.key: h.header.raw_value.decode() for h in over.immediate.headers.set_headers}
    assert int(headers["retry-after"]) >= 1
    other = limited.envoy.pick(CHAT, rag(4, "q?"), headers={"x-forwarded-for": "10.0.0.2"})
    assert other.immediate is None and limited.envoy.serve(other).status == 200
    limited.envoy.close()
    limited.router.stop()
