"""The `openai` SDK against a real `ragserve engine` process with a tiny Llama."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers.engine_server import LONG_CONTEXT, MODEL_NAME

CHAT = [{"role": "user", "content": "Name three colours."}]


def tokenize(sdk: openai.OpenAI, **body) -> dict:
    return httpx.post(str(sdk.base_url).removesuffix("v1/") + "tokenize", json=body).json()


def test_models_lists_the_served_name(sdk):
    models = sdk.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == 4096


def test_chat_completion(sdk):
    out = sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == MODEL_NAME
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == len(tokenize(sdk, messages=CHAT)["tokens"])
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_stream_matches_non_stream_with_usage(sdk):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_completion_tokens=12, temperature=0)
    full = sdk.chat.completions.create(**kwargs)
    chunks = list(sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_text_and_token_prompts_agree(sdk):
    prompt = "The capital of France is"
    by_text = sdk.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
    ids = tokenize(sdk, prompt=prompt)["tokens"]
    by_ids = sdk.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) == by_ids.usage.prompt_tokens


def test_completion_stream_equals_non_stream(sdk):
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=0)
    full = sdk.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in sdk.completions.create(**kwargs, stream=True)]
    assert "".join(pieces) == full


def test_n2_gives_two_choices(sdk):
    out = sdk.completions.create(model=MODEL_NAME, prompt="Tell me", max_tokens=6, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text != out.choices[1].text
    assert out.usage.completion_tokens == 12
    chunks = list(sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, n=2, seed=1, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_batched_prompts_index_choices_per_prompt(sdk):
    out = sdk.completions.create(model=MODEL_NAME, prompt=["Alpha", "Beta gamma"], max_tokens=3, n=2, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: both choices of a prompt agree
    single = sdk.completions.create(model=MODEL_NAME, prompt="Beta gamma", max_tokens=3, temperature=0)
    assert [c.text for c in out.choices if c.index == 2] == [single.choices[0].text]


def test_seed_is_reproducible(sdk):
    def sample(seed: int) -> str:
        out = sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=1.0, seed=seed)
        return out.choices[0].message.content

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_chat_logprobs(sdk):
    out = sdk.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy picks the top token
        assert bytes(entry.bytes) == entry.token.encode()


def test_completion_logprobs_and_echo(sdk):
    prompt = "Paged attention stores"
    out = sdk.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n_prompt] == len(prompt)
    plain = sdk.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert choice.text == prompt + plain.choices[0].text
    chunks = list(
        sdk.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_stop_string_and_stop_token(sdk):
    kwargs = dict(model=MODEL_NAME, prompt="Count: one two", max_tokens=12, temperature=0)
    free = sdk.completions.create(**kwargs).choices[0]
    words = free.text.split()
    assert len(words) >= 3
    stop = words[2]
    stopped = sdk.completions.create(**kwargs, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert free.text.startswith(stopped.text)
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(**kwargs, stop=[stop], stream=True))
    assert streamed == stopped.text
    ids = tokenize(sdk, prompt=free.text, add_special_tokens=False)
    by_token = sdk.completions.create(**kwargs, extra_body={"stop_token_ids": [ids["tokens"][1]]}).choices[0]
    assert by_token.finish_reason == "stop" and by_token.model_extra["stop_reason"] == ids["tokens"][1]


def test_ignore_eos_min_tokens_and_beam_search(sdk):
    out = sdk.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=7, temperature=0, extra_body={"ignore_eos": True, "min_tokens": 7}
    )
    assert out.usage.completion_tokens == 7
    beams = sdk.completions.create(
        model=MODEL_NAME, prompt="Hi there", max_tokens=4, n=2, temperature=0, extra_body={"use_beam_search": True}
    )
    assert len(beams.choices) == 2 and beams.choices[0].text != beams.choices[1].text


def test_repeated_long_prompt_reports_cached_tokens(sdk):
    system = f"[{uuid.uuid4()}] {LONG_CONTEXT}"  # no earlier test sent it: the first request has no hits
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}]
    first = sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0)
    second = sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 200
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16 > 0
    salted = sdk.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2, extra_body={"cache_salt": f"tenant-{uuid.uuid4()}"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another tenant never hits


def test_a_long_tokenize_leaves_the_event_loop_free(engine):
    """/tokenize of a long text runs on a worker thread: health probes sent one after another while the request is
    open keep being answered. On the event loop they stopped while the text was tokenized: one gap of most of the
    request's time (~1.3 s of ~2 s here; the rest is the body's upload and the 1.7M-token answer), where off it the
    longest gap is the answer's JSON, a small share. A ratio of the request's own time, so a slower machine scales
    both sides."""
    text = " ".join(f"word{i % 997} ragserve" for i in range(250_000))  # ~4M characters

    def tokenize_long() -> int:
        resp = httpx.post(engine.url + "/tokenize", json={"prompt": text}, timeout=60)
        assert resp.status_code == 200
        return resp.json()["count"]

    answered: list[float] = []
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=engine.url, timeout=60) as http:
        t0, job = time.monotonic(), pool.submit(tokenize_long)
        while not job.done():
            assert http.get("/health").status_code == 200
            answered.append(time.monotonic())
        assert job.result() > 1_000_000
        took = time.monotonic() - t0
    longest = max(b - a for a, b in zip([t0, *answered], answered, strict=False))
    assert longest < 0.4 * took, (longest, took)


def test_tokenize_detokenize_version(engine):
    ids = httpx.post(engine.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 4096
    text = httpx.post(engine.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "hello world"
    assert httpx.get(engine.url + "/version").json()["version"]
    assert httpx.get(engine.url + "/health").status_code == 200
