"""/v1/rerank and /v1/score on a generation engine (SmolLM2-135M, the shared smollm2_engine): each score is the
model's p(yes) / (p(yes) + p(no)) after the fixed relevance prompt, equal to that computed here with plain
transformers on the same weights and chat template; rerank orders by it; score's
pairwise and one-to-many shapes; top_n, return_documents; bad inputs are 400s naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from ragserve.model_source import resolve_model
from tests.helpers.openai_errors import assert_400

SYSTEM = 'Judge whether the Document is relevant to the Query. Answer only "yes" or "no".'
QUERY = "What is the capital of France?"
DOCS = ["Bananas are rich in potassium.", "Paris is the capital of France.", "The stock market fell on Tuesday."]


@pytest.fixture(scope="module")
def hf_relevance(smollm2_engine):
    """p(yes) / (p(yes) + p(no)) by plain transformers (the GGUF dequantized, fp32) on the prompt the engine's
    /tokenize renders with the chat template."""
    source = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                 dtype=torch.float32).eval()  # fmt: skip
    yes, no = (post(smollm2_engine, "/tokenize", {"prompt": w, "add_special_tokens": False}).json()["tokens"][0]
               for w in ("yes", "no"))  # fmt: skip

    def score(query: str, doc: str) -> float:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Query: {query}\nDocument: {doc}"},
        ]
        ids = post(smollm2_engine, "/tokenize", {"messages": messages}).json()["tokens"]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
        return float(logits[[yes, no]].softmax(-1)[0])

    return score


def post(engine, path: str, body: dict) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=120)


def test_rerank_scores_are_the_models_relevance_probability(smollm2_engine, hf_relevance):
    resp = post(smollm2_engine, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    for r in results:
        assert abs(r["relevance_score"] - hf_relevance(QUERY, DOCS[r["index"]])) < 1e-3
    assert all(r["document"] == {"text": DOCS[r["index"]]} for r in results)
    top = post(smollm2_engine, "/v2/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1, "return_documents": False})
    assert [set(r) for r in top.json()["results"]] == [{"index", "relevance_score"}]
    assert top.json()["results"][0]["index"] == results[0]["index"]


def test_score_pairwise_and_one_to_many(smollm2_engine, hf_relevance):
    many = post(smollm2_engine, "/v1/score", {"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in many["data"]] == [0, 1, 2] and many["usage"]["prompt_tokens"] > 0
    for d in many["data"]:
        assert abs(d["score"] - hf_relevance(QUERY, DOCS[d["index"]])) < 1e-3
    queries = ["Which fruit has potassium?", QUERY]
    pairs = post(smollm2_engine, "/score", {"text_1": queries, "text_2": DOCS[:2]}).json()["data"]
    assert len(pairs) == 2
    for d in pairs:
        assert abs(d["score"] - hf_relevance(queries[d["index"]], DOCS[d["index"]])) < 1e-3


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["word " * 2000]}, "documents"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": [""]}, "text_2"),
    ],
)
def test_bad_inputs_are_400s_naming_the_field(smollm2_engine, path, body, param):
    assert_400(post(smollm2_engine, path, body), param)
