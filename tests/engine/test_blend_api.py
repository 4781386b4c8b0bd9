"""Chunks through the OpenAI API of a real engine process: the openai SDK's content parts + extra_body.

The tests share the module's engine: a test that needs documents the engine never saw brings its own."""

from __future__ import annotations

import json

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


def rag_messages(order: list[int], docs: list[str] = DOCS) -> list[dict]:
    parts = [{"type": "text", "text": "Documents:\n"}]
    for i in order:
        parts += [{"type": "text", "text": docs[i], "ragserve_chunk": True}, {"type": "text", "text": "\n"}]
    parts.append({"type": "text", "text": "Question: where do KV blocks live?"})
    return [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": parts}]


BLEND_METRICS = {
    "blend_reused_tokens": "ragserve:blend_reused_tokens_total",
    "blend_computed_chunk_tokens": "ragserve:blend_computed_chunk_tokens_total",
    "blend_recomputed_tokens": "ragserve:blend_recomputed_tokens_total",
}


def chat(sdk, order, fraction=None, docs=DOCS):
    extra = {} if fraction is None else {"blend_recompute_fraction": fraction}
    return sdk.chat.completions.create(
        model=MODEL_NAME, messages=rag_messages(order, docs), max_tokens=8, temperature=0, extra_body=extra
    )


def tokenizer():
    return load_tokenizer(resolve_model(str(tiny_model("llama"))))


def blend_usage(resp) -> dict[str, int]:
    details = resp.usage.prompt_tokens_details.model_extra
    assert set(details) == set(BLEND_METRICS), details
    assert sum(details.values()) == resp.usage.prompt_tokens  # each prompt token counted once
    return details


def test_fraction_one_answers_like_a_full_prefill_of_the_same_tokens(sdk):
    tokens = encode_chunked_chat(tokenizer(), rag_messages([2, 0, 1]))
    full = sdk.completions.create(model=MODEL_NAME, prompt=tokens.token_ids, max_tokens=8, temperature=0)
    blended = chat(sdk, [2, 0, 1], fraction=1.0)
    assert blended.choices[0].message.content == full.choices[0].text
    assert blended.usage.prompt_tokens == len(tokens.token_ids)
    assert blend_usage(blended)["blend_recomputed_tokens"] == len(tokens.token_ids)  # all computed at 1.0


def test_never_seen_documents_report_nothing_reused_then_are_reused(sdk, engine):
    docs = [
        f"Lighthouse {d} log. " + " ".join(f"Lamp {i} burns {i * 5 % 11} hours." for i in range(12)) for d in range(3)
    ]
    prompt = encode_chunked_chat(tokenizer(), rag_messages([0, 1, 2], docs))  # no other test sends these documents
    chunk_tokens = sum(b - a for a, b in prompt.spans)
    kept = chunk_tokens - -(-chunk_tokens * 15 // 100)  # the budget: ceil(15 % of the chunk tokens) recomputed
    before = scrape(engine.url)
    first = blend_usage(chat(sdk, [0, 1, 2], 0.15, docs))
    assert first == {"blend_reused_tokens": 0, "blend_computed_chunk_tokens": kept,
                     "blend_recomputed_tokens": len(prompt.token_ids) - kept}  # fmt: skip
    again = blend_usage(chat(sdk, [1, 2, 0], 0.15, docs))  # reordered: the same chunks, stored by the first
    assert again["blend_reused_tokens"] == kept and again["blend_computed_chunk_tokens"] == 0
    after = scrape(engine.url)
    for field, name in BLEND_METRICS.items():
        assert metric(after, name) - metric(before, name) == first[field] + again[field], name


def test_plain_chats_are_unchanged(sdk):
    plain = sdk.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    assert plain.usage.prompt_tokens_details.model_extra == {}
    assert plain.usage.prompt_tokens_details.cached_tokens is not None


def with_part(j: int, **part) -> list[dict]:
    """rag_messages([0]) with the user message's content part j changed."""
    messages = rag_messages([0])
    changed = messages[1]["content"][j] | part
    messages[1]["content"][j] = {k: v for k, v in changed.items() if v is not None}  # None: drop the key
    return messages


FRACTION = "blend_recompute_fraction"
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}, "text": None}


@pytest.mark.parametrize(
    ("extra", "messages", "param", "detail"),
    [
        ({FRACTION: 1.5}, rag_messages([0]), FRACTION, "must be in [0, 1], got 1.5"),
        ({FRACTION: "x"}, rag_messages([0]), FRACTION, "must be a number in [0, 1]"),
        ({FRACTION: True}, rag_messages([0]), FRACTION, "must be a number in [0, 1]"),
        ({}, with_part(1, ragserve_chunk="sometimes"), "messages.1.content.1.ragserve_chunk", "must be true or false"),
        ({}, with_part(2, ragserve_chunk=True, **IMAGE), "messages.1.content.2",
         "ragserve_chunk marks text parts only, this part's type is 'image_url'"),
        ({}, with_part(1, text="a \ue000 b"), "messages.1.content.1.text",
         "chunk text must not contain U+E000 or U+E001"),
    ],
)  # fmt: skip
def test_bad_blend_fields_are_400s_naming_the_field(engine, extra, messages, param, detail):
    r = httpx.post(engine.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, **extra})
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": {"message": f"{param}: {detail}", "type": "invalid_request_error", "param": param,
                  "code": "invalid_value"}
    }  # fmt: skip
    assert r.headers["x-ragserve-error-scope"] == "request"


def test_demo_chunks_context_is_blended(sdk):
    from ragserve.demo.client import rag_messages as demo_messages

    def ask(chunks):
        messages = demo_messages("notes", "", "Where do KV blocks live?", chunks)
        return sdk.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)

    ask([DOCS[0], DOCS[2]])
    reordered = ask([DOCS[2], DOCS[0]])
    assert blend_usage(reordered)["blend_reused_tokens"] > 0


CITED = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 16},
        "cited": {"type": "array", "items": {"enum": [0, 1, 2]}},
    },
    "required": ["answer", "cited"],
    "additionalProperties": False,
}


def test_json_schema_with_chunks_is_enforced_on_the_blended_prompt(sdk):
    """A grammar is per sequence in the sampler: blending changes how the prompt's KV is made, not decoding. At
    fraction 1.0 the constrained blended answer is the constrained answer to the same tokens."""
    fmt = {"type": "json_schema", "json_schema": {"name": "cited", "schema": CITED, "strict": True}}
    extra = {"blend_recompute_fraction": 1.0}
    blended = sdk.chat.completions.create(model=MODEL_NAME, messages=rag_messages([1, 2, 0]), max_tokens=64,
                                          temperature=0, response_format=fmt, extra_body=extra)  # fmt: skip
    assert blend_usage(blended)["blend_recomputed_tokens"] > 0  # it went the blend path
    choice = blended.choices[0]
    answer = json.loads(choice.message.content)
    assert choice.finish_reason == "stop" and set(answer) == {"answer", "cited"}, choice
    assert len(answer["answer"]) <= 16 and set(answer["cited"]) <= {0, 1, 2}
    tokens = encode_chunked_chat(tokenizer(), rag_messages([1, 2, 0])).token_ids
    full = sdk.completions.create(model=MODEL_NAME, prompt=tokens, max_tokens=64, temperature=0,
                                  extra_body={"guided_json": CITED})  # fmt: skip
    assert full.choices[0].text == choice.message.content
