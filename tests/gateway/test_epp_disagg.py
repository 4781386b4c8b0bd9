"""Disaggregated prefill/decode behind a gateway (docs/disaggregation.md, "Behind a gateway"), real processes: a
cachestore, a --role prefill and a --role decode engine registered with a router serving the endpoint picker, driven
by the Envoy-like client, and a `both` engine alone for reference. A long prompt picked onto the decode engine
carries x-prefiller-host-port naming the prefill engine; the decode engine runs the prefill leg there, fetches the
prompt and computes its last token only, answering exactly as the reference does, streamed or not, n=1 or 2. A short
prompt gets no header (and a client's own is removed); a prefiller outside --prefiller-allow is ignored; a dead, a
frozen (after --prefiller-timeout) or a draining one (it answers 503) costs a recompute, never an error."""

from __future__ import annotations

import signal

import httpx
import pytest

from ragserve.disagg import PREFILLER_HEADER
from tests.gateway.conftest import ENGINE_FLAGS, endpoint, epp_router
from tests.helpers import envoy, process
from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.net import free_port
from tests.router.conftest import running, scrape

pytestmark = pytest.mark.slow  # several processes, each loading a model
CHAT = "/v1/chat/completions"
LEGS = "ragserve:disagg_prefill_legs_total"  # the decode engine's
ROUTER_LEGS = "ragserve_router_disagg_prefill_legs_total"
STORED = "ragserve:kv_transfer_requests_total"  # the prefill engine's prompts stored for a decode engine
LEG_TIMEOUT_S = 5  # the decode engine's --prefiller-timeout: what the frozen-prefiller test waits out


def metric(url: str, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in scrape(url).items() if n == name and all((k, v) in ls for k, v in labels.items()))


def rag(i: int, question: str) -> dict:
    """~250 tokens of unique context (the threshold is 64), greedy."""
    context = " ".join(f"item {i}-{j} weighs {j * 13 % 97} grams." for j in range(24))
    messages = [{"role": "system", "content": f"Answer from the context.\n\n{context}"},
                {"role": "user", "content": question}]  # fmt: skip
    return {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


SHORT = {"model": "tiny", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def pd(gateway_cluster, tmp_path_factory):
    store = CacheStoreProcess(tmp_path_factory.mktemp("epp-pd") / "cachestore.log", free_port(), "--memory", "256MiB")
    picker = None
    try:  # the store is stopped however far the start got (a failed start left it running)
        store.wait_serving()
        picker = epp_router(gateway_cluster, "--heartbeat-interval-ms", "300", "--disagg-min-prompt-tokens", "64",
                            tls=False, name="epp-pd-router")  # fmt: skip
        flags = [*ENGINE_FLAGS, "--cachestore", store.address]
        (prefill,) = gateway_cluster.real_engines(picker.router, 1, *flags, "--role", "prefill", ids=["epp-prefill"])
        allow = ["--prefiller-allow", "127.0.0.0/8", "--prefiller-timeout", str(LEG_TIMEOUT_S)]
        (decode,) = gateway_cluster.real_engines(
            picker.router, 1, *flags, "--role", "decode", *allow, ids=["epp-decode"]
        )
        (reference,) = gateway_cluster.real_engines(None, 1, *ENGINE_FLAGS, ids=["epp-both"])
        for engine in (prefill, decode):
            gateway_cluster.wait_registered(engine)
        ready = lambda: httpx.get(reference.url + "/ready", timeout=5).status_code == 200  # noqa: E731
        process.until(ready, timeout=300, what="the reference engine ready", proc=reference)  # up is not ready
        process.until(lambda: envoy.health_status(picker.envoy.chan, "readiness") == "SERVING", what="picker ready")
        yield picker, prefill, decode, reference
    finally:
        if picker is not None:
            picker.envoy.close()
        store.stop()


def answer(url: str, body: dict, headers: dict | None = None) -> dict:
    resp = httpx.post(url + CHAT, json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def text(data: dict) -> str:
    return data["choices"][0]["message"]["content"]


def served_by_decode(picker, prefill, decode, body: dict) -> bytes:
    """`body` through the picker: onto the decode engine, the prefill engine named; what the client got."""
    pick = picker.envoy.pick(CHAT, body)
    assert pick.endpoints[0] == endpoint(decode)
    assert pick.set_headers[PREFILLER_HEADER] == endpoint(prefill)
    served = picker.envoy.serve(pick)
    assert served.status == 200 and served.endpoint == endpoint(decode)
    return served.body


def leg_to_fail(pd, body: dict) -> tuple[float, float, dict, object]:
    """Before a leg that will fail: the decode engine's failed and ok leg counts, the reference's answer, and the
    picker's pick, which names the prefill engine."""
    picker, prefill, decode, reference = pd
    failed, ok = metric(decode.url, LEGS, outcome="failed"), metric(decode.url, LEGS, outcome="ok")
    expected = answer(reference.url, body)
    pick = picker.envoy.pick(CHAT, body)
    assert pick.set_headers[PREFILLER_HEADER] == endpoint(prefill)
    return failed, ok, expected, pick


def computed_by_decode(raw: bytes, expected: dict, decode, ok: float) -> None:
    """After a failed leg: the client got the reference's answer, computed on the decode engine, and no leg ok."""
    data = httpx.Response(200, content=raw).json()
    assert text(data) == text(expected)
    assert data["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed here
    assert metric(decode.url, LEGS, outcome="ok") == ok


def sse_chunks(raw: bytes) -> list[dict]:
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [httpx.Response(200, content=e).json() for e in events[:-1]]


def test_long_prompt_is_prefilled_by_the_named_prefill_engine(pd):
    picker, prefill, decode, reference = pd
    body = rag(1, "Which item weighs 39 grams?")
    legs, delegated = (
        metric(decode.url, LEGS, outcome="ok"),
        metric(picker.router.url, ROUTER_LEGS, outcome="delegated"),
    )
    stored = metric(prefill.url, STORED, direction="stored")
    pick = picker.envoy.pick(CHAT, body)
    assert pick.endpoints[0] == endpoint(decode)
    assert pick.set_headers[PREFILLER_HEADER] == endpoint(prefill)
    served = picker.envoy.serve(pick)
    assert served.status == 200 and served.endpoint == endpoint(decode)
    data = httpx.Response(200, content=served.body).json()
    expected = answer(reference.url, body)
    assert text(data) == text(expected)
    usage = data["usage"]
    assert usage["prompt_tokens"] == expected["usage"]["prompt_tokens"] >= 64
    # the prefill engine stored the prompt, the decode engine fetched it and started from the leg's first token:
    # it computed no prompt token
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert metric(prefill.url, STORED, direction="stored") == stored + 1
    assert metric(decode.url, LEGS, outcome="ok") == legs + 1
    assert metric(picker.router.url, ROUTER_LEGS, outcome="delegated") == delegated + 1


def test_short_prompt_gets_no_prefiller_and_a_clients_is_removed(pd):
    picker, prefill, decode, reference = pd
    legs = {o: metric(decode.url, LEGS, outcome=o) for o in ("ok", "ignored", "failed")}
    pick = picker.envoy.pick(CHAT, SHORT | {"temperature": 0}, headers={PREFILLER_HEADER: endpoint(prefill)})
    assert pick.endpoints[0] == endpoint(decode)
    assert PREFILLER_HEADER not in pick.set_headers and pick.removed == [PREFILLER_HEADER]
    served = picker.envoy.serve(pick)
    assert served.status == 200
    assert text(httpx.Response(200, content=served.body).json()) == text(
        answer(reference.url, SHORT | {"temperature": 0})
    )
    assert {o: metric(decode.url, LEGS, outcome=o) for o in legs} == legs  # no leg ran, none was refused


@pytest.mark.parametrize("doc, named", [(2, "10.9.8.7:{port}"), (4, "localhost:{port}"), (5, "garbage")])
def test_prefiller_not_allowed_is_ignored(pd, doc, named):
    """Outside --prefiller-allow (127.0.0.0/8 here), or a name rather than an IP: the decode engine computes (each
    case its own context, so nothing is cached from another)."""
    _, prefill, decode, reference = pd
    body = rag(doc, "Which item weighs 26 grams?")
    ignored, stored = metric(decode.url, LEGS, outcome="ignored"), metric(prefill.url, STORED, direction="stored")
    data = answer(decode.url, body, {PREFILLER_HEADER: named.format(port=prefill.port)})
    assert text(data) == text(answer(reference.url, body))
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed here, nothing fetched
    assert metric(decode.url, LEGS, outcome="ignored") == ignored + 1
    assert metric(prefill.url, STORED, direction="stored") == stored  # the prefill engine was never called


def test_dead_prefiller_costs_a_recompute_not_an_error(pd):
    _, _, decode, reference = pd
    body = rag(3, "Which item weighs 52 grams?")
    failed = metric(decode.url, LEGS, outcome="failed")
    data = answer(decode.url, body, {PREFILLER_HEADER: f"127.0.0.1:{free_port()}"})  # nothing listens there
    assert text(data) == text(answer(reference.url, body))
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(decode.url, LEGS, outcome="failed") == failed + 1


def test_streamed_request_takes_the_prefill_leg(pd):
    picker, prefill, decode, reference = pd
    body = rag(6, "Which item weighs 65 grams?")
    legs = metric(decode.url, LEGS, outcome="ok")
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(served_by_decode(picker, prefill, decode, streamed))
    expected = answer(reference.url, body)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text(expected)
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert usage["completion_tokens"] == expected["usage"]["completion_tokens"]
    assert metric(decode.url, LEGS, outcome="ok") == legs + 1


def test_n2_request_takes_one_prefill_leg(pd):
    picker, prefill, decode, reference = pd
    body = rag(7, "Which item weighs 78 grams?") | {"n": 2}
    legs, stored = metric(decode.url, LEGS, outcome="ok"), metric(prefill.url, STORED, direction="stored")
    data = httpx.Response(200, content=served_by_decode(picker, prefill, decode, body)).json()
    expected = answer(reference.url, body)
    assert [c["message"]["content"] for c in data["choices"]] == [text(expected)] * 2  # greedy: both alike
    usage = data["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        expected["usage"]["prompt_tokens"], expected["usage"]["completion_tokens"]
    )  # fmt: skip
    # n = 2 cannot start from the leg's one token: the decode engine computed the last prompt token again
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert metric(decode.url, LEGS, outcome="ok") == legs + 1  # one leg for both choices
    assert metric(prefill.url, STORED, direction="stored") == stored + 1


def test_frozen_prefiller_costs_a_recompute_after_the_timeout(pd, gateway_cluster):
    """The prefill engine stops answering once the picker named it: the leg times out (--prefiller-timeout) and the
    decode engine computes the prompt itself. Last in the module: the router drops the frozen engine meanwhile."""
    picker, prefill, decode, _ = pd
    failed, ok, expected, pick = leg_to_fail(pd, rag(8, "Which item weighs 91 grams?"))
    with process.frozen([prefill]):
        served = picker.envoy.serve(pick)
        assert served.status == 200 and served.endpoint == endpoint(decode)
        assert metric(decode.url, LEGS, outcome="failed") == failed + 1
    computed_by_decode(served.body, expected, decode, ok)
    gateway_cluster.wait_registered(prefill)  # thawed, it registers again


@pytest.mark.last_in_module  # the prefill engine exits
def test_draining_prefiller_costs_a_recompute(pd):
    """A live prefill engine answering 5xx: draining after the picker named it (SIGTERM; a request of its own keeps it
    up), it answers the decode engine's leg 503: the leg counts failed and the decode engine computes the prompt, the
    answer the reference's."""
    picker, prefill, decode, _ = pd
    failed, ok, expected, pick = leg_to_fail(pd, rag(9, "Which item weighs 13 grams?"))
    with running(prefill):
        prefill.popen.send_signal(signal.SIGTERM)
        draining = lambda: httpx.get(prefill.url + "/ready", timeout=5).status_code == 503  # noqa: E731
        process.until(draining, what="the prefill engine draining")
        served = picker.envoy.serve(pick)
        assert served.status == 200 and served.endpoint == endpoint(decode)
        assert metric(decode.url, LEGS, outcome="failed") == failed + 1
        assert f"prefill leg on http://{endpoint(prefill)} failed (HTTP 503)" in decode.output()  # a 5xx answer
    prefill.popen.wait(60)
    computed_by_decode(served.body, expected, decode, ok)
