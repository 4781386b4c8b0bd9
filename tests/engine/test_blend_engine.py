"""Blended prefills inside the engine: parity at fraction 1.0, reuse, accounting, isolation from plain prompts."""

from __future__ import annotations

import pytest

from ragserve_engine.blend.spec import BlendSpec
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DOCS = [[300 + i for i in range(40)], [900 + i for i in range(33)], [1500 + 3 * i for i in range(57)]]
SYSTEM, QUESTION = [7, 8, 9, 10, 11] * 4, [21, 22, 23, 24, 25, 26]


def rag_prompt(order: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    tokens, spans = list(SYSTEM), []
    for i in order:
        spans.append((len(tokens), len(tokens) + len(DOCS[i])))
        tokens += DOCS[i] + [4]
    return tokens + QUESTION, spans


def run(llm: LLM, requests: list[tuple[list[int], BlendSpec | None]]):
    """Submit all, step to completion, outputs in order (blend=None: a plain request)."""
    ids = []
    for i, (prompt, blend) in enumerate(requests):
        rid = f"r{len(llm.engine.requests)}-{i}-{id(prompt)}"
        llm.engine.add_request(rid, prompt, SamplingParams(**vars(GREEDY)), blend=blend)
        ids.append(rid)
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[r] for r in ids]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(tiny_model("llama")), num_gpu_blocks=256)


def test_fraction_one_equals_full_prefill_token_for_token(llm):
    orders = [[0, 1, 2], [2, 0, 1], [1, 2], [2]]
    prompts = [rag_prompt(o) for o in orders]
    plain = run(llm, [(p, None) for p, _ in prompts])
    blended = run(llm, [(p, BlendSpec(spans, 1.0)) for p, spans in prompts])
    for a, b in zip(plain, blended, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.num_blend_reused_tokens == 0
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_reordered_documents_reuse_stored_chunks_and_report_it(llm):
    blender = llm.engine.blender
    first, spans = rag_prompt([0, 1, 2])
    run(llm, [(first, BlendSpec(spans, 0.15))])
    misses, stats0 = blender.store.stats.misses, llm.engine.stats()
    again, spans2 = rag_prompt([2, 1, 0])
    (out,) = run(llm, [(again, BlendSpec(spans2, 0.15))])
    assert blender.store.stats.misses == misses  # every document came from the store
    chunk_tokens = sum(len(d) for d in DOCS)
    recomputed = -(-chunk_tokens * 15 // 100)
    assert out.num_blend_reused_tokens == chunk_tokens - recomputed
    stats = llm.engine.stats()
    assert stats.blend_reused_tokens - stats0.blend_reused_tokens == out.num_blend_reused_tokens
    assert stats.blend_recomputed_tokens - stats0.blend_recomputed_tokens == len(again) - out.num_blend_reused_tokens
    assert len(out.outputs[0].token_ids) == 12


def test_blended_kv_is_never_a_prefix_hit_for_plain_prompts(llm):
    prompt, spans = rag_prompt([1, 0])
    prompt, spans = [99] + prompt, [(a + 1, b + 1) for a, b in spans]  # no earlier test used this prefix
    run(llm, [(prompt, BlendSpec(spans, 0.0))])
    (plain,) = run(llm, [(prompt, None)])
    assert plain.num_cached_tokens == 0  # the blended (approximate) blocks live under another salt
    (plain_again,) = run(llm, [(prompt, None)])
    assert plain_again.num_cached_tokens > 0


def test_plain_batch_mates_are_unaffected(llm):
    prompt, spans = rag_prompt([2, 1])
    other = [40 + i for i in range(70)]
    (solo,) = run(llm, [(other, None)])
    mixed = run(llm, [(prompt, BlendSpec(spans, 0.05)), (other, None), (prompt, None)])
    assert mixed[1].outputs[0].token_ids == solo.outputs[0].token_ids
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


@pytest.mark.parametrize(
    ("spans", "fraction", "message"),
    [([(5, 3)], None, "chunk span"), ([(0, 10), (5, 20)], None, "chunk span"), ([(0, 999)], None, "chunk span"),
     ([(0, 10)], 1.5, "fraction")],
)  # fmt: skip
def test_bad_specs_are_refused(llm, spans, fraction, message):
    prompt, _ = rag_prompt([0])
    with pytest.raises(ValueError, match=message):
        llm.engine.make_request("bad", prompt, SamplingParams(), blend=BlendSpec(spans, fraction))


def test_smollm2_fraction_one_parity_and_default_reuse():
    """The real model: a chunked RAG chat blended at 1.0 gives the full prefill's greedy tokens."""
    from ragserve.chunks import encode_chunked_chat
    from ragserve.demo.corpus import load_corpus

    smol = LLM("smollm2-135m", num_gpu_blocks=512, enforce_eager=True)
    passages = [p.text for d in load_corpus()[:3] for p in d.passages[:1]]
    parts = [{"type": "text", "text": "Documents:\n"}]
    for text in passages:
        parts += [{"type": "text", "text": text, "ragserve_chunk": True}, {"type": "text", "text": "\n\n"}]
    parts.append({"type": "text", "text": "Question: what do these documents describe?"})
    chat = [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": parts}]
    prompt = encode_chunked_chat(smol.tokenizer, chat)
    assert len(prompt.spans) == 3 and len(prompt.token_ids) > 300
    (plain,) = run(smol, [(prompt.token_ids, None)])
    (blended,) = run(smol, [(prompt.token_ids, BlendSpec(prompt.spans, 1.0))])
    assert blended.outputs[0].token_ids == plain.outputs[0].token_ids
    (default,) = run(smol, [(prompt.token_ids, BlendSpec(prompt.spans))])  # engine default fraction, chunks stored
    assert default.num_blend_reused_tokens > 0.8 * sum(b - a for a, b in prompt.spans)
