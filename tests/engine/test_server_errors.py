"""Every client error gets the right status and an OpenAI-shaped body, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers.engine_server import MODEL_NAME, running_engine

KEY = "sk-engine-test"
LIMIT = 64 * 1024
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    args = ["--num-gpu-blocks", "128", "--max-model-len", "512", "--api-key", KEY, "--max-body-bytes", "64KiB"]
    with running_engine(tmp_path_factory.mktemp("engine"), *args) as proc:
        yield proc
    assert "internal error" not in proc.output() and "Traceback" not in proc.output()


@pytest.fixture(scope="module")
def sdk(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield client
    client.close()


def post(engine, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    return httpx.post(engine.url + path, content=content, headers=headers, timeout=30, **kw)


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["x-ragserve-error-scope"] == "request"  # the client's fault: the router must not retry
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("authentication_error" if status == 401 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


def test_context_overflow_names_the_numbers(sdk, engine):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=600)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert "600" in info.value.message and "512" in info.value.message
    long_prompt = "word " * 600
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": long_prompt}], stream=True)
    assert "512" in info.value.message


def test_unknown_model_is_404(sdk, engine):
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="gpt-nope", messages=CHAT)
    assert info.value.code == "model_not_found" and "gpt-nope" in info.value.message
    assert_error(post(engine, "/tokenize", {"model": "x", "prompt": "a"}), 404, "model")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "lots"}, "max_tokens"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"seed": 2**70}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ],
)
def test_bad_chat_parameters_name_the_field(engine, body, param):
    assert_error(post(engine, "/v1/chat/completions", {"messages": CHAT, **body}), 400, param)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": [1, 2, 10**9]}, "token ids"),
        ({"prompt": []}, "empty"),
        ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_completion_requests_are_400(engine, body, fragment):
    assert fragment in assert_error(post(engine, "/v1/completions", body), 400)


def test_unsupported_chat_content_is_400(engine):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    assert "text" in assert_error(post(engine, "/v1/chat/completions", {"messages": image}), 400, "messages")
    tools = {"messages": CHAT, "tools": [{"type": "retrieval"}]}  # tools are served; only function tools
    assert "function" in assert_error(post(engine, "/v1/chat/completions", tools), 400, "tools.0")


def test_malformed_json_is_400(engine):
    assert_error(post(engine, "/v1/chat/completions", b"{not json"), 400, code="invalid_json")
    assert_error(post(engine, "/v1/completions", b"[1, 2]"), 400, code="invalid_json")
    assert_error(post(engine, "/v1/completions", "\udcff".encode("utf-8", "surrogatepass")), 400, code="invalid_json")


def test_oversized_bodies_are_413(engine):
    big = {"prompt": "a" * (LIMIT + 10)}
    assert_error(post(engine, "/v1/completions", big), 413, code="body_too_large")

    def chunks():  # no Content-Length: the limit applies to the streamed body
        for _ in range(LIMIT // 1024 + 2):
            yield b" " * 1024

    headers = {"Authorization": f"Bearer {KEY}"}
    resp = httpx.post(engine.url + "/v1/completions", content=chunks(), headers=headers, timeout=30)
    assert "content-length" not in resp.request.headers
    assert_error(resp, 413, code="body_too_large")


def test_api_key_is_required(engine):
    assert_error(post(engine, "/v1/completions", {"prompt": "x"}, key=None), 401, code="invalid_api_key")
    assert_error(post(engine, "/v1/completions", {"prompt": "x"}, key="sk-wrong"), 401)
    assert_error(post(engine, "/tokenize", {"prompt": "x"}, key="sk-wrong"), 401)
    bad = openai.OpenAI(base_url=engine.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for open_path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(engine.url + open_path).status_code == 200


def test_unknown_route_and_method(engine):
    assert_error(httpx.get(engine.url + "/v1/nothing"), 404, code="not_found")
    assert httpx.get(engine.url + "/v1/completions").status_code == 405
    assert_error(httpx.delete(engine.url + "/v1/warmup/nope", headers={"Authorization": f"Bearer {KEY}"}), 404)


def test_detokenize_rejects_bad_ids(engine):
    assert_error(post(engine, "/detokenize", {"tokens": [-1]}), 400, "tokens")
    assert_error(post(engine, "/tokenize", {}), 400)


def test_still_serving_after_errors(sdk, engine):
    for _ in range(2):
        post(engine, "/v1/completions", b"{")
        post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 10**6})
    out = sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=3)
    assert out.usage.completion_tokens == 3 and engine.alive()
