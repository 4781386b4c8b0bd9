"""Migration contract, engine side: `return_token_ids` and `resume_token_ids` on a real engine process.

A stream cut after any chunk and resumed from the token ids it carried continues exactly like the
uninterrupted run: same remaining tokens, the client's text joins without a seam (also when a stop
string spans the cut), usage counts the original prompt and the new tokens only. And its disaggregated
sibling `first_token_id`: an answer started from a given first token is the whole uninterrupted answer.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.engine_server import MODEL_NAME, running_engine

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"
CHAT = [{"role": "user", "content": "Tell me about foxes and dogs."}]
N = 24


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine"), "--num-gpu-blocks", "128", "--max-model-len", "256") as p:
        yield p


def stream(engine, path: str, body: dict) -> tuple[list[tuple[str, list[int], str | None]], dict]:
    """(text delta, token ids, finish reason) per chunk, and the usage chunk."""
    body = {"model": MODEL_NAME, "stream": True, "return_token_ids": True, **body}
    body["stream_options"] = {"include_usage": True}
    chunks, usage = [], {}
    with httpx.stream("POST", engine.url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for data in map(json.loads, lines[:-1]):
        usage = data.get("usage") or usage
        for c in data["choices"]:
            text = c["text"] if "text" in c else c["delta"].get("content", "")
            chunks.append((text, c["token_ids"], c["finish_reason"]))
    return chunks, usage


def resume_everywhere(engine, path: str, body: dict) -> int:
    """Cut the uninterrupted stream after every chunk and resume it; returns the cuts checked."""
    full, full_usage = stream(engine, path, body)
    text = "".join(t for t, _, _ in full)
    ids = [i for _, chunk_ids, _ in full for i in chunk_ids]
    cuts = 0
    for cut in range(1, len(full)):
        sent = "".join(t for t, _, _ in full[:cut])
        done = [i for _, chunk_ids, _ in full[:cut] for i in chunk_ids]
        if not done or len(done) == len(ids):
            continue
        remaining = {"max_tokens": body["max_tokens"] - len(done), "resume_token_ids": done}
        if "min_tokens" in body:  # the router sends what remains of both budgets
            remaining["min_tokens"] = max(0, body["min_tokens"] - len(done))
        rest, usage = stream(engine, path, {**body, **remaining})
        assert done + [i for _, chunk_ids, _ in rest for i in chunk_ids] == ids, cut
        assert sent + "".join(t for t, _, _ in rest) == text, cut
        assert rest[-1][2] == full[-1][2]
        assert usage["prompt_tokens"] == full_usage["prompt_tokens"]
        assert usage["completion_tokens"] == len(ids) - len(done)
        cuts += 1
    return cuts


def test_greedy_completion_resumes_after_any_chunk(engine):
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    assert resume_everywhere(engine, "/v1/completions", body) >= N - 2


def test_greedy_chat_resumes_without_a_second_role_chunk(engine):
    body = {"messages": CHAT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    assert resume_everywhere(engine, "/v1/chat/completions", body) >= N - 2
    first, _ = stream(engine, "/v1/chat/completions", {**body, "max_tokens": 4, "resume_token_ids": [42]})
    assert first[0][1], "a resumed chat stream starts with tokens, not a role chunk"


def test_seeded_sampling_resumes_too(engine):
    """The sampler draws one Exp(1) row per token from the request's generator: resume fast-forwards it."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "seed": 1234, "ignore_eos": True}
    assert resume_everywhere(engine, "/v1/completions", body) >= 10


def test_min_tokens_count_the_new_tokens_only(engine):
    """A stop token blocked by min_tokens stays blocked after a resume exactly as long as without it."""
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    full, _ = stream(engine, "/v1/completions", body)
    ids = [i for _, chunk_ids, _ in full for i in chunk_ids]
    stopped = {**body, "stop_token_ids": [ids[2]], "min_tokens": 10}
    whole, _ = stream(engine, "/v1/completions", stopped)
    assert len([i for _, chunk_ids, _ in whole for i in chunk_ids]) >= 10
    assert resume_everywhere(engine, "/v1/completions", stopped) >= 8


def test_stop_string_across_the_seam(engine):
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    full, _ = stream(engine, "/v1/completions", body)
    text = "".join(t for t, _, _ in full)
    seams = []
    for k in range(2, len(full) - 2):
        b = len("".join(t for t, _, _ in full[:k]))
        stop = text[b - 2 : b + 3]
        if len(stop) == 5 and text.find(stop) == b - 2:
            seams.append(stop)
    assert seams, text
    checked = 0
    for stop in seams[:3]:
        stopped = {**body, "stop": [stop]}
        checked += resume_everywhere(engine, "/v1/completions", stopped)
        whole, _ = stream(engine, "/v1/completions", stopped)
        assert whole[-1][2] == "stop" and stop not in "".join(t for t, _, _ in whole)
    assert checked


def test_non_stream_carries_all_token_ids_and_resumes(engine):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    full = httpx.post(engine.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=60).json()
    ids = full["choices"][0]["token_ids"]
    assert len(ids) == N == full["usage"]["completion_tokens"]
    plain = httpx.post(engine.url + "/v1/completions", json=body, timeout=60).json()
    assert "token_ids" not in plain["choices"][0]
    rest = httpx.post(
        engine.url + "/v1/completions",
        json={**body, "max_tokens": N - 5, "resume_token_ids": ids[:5], "return_token_ids": True},
        timeout=60,
    ).json()
    assert rest["choices"][0]["token_ids"] == ids[5:]
    assert rest["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert rest["usage"]["completion_tokens"] == N - 5


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"resume_token_ids": [10**9]}, "resume_token_ids"),
        ({"resume_token_ids": [1], "n": 2}, "resume_token_ids"),
        ({"resume_token_ids": [1], "prompt": ["a", "b"]}, "resume_token_ids"),
        ({"resume_token_ids": [1] * 250}, "max_model_len"),
    ],
)
def test_bad_resume_is_400(engine, extra, fragment):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, **extra}
    resp = httpx.post(engine.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and fragment in resp.text, resp.text
    assert resp.headers["x-ragserve-error-scope"] == "request"


@pytest.mark.slow
def test_smollm2_greedy_chat_resumes_after_any_chunk(tmp_path):
    args = ["--model", "smollm2-135m", "--num-gpu-blocks", "64", "--max-model-len", "256"]
    with running_engine(tmp_path, *args) as smol:
        body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert resume_everywhere(smol, "/v1/chat/completions", body) >= 10


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_first_token_id_starts_the_answer(engine, path, sampling):
    """Started from a first token (as a decode engine is, from the prefill leg's), the answer is that token, output
    and counted, sent before the engine's first step, then what the engine generates after it: its own first token
    gives the uninterrupted answer, another one the answer resumed after that token."""
    prompt = {"prompt": PROMPT} if "chat" not in path else {"messages": CHAT}
    body = {**prompt, "max_tokens": N, "ignore_eos": True, **sampling}
    full, full_usage = stream(engine, path, body)
    ids = [i for _, chunk_ids, _ in full for i in chunk_ids]
    started, usage = stream(engine, path, {**body, "first_token_id": ids[0]})
    assert [i for _, chunk_ids, _ in started for i in chunk_ids] == ids
    # the given token goes out at once, in a chunk of its own (the engine's first step then gives the second)
    assert next(chunk_ids for _, chunk_ids, _ in started if chunk_ids) == ids[:1]
    assert "".join(t for t, _, _ in started) == "".join(t for t, _, _ in full)
    tokens = ("prompt_tokens", "completion_tokens")
    assert [usage[k] for k in tokens] == [full_usage[k] for k in tokens]  # the first token counted
    other = (ids[0] + 1) % 100 + 1
    started, usage = stream(engine, path, {**body, "first_token_id": other})
    after, _ = stream(engine, path, {**body, "max_tokens": N - 1, "resume_token_ids": [other]})
    assert [i for _, chunk_ids, _ in started for i in chunk_ids] == [other] + [i for _, c, _ in after for i in c]
    assert usage["completion_tokens"] == N


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"first_token_id": 10**9}, "first_token_id"),
        ({"first_token_id": 1, "n": 2}, "n=1"),
        ({"first_token_id": 1, "logprobs": 1}, "logprobs"),
        ({"first_token_id": 1, "max_tokens": 1}, "at least 2"),
        ({"first_token_id": 1, "resume_token_ids": [2]}, "cannot be combined"),
        ({"first_token_id": 1, "prompt": ["a", "b"]}, "single prompt"),
    ],
)
def test_bad_first_token_id_is_400(engine, extra, fragment):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, **extra}
    resp = httpx.post(engine.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and fragment in resp.text, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"
