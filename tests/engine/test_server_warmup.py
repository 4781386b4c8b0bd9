"""Knowledge warm-up: prefilled prefixes hit on the next request; pinned ones survive cache pressure.

The engine here has a small KV cache (40 blocks), which also makes preemption observable.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ragserve.keys import block_hashes, root_hash
from ragserve.model_source import model_fingerprint, resolve_model
from tests.helpers.engine_server import MODEL_NAME, metric, running_engine, scrape
from tests.helpers.process import until
from tests.helpers.tiny_models import tiny_model

BLOCKS = 40
DOC_A = "Alpha handbook: the cluster routes each request to the engine that already holds its context. " * 4
DOC_B = "Beta handbook: evicted blocks are recomputed, offloaded blocks are fetched from the cachestore. " * 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine"), "--num-gpu-blocks", str(BLOCKS)) as proc:
        yield proc


def warm(engine, status: int = 200, **body) -> dict:
    resp = httpx.post(engine.url + "/v1/warmup", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    return resp.json()


def cached_tokens(engine, prompt: str) -> int:
    resp = httpx.post(engine.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def pressure(engine, rounds: int = 3) -> None:
    """Distinct 400-token prompts: each needs 26 of the 40 blocks, so unpinned cached blocks get evicted."""
    for r in range(rounds):
        ids = [2000 + r * 1000 + j for j in range(400)]
        resp = httpx.post(engine.url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}, timeout=60)
        assert resp.status_code == 200, resp.text


def test_warmed_text_hits_with_the_shared_key_scheme(engine):
    out = warm(engine, texts=[DOC_A])
    item = out["items"][0]
    assert out["id"].startswith("warmup-") and out["pinned"] is False
    tokens = httpx.post(engine.url + "/tokenize", json={"prompt": DOC_A}).json()["tokens"]
    assert item["num_tokens"] == len(tokens) and item["num_blocks"] == len(tokens) // 16 > 0
    root = root_hash(model_fingerprint(resolve_model(str(tiny_model("llama")), MODEL_NAME)))
    assert item["block_hashes"] == [h.hex() for h in block_hashes(tokens, 16, root)]
    assert cached_tokens(engine, DOC_A + " Question: who routes?") == item["num_blocks"] * 16
    again = warm(engine, texts=[DOC_A])
    assert again["items"][0]["num_cached_tokens"] == (len(tokens) - 1) // 16 * 16


def test_warmed_chat_prefix_hits_a_longer_chat(engine):
    system = [{"role": "system", "content": DOC_B}]
    item = warm(engine, messages=[system])["items"][0]
    chat = {"messages": [*system, {"role": "user", "content": "What happens to evicted blocks?"}], "max_tokens": 1}
    usage = httpx.post(engine.url + "/v1/chat/completions", json=chat, timeout=60).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == item["num_blocks"] * 16 > 0


def test_pinned_blocks_survive_cache_pressure_until_unpinned(engine):
    pinned = warm(engine, texts=[DOC_A], pin=True)
    warm(engine, texts=[DOC_B])
    n_pinned = pinned["items"][0]["num_pinned_blocks"]
    assert n_pinned == pinned["items"][0]["num_blocks"] > 0
    assert httpx.get(engine.url + "/v1/warmup").json()["data"] == [{"id": pinned["id"], "num_pinned_blocks": n_pinned}]
    pressure(engine)
    assert metric(scrape(engine.url), "vllm:kv_cache_usage_perc") == pytest.approx(n_pinned / BLOCKS)
    assert cached_tokens(engine, DOC_A + " Question: still there?") == n_pinned * 16
    assert cached_tokens(engine, DOC_B + " Question: still there?") == 0  # the unpinned one was evicted

    resp = httpx.delete(engine.url + f"/v1/warmup/{pinned['id']}")
    assert resp.status_code == 200 and resp.json()["num_unpinned_blocks"] == n_pinned
    assert httpx.delete(engine.url + f"/v1/warmup/{pinned['id']}").status_code == 404
    until(lambda: metric(scrape(engine.url), "vllm:kv_cache_usage_perc") == 0, what="unpinned blocks freed")
    pressure(engine)
    assert cached_tokens(engine, DOC_A + " Question: and now?") == 0


def test_pinning_is_bounded_and_inputs_validated(engine):
    many = [f"Document {i}: " + "lorem ipsum dolor sit amet " * 20 for i in range(4)]
    out = warm(engine, 400, texts=many, pin=True)
    assert out["error"]["code"] == "too_many_pinned_blocks"
    assert warm(engine, 400, texts=["a"], messages=[[{"role": "user", "content": "b"}]])["error"]["message"]
    assert warm(engine, 400, texts=[])["error"]["type"] == "invalid_request_error"
    assert "tokens" in warm(engine, 400, texts=["word " * 5000])["error"]["message"]
    assert warm(engine, 404, texts=["a"], model="other")["error"]["code"] == "model_not_found"
    assert httpx.get(engine.url + "/v1/warmup").json()["data"] == []


def test_preemptions_are_counted_and_requests_still_finish(engine):
    before = metric(scrape(engine.url), "vllm:num_preemptions_total")

    def run(k: int) -> dict:
        body = {"prompt": [5000 + k * 300 + j for j in range(100)], "max_tokens": 300, "ignore_eos": True}
        return httpx.post(engine.url + "/v1/completions", json=body, timeout=300).json()

    with ThreadPoolExecutor(3) as pool:  # 3 x 25 blocks at the end > 40 blocks
        results = list(pool.map(run, range(3)))
    assert [r["usage"]["completion_tokens"] for r in results] == [300, 300, 300]
    assert metric(scrape(engine.url), "vllm:num_preemptions_total") > before
