"""Chunks through the OpenAI API of a real engine process: the openai SDK's content parts + extra_body."""

from __future__ import annotations

import httpx
import pytest

from ragserve.chunks import encode_chunked_chat
from ragserve.model_source import load_tokenizer, resolve_model
from tests.helpers.engine_server import MODEL_NAME, metric, scrape
from tests.helpers.tiny_models import tiny_model

DOCS = [
    "PagedAttention stores each sequence's KV cache in fixed-size blocks that need not be contiguous. " * 3,
    "The router hashes full blocks of the prompt and sends a request to the engine holding most of them. " * 3,
    "A cachestore keeps KV blocks in RAM, then on disk, then in Redis, keyed by layout and block hash. " * 3,
]


def rag_messages(order: list[int]) -> list[dict]:
    parts = [{"type": "text", "text": "Documents:\n"}]
    for i in order:
        parts += [{"type": "text", "text": DOCS[i], "ragserve_chunk": True}, {"type": "text", "text": "\n"}]
    parts.append({"type": "text", "text": "Question: where do KV blocks live?"})
    return [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": parts}]


def chat(sdk, order, fraction=None, **kw):
    extra = {} if fraction is None else {"blend_recompute_fraction": fraction}
    return sdk.chat.completions.create(
        model=MODEL_NAME, messages=rag_messages(order), max_tokens=8, temperature=0, extra_body=extra, **kw
    )


def test_fraction_one_answers_like_a_full_prefill_of_the_same_tokens(sdk):
    tokens = encode_chunked_chat(load_tokenizer(resolve_model(str(tiny_model("llama")))), rag_messages([2, 0, 1]))
    full = sdk.completions.create(model=MODEL_NAME, prompt=tokens.token_ids, max_tokens=8, temperature=0)
    blended = chat(sdk, [2, 0, 1], fraction=1.0)
    assert blended.choices[0].message.content == full.choices[0].text
    assert blended.usage.prompt_tokens == len(tokens.token_ids)
    assert "blend_reused_tokens" not in blended.usage.prompt_tokens_details.model_extra  # nothing reused at 1.0


def test_reordered_documents_are_reused_and_counted(sdk, engine):
    before = scrape(engine.url)
    chat(sdk, [0, 1, 2])  # stores the three chunks
    again = chat(sdk, [1, 2, 0], fraction=0.15)
    reused = again.usage.prompt_tokens_details.model_extra["blend_reused_tokens"]
    assert 0 < reused < again.usage.prompt_tokens
    after = scrape(engine.url)
    delta = {n: metric(after, n) - metric(before, n) for n in ("ragserve:blend_reused_tokens_total",
                                                            "ragserve:blend_recomputed_tokens_total")}  # fmt: skip
    assert delta["ragserve:blend_reused_tokens_total"] >= reused
    total_prompt = 2 * again.usage.prompt_tokens
    assert sum(delta.values()) == total_prompt  # every prompt token of both requests: reused or recomputed


def test_plain_chats_are_unchanged(sdk):
    plain = sdk.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    assert plain.usage.prompt_tokens_details.model_extra == {}
    assert plain.usage.prompt_tokens_details.cached_tokens is not None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"blend_recompute_fraction": 1.5}, "blend_recompute_fraction"),
        ({"blend_recompute_fraction": "x"}, "blend_recompute_fraction"),
    ],
)
def test_bad_blend_fields_are_400_naming_the_field(engine, body, field):
    r = httpx.post(
        engine.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": rag_messages([0]), **body}
    )
    assert r.status_code == 400, r.text
    assert field in r.text
    assert r.headers["x-ragserve-error-scope"] == "request"


def test_bad_chunk_marker_is_400(engine):
    messages = rag_messages([0])
    messages[1]["content"][1]["ragserve_chunk"] = "sometimes"
    r = httpx.post(engine.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages})
    assert r.status_code == 400, r.text
    assert "ragserve_chunk" in r.text


def test_demo_chunks_context_is_blended(sdk):
    from ragserve.demo.client import rag_messages as demo_messages

    def ask(chunks):
        messages = demo_messages("notes", "", "Where do KV blocks live?", chunks)
        return sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)

    ask([DOCS[0], DOCS[2]])
    reordered = ask([DOCS[2], DOCS[0]])
    assert reordered.usage.prompt_tokens_details.model_extra["blend_reused_tokens"] > 0
