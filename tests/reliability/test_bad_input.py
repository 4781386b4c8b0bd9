"""The bad-input matrix: every bad body gets a 4xx naming the field, from a real router and a real engine.

Both apply ragserve.http.limits before anything else reads the body; the router answers the
cases it covers itself (no engine is involved), value ranges of sampling parameters come back
from the engine through the router. Afterwards both are healthy and serve a normal request, and
neither logged an internal error.
"""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from tests.helpers.engine_server import MODEL_NAME, running_engine
from tests.helpers.net import free_port
from tests.helpers.process import start, until, wait_http

M = MODEL_NAME
CHAT = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"model": M, "prompt": "hi", "max_tokens": 2}
LIMIT = 1024 * 1024
CHATS, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat(**fields) -> dict:
    return {**CHAT, **fields}


def text(**fields) -> dict:
    return {**TEXT, **fields}


def msg(**fields) -> dict:
    return chat(messages=[{"role": "user", "content": "hi", **fields}])


def raw(body: bytes) -> bytes:
    return body


# (id, path, body (dict, or raw bytes), the field the error names, answered by the engine only)
CASES = [
    # lone surrogates in any string field
    ("content-surrogate", CHATS, msg(content="hi \ud800"), "messages.0.content", False),
    ("part-surrogate", CHATS, msg(content=[{"type": "text", "text": "\udfff"}]), "messages.0.content.0.text", False),
    ("part-type-surrogate", CHATS, msg(content=[{"type": "\ud800", "text": "a"}]), "messages.0.content.0.type", False),
    ("role-surrogate", CHATS, msg(role="\udc00"), "messages.0.role", False),
    ("name-surrogate", CHATS, msg(name="\ud800"), "messages.0.name", False),
    ("model-surrogate", CHATS, chat(model="\ud800"), "model", False),
    ("user-surrogate", CHATS, chat(user="\ud800"), "user", False),
    ("salt-surrogate", CHATS, chat(cache_salt="\ud800"), "cache_salt", False),
    ("salt-surrogate-text", COMPLETIONS, text(cache_salt="a\udbff"), "cache_salt", False),
    ("stop-surrogate", CHATS, chat(stop="\ud800"), "stop", False),
    ("stop-list-surrogate", CHATS, chat(stop=["ok", "\ud800"]), "stop.1", False),
    ("prompt-surrogate", COMPLETIONS, text(prompt="\ud800"), "prompt", False),
    ("batch-surrogate", COMPLETIONS, text(prompt=["Hello there", "\ud800"]), "prompt.1", False),
    ("unknown-field-surrogate", CHATS, chat(foo="\ud800"), "foo", False),
    ("key-surrogate", CHATS, {**CHAT, "\ud800": 1}, "body", False),
    ("nested-surrogate", CHATS, chat(metadata={"a": ["\udc00"]}), "metadata.a.0", False),
    ("format-surrogate", CHATS, chat(response_format={"type": "\ud800"}), "response_format.type", False),
    ("tool-surrogate", CHATS, chat(tools=[{"function": {"name": "\ud800"}}]), "tools.0.function.name", False),
    ("bias-key-surrogate", CHATS, chat(logit_bias={"\ud800": 1}), "logit_bias", False),
    ("suffix-surrogate", COMPLETIONS, text(suffix="\ud800"), "suffix", False),
    # JSON structure and size
    ("deep-10000", CHATS, raw(b'{"model": "m", "x": ' + b"[" * 10000 + b"]" * 10000 + b"}"), "body", False),
    ("deep-65", COMPLETIONS, raw(json.dumps(text(x=json.loads("[" * 64 + "]" * 64))).encode()), "body", False),
    ("deep-objects", CHATS, raw(b'{"a":' * 5000 + b"1" + b"}" * 5000), "body", False),
    ("not-json", CHATS, raw(b"{not json"), "body", False),
    ("nan", CHATS, raw(json.dumps(chat(temperature=float("nan"))).encode()), "NaN", False),
    ("infinity", COMPLETIONS, raw(json.dumps(text(top_p=float("inf"))).encode()), "Infinity", False),
    ("array-body", CHATS, raw(b"[1, 2]"), "body", False),
    ("empty-body", CHATS, raw(b""), "body", False),
    ("bad-utf8", COMPLETIONS, raw(b'{"prompt": "\xff\xfe"}'), "body", False),
    ("too-large", COMPLETIONS, text(prompt="a" * (LIMIT + 10)), "body", False),
    # chat roles and messages
    ("role-wizard", CHATS, msg(role="wizard"), "messages.0.role", False),
    ("role-missing", CHATS, chat(messages=[{"content": "hi"}]), "messages.0.role", False),
    ("role-int", CHATS, msg(role=5), "messages.0.role", False),
    ("role-case", CHATS, msg(role="User"), "messages.0.role", False),
    ("role-function", CHATS, msg(role="function"), "messages.0.role", False),
    ("messages-string", CHATS, chat(messages="hi"), "messages", False),
    ("messages-empty", CHATS, chat(messages=[]), "messages", False),
    ("messages-missing", CHATS, {"model": M}, "messages", False),
    ("message-not-object", CHATS, chat(messages=["hi"]), "messages.0", False),
    ("messages-too-many", CHATS, chat(messages=[{"role": "user", "content": "a"}] * 4097), "messages", False),
    ("content-int", CHATS, msg(content=5), "messages.0.content", False),
    ("parts-too-many", CHATS, msg(content=[{"type": "text", "text": "a"}] * 257), "messages.0.content", False),
    ("part-not-object", CHATS, msg(content=["x"]), "messages.0.content.0", False),
    ("part-text-int", CHATS, msg(content=[{"type": "text", "text": 5}]), "messages.0.content.0.text", False),
    ("name-too-long", CHATS, msg(name="n" * 300), "messages.0.name", False),
    # stop
    ("stop-too-many", CHATS, chat(stop=[f"s{i}" for i in range(17)]), "stop", False),
    ("stop-too-long", CHATS, chat(stop=["x" * 257]), "stop", False),
    ("stop-empty", CHATS, chat(stop=[""]), "stop", False),
    ("stop-int", COMPLETIONS, text(stop=5), "stop", False),
    ("stop-list-int", COMPLETIONS, text(stop=[1]), "stop", False),
    ("stop-ids-too-many", COMPLETIONS, text(stop_token_ids=list(range(257))), "stop_token_ids", False),
    ("stop-ids-negative", COMPLETIONS, text(stop_token_ids=[-1]), "stop_token_ids", False),
    ("stop-ids-string", COMPLETIONS, text(stop_token_ids="x"), "stop_token_ids", False),
    # n, best_of
    ("n-zero", CHATS, chat(n=0), "n", False),
    ("n-huge", CHATS, chat(n=65), "n", False),
    ("n-string", CHATS, chat(n="2"), "n", False),
    ("n-float", COMPLETIONS, text(n=1.5), "n", False),
    ("n-bool", COMPLETIONS, text(n=True), "n", False),
    ("best-of-huge", COMPLETIONS, text(best_of=65), "best_of", False),
    ("best-of-zero", COMPLETIONS, text(best_of=0), "best_of", False),
    # logit_bias
    ("bias-too-many", CHATS, chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", False),
    ("bias-too-big", CHATS, chat(logit_bias={"1": 101}), "logit_bias", False),
    ("bias-too-small", COMPLETIONS, text(logit_bias={"1": -1000}), "logit_bias", False),
    ("bias-key-word", CHATS, chat(logit_bias={"abc": 1}), "logit_bias", False),
    ("bias-key-arabic-digit", CHATS, chat(logit_bias={"\u0661": 1}), "logit_bias", False),
    ("bias-value-string", CHATS, chat(logit_bias={"1": "x"}), "logit_bias", False),
    ("bias-list", CHATS, chat(logit_bias=[]), "logit_bias", False),
    # logprobs
    ("chat-logprobs-int", CHATS, chat(logprobs=5), "logprobs", False),
    ("top-logprobs-huge", CHATS, chat(logprobs=True, top_logprobs=21), "top_logprobs", False),
    ("top-logprobs-negative", CHATS, chat(logprobs=True, top_logprobs=-1), "top_logprobs", False),
    ("logprobs-huge", COMPLETIONS, text(logprobs=21), "logprobs", False),
    ("logprobs-bool", COMPLETIONS, text(logprobs=True), "logprobs", False),
    # max_tokens and the context
    ("max-tokens-zero", CHATS, chat(max_tokens=0), "max_tokens", False),
    ("max-tokens-negative", COMPLETIONS, text(max_tokens=-5), "max_tokens", False),
    ("max-tokens-string", COMPLETIONS, text(max_tokens="10"), "max_tokens", False),
    ("max-tokens-2e40", CHATS, chat(max_tokens=2**40), "max_tokens", False),
    ("max-tokens-over-context", COMPLETIONS, text(max_tokens=100_000), "max_tokens", True),
    ("max-completion-tokens-zero", CHATS, chat(max_completion_tokens=0), "max_completion_tokens", False),
    ("min-tokens-negative", COMPLETIONS, text(min_tokens=-1), "min_tokens", False),
    # prompts and other lists
    ("prompt-empty-list", COMPLETIONS, text(prompt=[]), "prompt", False),
    ("prompt-too-many", COMPLETIONS, text(prompt=["a"] * 257), "prompt", False),
    ("prompt-mixed", COMPLETIONS, text(prompt=[1, "a"]), "prompt.0", False),
    ("prompt-empty-ids", COMPLETIONS, text(prompt=[[]]), "prompt.0", False),
    ("prompt-ids-mixed", COMPLETIONS, text(prompt=[[1, "x"]]), "prompt.0", False),
    ("prompt-int", COMPLETIONS, text(prompt=5), "prompt", False),
    ("prompt-missing", COMPLETIONS, {"model": M}, "prompt", False),
    ("list-too-long", CHATS, chat(tags=["a"] * 4097), "tags", False),
    ("object-too-big", CHATS, chat(metadata={str(i): 1 for i in range(1025)}), "metadata", False),
    # types and ranges of the other fields
    ("temperature-string", CHATS, chat(temperature="hot"), "temperature", False),
    ("temperature-negative", CHATS, chat(temperature=-1), "temperature", True),
    ("top-p-zero", COMPLETIONS, text(top_p=0), "top_p", True),
    ("presence-penalty-5", CHATS, chat(presence_penalty=5), "presence_penalty", True),
    ("frequency-penalty-string", CHATS, chat(frequency_penalty="x"), "frequency_penalty", False),
    ("seed-huge", CHATS, chat(seed=2**70), "seed", False),
    ("seed-string", COMPLETIONS, text(seed="x"), "seed", False),
    ("stream-string", CHATS, chat(stream="yes"), "stream", False),
    ("echo-string", COMPLETIONS, text(echo="yes"), "echo", False),
    ("model-empty", CHATS, chat(model=""), "model", False),
    ("model-int", COMPLETIONS, text(model=5), "model", False),
    ("user-too-long", CHATS, chat(user="u" * 300), "user", False),
    ("salt-empty", COMPLETIONS, text(cache_salt=""), "cache_salt", False),
    ("salt-int", CHATS, chat(cache_salt=5), "cache_salt", False),
    ("resume-negative", COMPLETIONS, text(resume_token_ids=[-1]), "resume_token_ids", False),
    ("resume-string", COMPLETIONS, text(resume_token_ids="x"), "resume_token_ids", False),
    ("return-ids-string", CHATS, chat(return_token_ids="yes"), "return_token_ids", False),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    args = ["--num-gpu-blocks", "64", "--max-model-len", "256", "--max-body-bytes", "1MiB"]
    with running_engine(tmp_path_factory.mktemp("engine"), *args) as proc:
        yield proc
    assert "internal error" not in proc.output() and "Traceback" not in proc.output()


@pytest.fixture(scope="module")
def router(tmp_path_factory, engine):
    tmp, port = tmp_path_factory.mktemp("router"), free_port()
    argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--grpc-port", str(free_port()), "--static-engines", engine.url, "--max-body-bytes", "1MiB"]
    proc = start("router", argv, tmp / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc=proc)
        until(lambda: httpx.get(url + "/ready").json()["healthy_engines"] == 1, what="engine probed", proc=proc)
        proc.url = url
        yield proc
        assert "internal error" not in proc.output() and "Traceback" not in proc.output()
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]


def send(url: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: surrogates as \\u escapes
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def assert_names_field(resp: httpx.Response, field: str) -> dict:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error) and error["type"] == "invalid_request_error", error
    assert error["param"] == field or field in error["message"], error
    return error


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_engine_rejects(engine, case):
    _, path, body, field, _ = case
    resp = send(engine.url, path, body)
    assert_names_field(resp, field)
    assert resp.headers["x-ragserve-error-scope"] == "request"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_router_rejects(router, case):
    _, path, body, field, engine_only = case
    resp = send(router.url, path, body)
    assert_names_field(resp, field)
    assert ("x-ragserve-engine" in resp.headers) == engine_only  # the router answered itself unless engine_only


def test_the_matrix_is_big_enough():
    assert len(CASES) >= 80 and len({c[0] for c in CASES}) == len(CASES)


def test_both_stay_healthy_and_serve(engine, router):
    for url in (engine.url, router.url):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/ready", timeout=10).status_code == 200
        ok = send(url, CHATS, chat(messages=[{"role": "developer", "content": "be brief"}, CHAT["messages"][0]]))
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None, ok.text
        assert send(url, COMPLETIONS, text(prompt=["Hello there", "General Kenobi"])).status_code == 200
    assert httpx.get(router.url + "/ready", timeout=10).json()["healthy_engines"] == 1
