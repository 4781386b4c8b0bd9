"""The HTTP gateway in front of real engines: auth, limits, error shapes, models, headers, pass-through.

Streams the tests must hold mid-way (relay chunk by chunk, client disconnect, concurrency) come from the
fault-injection stand-in serving the model "held": a real engine cannot pause a stream on demand."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.helpers import process

KEY, SLOW_KEY = "sk-test-0123456789", "sk-slow-abcdef"


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    assert "127.0.0.1" not in resp.text and "Traceback" not in resp.text
    return body["error"]


@pytest.fixture(scope="module")
def gw(fleet, module_cluster):
    """Real engines serving "tiny" and "other", a held-stream stand-in serving "held"; keys and limits."""
    keys = module_cluster.tmp / "keys.txt"
    keys.write_text(f"# test keys\n{KEY} name=main\n{SLOW_KEY} name=slow rps=0.01 burst=1\n")
    tiny = fleet.engines[0]
    [other] = module_cluster.real_engines(None, 1, "--served-model-name", "other")
    held = module_cluster.engine("eng-held", "--served-model-name", "held")
    router = module_cluster.router(
        "--static-engines",
        f"{tiny.url},{other.url},{held.url}",
        "--api-keys-file",
        str(keys),
        "--max-body-bytes",
        "64KiB",
        "--allow-policy-header",
        "--probe-interval",
        "0.5",
    )
    process.until(lambda: httpx.get(router.url + "/ready").json()["healthy_engines"] == 3, what="engines probed")
    return router, tiny, other, held


def post(router, body, key=KEY, path="/v1/chat/completions", **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kw.pop("headers", {}))
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(router.url + path, content=data, headers=headers, timeout=30, **kw)


def chat(model="tiny", text="hello", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}


def stream_chat(router):
    """A streamed chat completion of the held stand-in through the router (a context manager)."""
    url, headers = router.url + "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    return httpx.stream("POST", url, json=chat("held", stream=True), headers=headers, timeout=30)


def test_models_is_the_union_and_requests_go_to_engines_serving_the_model(gw):
    router, *_ = gw
    listed = httpx.get(router.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert sorted(m["id"] for m in listed["data"]) == ["held", "other", "tiny"]
    for _ in range(3):
        other = post(router, chat("other"))
        assert other.headers.get("x-ragserve-engine") == "static-1", other.text
        assert other.json()["model"] == "other"
        tiny = post(router, chat("tiny"))
        assert tiny.headers["x-ragserve-engine"] == "static-0" and tiny.json()["usage"]["completion_tokens"] == 2


def test_request_id_is_returned_or_generated(gw):
    router, *_ = gw
    resp = post(router, chat(), headers={"X-Request-Id": "req-42"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "req-42"
    generated = post(router, chat()).headers["x-request-id"]
    assert len(generated) == 32 and generated != "req-42"
    assert post(router, b"{", headers={"X-Request-Id": "req-43"}).headers["x-request-id"] == "req-43"


def test_completions_pass_through(gw):
    router, *_ = gw
    resp = post(router, {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2}, path="/v1/completions")
    assert resp.status_code == 200 and resp.json()["object"] == "text_completion"


def test_missing_and_wrong_api_keys_get_401(gw):
    router, *_ = gw
    assert_openai_error(post(router, chat(), key=None), 401, "invalid_api_key")
    assert_openai_error(post(router, chat(), key="sk-wrong"), 401, "invalid_api_key")
    assert_openai_error(httpx.get(router.url + "/v1/models"), 401, "invalid_api_key")
    assert httpx.get(router.url + "/health").status_code == 200  # probes need no key


def test_rate_limit_is_429_with_retry_after(gw, metrics):
    router, *_ = gw
    assert post(router, chat(), key=SLOW_KEY).status_code == 200
    resp = post(router, chat(), key=SLOW_KEY)
    error = assert_openai_error(resp, 429, "rate_limit_exceeded")
    assert error["type"] == "rate_limit_error"
    assert int(resp.headers["retry-after"]) >= 1
    assert post(router, chat(), key=KEY).status_code == 200  # other keys have their own bucket
    assert metrics(router.url, "ragserve_router_rate_limited_total") >= 1


def test_body_limit_is_413_with_or_without_content_length(gw):
    router, *_ = gw
    big = chat(text="x" * 70_000)
    assert_openai_error(post(router, big), 413, "body_too_large")

    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    resp = httpx.post(router.url + "/v1/chat/completions", content=chunks(), headers={"Authorization": f"Bearer {KEY}"})
    assert_openai_error(resp, 413, "body_too_large")


@pytest.mark.parametrize(
    ("body", "code"),
    [(b"{not json", "invalid_json"), (b"[1, 2]", "invalid_json"), (b'{"messages": []}', "missing_model")],
)
def test_malformed_requests_are_400(gw, body, code):
    router, *_ = gw
    error = assert_openai_error(post(router, body), 400, code)
    assert error["type"] == "invalid_request_error"


def test_unknown_model_and_path_are_404(gw):
    router, *_ = gw
    error = assert_openai_error(post(router, chat("gpt-17")), 404, "model_not_found")
    assert error["param"] == "model" and "gpt-17" in error["message"]
    assert_openai_error(httpx.post(router.url + "/v1/nothing-here", json={}), 404)


def test_unknown_policy_header_is_400(gw):
    router, *_ = gw
    assert_openai_error(post(router, chat(), headers={"X-Ragserve-Policy": "random"}), 400, "invalid_policy")
    assert post(router, chat(), headers={"X-Ragserve-Policy": "round_robin"}).status_code == 200


def test_engine_errors_pass_through_unchanged(gw):
    router, tiny, *_ = gw
    # the engine itself refuses (4xx): the router relays its answer as it is and does not retry elsewhere
    body = chat(top_p=0.0)  # only the engine validates sampling parameters
    direct = httpx.post(tiny.url + "/v1/chat/completions", json=body, timeout=30)
    resp = post(router, body, path="/v1/chat/completions")
    assert resp.status_code == direct.status_code == 400 and "top_p" in resp.json()["error"]["message"]
    assert resp.json() == direct.json()
    assert resp.headers["x-ragserve-engine"] == "static-0"
    assert httpx.get(router.url + "/ready").json()["healthy_engines"] == 3


def test_sse_is_relayed_chunk_by_chunk(gw):
    """The engine holds its stream after the first chunk: the client must already have it."""
    router, *_, held = gw
    httpx.post(held.url + "/control/hold")
    try:
        with stream_chat(router) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = resp.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] == "ok"
            httpx.post(held.url + "/control/release")
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
    finally:
        httpx.post(held.url + "/control/release")


def test_client_disconnect_cancels_the_upstream_stream(gw, until):
    router, *_, held = gw
    aborted = httpx.get(held.url + "/control/stats").json()["aborted"]
    httpx.post(held.url + "/control/hold")
    try:
        with stream_chat(router) as resp:
            next(line for line in resp.iter_lines() if line)
        # the client hung up mid-stream; the router must close the engine's stream too
        until(lambda: httpx.get(held.url + "/control/stats").json()["aborted"] > aborted, message="upstream abort")
    finally:
        httpx.post(held.url + "/control/release")


def test_concurrent_streams_are_not_serialized(gw):
    """Two held streams both deliver their first chunk: the router does not wait for one to finish."""
    router, *_, held = gw
    httpx.post(held.url + "/control/hold")
    firsts: list[str] = []

    def one():
        with stream_chat(router) as resp:
            lines = resp.iter_lines()
            firsts.append(next(line for line in lines if line))
            list(lines)

    threads = [threading.Thread(target=one) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        process.until(lambda: len(firsts) == 2, timeout=10, what="both first chunks")
    finally:
        httpx.post(held.url + "/control/release")
        for t in threads:
            t.join(30)
