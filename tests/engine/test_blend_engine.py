"""Blended prefills inside the engine: parity at fraction 1.0, reuse, accounting, isolation from plain prompts.

Tests share one engine (module scope): a test that needs documents no earlier test stored makes its own."""

from __future__ import annotations

import pytest

from ragserve_engine.blend.spec import BlendSpec, BlendUsage
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DOCS = [[300 + i for i in range(40)], [900 + i for i in range(33)], [1500 + 3 * i for i in range(57)]]
SYSTEM, QUESTION = [7, 8, 9, 10, 11] * 4, [21, 22, 23, 24, 25, 26]


def rag_prompt(order: list[int], docs: list[list[int]] = DOCS) -> tuple[list[int], list[tuple[int, int]]]:
    tokens, spans = list(SYSTEM), []
    for i in order:
        spans.append((len(tokens), len(tokens) + len(docs[i])))
        tokens += docs[i] + [4]
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


def num_kept(spans: list[tuple[int, int]], fraction: float) -> int:
    """Chunk tokens a blended prefill keeps at this fraction (the rest of the prompt is recomputed)."""
    chunk_tokens = sum(b - a for a, b in spans)
    return chunk_tokens - -(-chunk_tokens * round(fraction * 100) // 100)


def usage_delta(after, before) -> BlendUsage:
    """The engine's blend counters (EngineStats) moved between two snapshots."""
    fields = ("reused_tokens", "computed_chunk_tokens", "recomputed_tokens")
    return BlendUsage(*(getattr(after, f"blend_{f}") - getattr(before, f"blend_{f}") for f in fields))


@pytest.fixture(scope="module")
def llm():
    return LLM(str(tiny_model("llama")), num_gpu_blocks=256, enforce_eager=True)


def test_fraction_one_equals_full_prefill_token_for_token(llm):
    orders = [[0, 1, 2], [2, 0, 1], [1, 2], [2]]
    prompts = [rag_prompt(o) for o in orders]
    plain = run(llm, [(p, None) for p, _ in prompts])
    blended = run(llm, [(p, BlendSpec(spans, 1.0)) for p, spans in prompts])
    for (prompt, _), a, b in zip(prompts, plain, blended, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert a.blend_usage is None and b.blend_usage == BlendUsage(0, 0, len(prompt))  # every token computed
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_reordered_documents_reuse_stored_chunks_and_report_it(llm):
    blender = llm.engine.blender
    first, spans = rag_prompt([0, 1, 2])
    run(llm, [(first, BlendSpec(spans, 0.15))])
    misses, stats0 = blender.store.stats.misses, llm.engine.stats()
    again, spans2 = rag_prompt([2, 1, 0])
    (out,) = run(llm, [(again, BlendSpec(spans2, 0.15))])
    assert blender.store.stats.misses == misses  # every document came from the store
    kept = num_kept(spans2, 0.15)
    assert out.blend_usage == BlendUsage(kept, 0, len(again) - kept)
    assert usage_delta(llm.engine.stats(), stats0) == out.blend_usage
    assert len(out.outputs[0].token_ids) == 12


def test_never_seen_documents_are_computed_not_reused(llm):
    """A request whose documents no request stored reports nothing reused, also for a document it holds twice;
    the same documents again are reused."""
    cold = [[3000 + i for i in range(37)], [3500 + 2 * i for i in range(29)]]  # no other test uses these
    prompt, spans = rag_prompt([0, 1, 0], cold)
    kept = num_kept(spans, 0.15)
    stats0 = llm.engine.stats()
    (first,) = run(llm, [(prompt, BlendSpec(spans, 0.15))])
    assert first.blend_usage == BlendUsage(0, kept, len(prompt) - kept)
    stats1 = llm.engine.stats()
    assert usage_delta(stats1, stats0) == first.blend_usage
    (again,) = run(llm, [(prompt, BlendSpec(spans, 0.15))])
    assert again.blend_usage == BlendUsage(kept, 0, len(prompt) - kept)
    assert usage_delta(llm.engine.stats(), stats1) == again.blend_usage


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
