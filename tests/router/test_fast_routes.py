"""The generate endpoints' direct path (fast_routes.py on ragserve.http.direct), on a real router and engine: the
checks FastAPI's dependencies made still run, in the same order (the request id first: a 401 or 429 carries it), and
every refusal is an OpenAI error body; other methods get 405, other paths the FastAPI app's answers."""

from __future__ import annotations

import httpx
import pytest

KEY, LIMITED = "sk-fast-test", "sk-fast-limited"
COMPLETION = {"model": "tiny", "prompt": "The paged cache", "max_tokens": 2}


@pytest.fixture(scope="module")
def router(module_cluster, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{KEY} name=team\n{LIMITED} name=limited rps=0.001 burst=1\n")
    router = module_cluster.router("--api-keys-file", str(keys), "--max-body-bytes", "4KiB")
    module_cluster.real_engines(router, 1)
    from tests.helpers.process import until

    with httpx.Client(base_url=router.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        until(lambda: http.get("/v1/models").json()["data"], timeout=60, what="engine registered")
    return router


def post(router, path: str = "/v1/completions", key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"X-Request-Id": "req-fast-1", **({"Authorization": f"Bearer {key}"} if key else {})}
    kwargs.setdefault("json", COMPLETION)
    return httpx.post(router.url + path, headers=headers, timeout=60, **kwargs)


def error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_answers_carry_the_request_id_and_engine(router):
    resp = post(router)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "req-fast-1" and resp.headers["x-ragserve-engine"]
    assert resp.json()["choices"][0]["text"]


def test_auth_and_rate_limit_refusals_carry_the_request_id(router):
    for key, code in ((None, "invalid_api_key"), ("sk-wrong", "invalid_api_key")):
        resp = post(router, key=key)
        assert resp.status_code == 401 and error(resp)["code"] == code
        assert resp.headers["x-request-id"] == "req-fast-1"
    assert post(router, key=LIMITED).status_code == 200  # its burst of one
    resp = post(router, key=LIMITED)
    assert resp.status_code == 429 and error(resp)["code"] == "rate_limit_exceeded"
    assert resp.headers["x-request-id"] == "req-fast-1"


def test_body_and_parameter_errors_are_openai_4xx(router):
    resp = post(router, json={**COMPLETION, "prompt": "x" * 8000})
    assert resp.status_code == 413 and error(resp)["code"] == "body_too_large"
    resp = post(router, json=None, content=b"{not json")
    assert resp.status_code == 400 and error(resp)["code"] == "invalid_json"
    resp = post(router, "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400 and error(resp)["param"] == "model"
    resp = post(router, json={**COMPLETION, "model": "no-such-model"})
    assert resp.status_code == 404 and error(resp)["code"] == "model_not_found"


def test_other_methods_and_paths(router):
    resp = httpx.get(router.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 405 and resp.headers["allow"] == "POST" and error(resp)["message"]
    resp = post(router, "/v1/completions/")  # not a generate path: the FastAPI app's 404
    assert resp.status_code == 404 and error(resp)["code"] == "not_found"
    models = httpx.get(router.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    assert httpx.get(router.url + "/v1/models").status_code == 401  # FastAPI's dependency still guards the rest
