"""/metrics (vLLM names, parsed with prometheus_client) moves with requests; disconnects free KV blocks."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.helpers.engine_server import LONG_CONTEXT, MODEL_NAME, metric, running_engine, scrape
from tests.helpers.process import until

BLOCKS = 256
ANSWERS = "ragserve_engine_requests_total"  # every HTTP answer by final status (ragserve.http.outcomes)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine"), "--num-gpu-blocks", str(BLOCKS)) as proc:
        yield proc


def idle(engine) -> bool:
    s = scrape(engine.url)
    return metric(s, "vllm:num_requests_running") == 0 and metric(s, "vllm:kv_cache_usage_perc") == 0


@pytest.fixture
def fresh_engine(tmp_path):
    """An engine no other test has sent anything to, whatever order the tests run in."""
    with running_engine(tmp_path, "--num-gpu-blocks", str(BLOCKS)) as proc:
        yield proc


def test_cache_config_and_zeroed_counters(fresh_engine):
    s = scrape(fresh_engine.url)
    assert s[f"vllm:cache_config_info{{block_size=16,num_gpu_blocks={BLOCKS}}}"] == 1
    for name in ("vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total"):
        assert metric(s, name) == 0
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert metric(s, name) == 0
    assert metric(s, ANSWERS, code="200", reason="") == 0  # zero before the first answer, not absent
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "inter_token_latency"):
        assert metric(s, f"vllm:{name}_seconds_count") == 0


def test_counters_and_histograms_move_with_requests(sdk, engine):
    before = scrape(engine.url)
    system = f"[{uuid.uuid4()}] {LONG_CONTEXT}"  # no earlier test sent it: the first request has no hits
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Why?"}]
    first = sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0)
    second = sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0)
    after = scrape(engine.url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    prompt = first.usage.prompt_tokens + second.usage.prompt_tokens
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == 10
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:prefix_cache_queries_total") == prompt
    assert delta("vllm:prefix_cache_hits_total") == second.usage.prompt_tokens_details.cached_tokens > 0
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"vllm:{name}_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 8  # 4 gaps per 5-token request
    assert delta("vllm:time_to_first_token_seconds_sum") > 0
    assert delta(ANSWERS, code="200", reason="") == 2
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    # the system message is one long piece of the prompt: tokenized for the first request, cached for the second
    assert delta("ragserve:token_cache_pieces_total", result="miss") >= 1
    assert delta("ragserve:token_cache_pieces_total", result="hit") >= 1
    assert metric(after, "ragserve:token_cache_chars") >= len(system)


def test_stream_disconnect_aborts_and_frees_blocks(sdk, engine):
    before = scrape(engine.url)
    stream = sdk.completions.create(
        model=MODEL_NAME,
        prompt=LONG_CONTEXT,
        max_tokens=3000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    busy = scrape(engine.url)
    assert metric(busy, "vllm:num_requests_running") == 1
    assert metric(busy, "vllm:kv_cache_usage_perc") > 0
    stream.close()
    until(lambda: idle(engine), what="blocks freed after the client disconnected")
    after = scrape(engine.url)
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert 3 <= generated < 3000
    success = "vllm:request_success_total"
    assert metric(after, success, finished_reason="length") == metric(before, success, finished_reason="length")
    assert "finish=abort" in engine.output()
    left = f"{ANSWERS}{{code=499,model_name={MODEL_NAME},reason=client_closed}}"
    until(lambda: scrape(engine.url).get(left, 0) - before.get(left, 0) == 1, what="the 499 counted")


def test_non_stream_disconnect_aborts(engine):
    before = scrape(engine.url)
    body = {"prompt": LONG_CONTEXT, "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(engine.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    until(lambda: idle(engine), what="blocks freed after the client gave up")
    after = scrape(engine.url)
    generated = metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total")
    assert generated < 3000
    left = f"{ANSWERS}{{code=499,model_name={MODEL_NAME},reason=client_closed}}"
    until(lambda: scrape(engine.url).get(left, 0) - before.get(left, 0) == 1, what="the 499 counted")
    ok = sdk_free_request(engine)
    assert ok["usage"]["completion_tokens"] == 2


def sdk_free_request(engine) -> dict:
    return httpx.post(
        engine.url + "/v1/completions", json={"prompt": "still alive?", "max_tokens": 2}, timeout=30
    ).json()
