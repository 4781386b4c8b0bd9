"""In-batch prefix sharing (SGLang's): prompts arriving together with the same long prefix compute it once. The
first is prefilled; the others wait for its blocks and then hit them, instead of computing the same tokens in
the same steps. Outputs are unchanged, and the engine's queued prefill work counts the shared prefix once."""

from __future__ import annotations

import pytest

from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
DOC = list(range(100, 580))  # 480 tokens: 30 blocks of 16
PROMPTS = {"a": DOC + [901, 902, 903], "b": DOC + [911, 912], "c": DOC + [921, 922, 923, 924]}


@pytest.fixture(scope="module")
def model():
    return LLM(str(tiny_model("llama")), num_gpu_blocks=128, compile_at_start=False).engine.runner.model


def run_together(model, **flags) -> tuple[dict[str, int], dict[str, list[int]], int]:
    """All prompts added at once; per request the prompt tokens it got from cache, the outputs, and the
    queued prefill tokens the engine reported before its first step."""
    llm = LLM(str(tiny_model("llama")), loaded_model=model, num_gpu_blocks=128, max_num_batched_tokens=2048,
              compile_at_start=False, **flags)  # fmt: skip
    engine = llm.engine
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    queued = engine.scheduler.queued_prefill_tokens()
    cached, outputs = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached[out.request_id] = out.num_cached_tokens
            outputs[out.request_id] = out.outputs[0].token_ids
    return cached, outputs, queued


def test_prompts_arriving_together_compute_their_shared_prefix_once(model):
    cached, outputs, queued = run_together(model)
    assert cached["a"] == 0
    assert cached["b"] == cached["c"] == len(DOC)  # all 30 blocks of the document, computed by "a"
    assert queued == sum(len(p) for p in PROMPTS.values()) - 2 * len(DOC)
    _, alone, _ = run_together(model, enable_prefix_caching=False)  # nothing shared: each computes all
    assert outputs == alone


def test_capped_prefills_share_too(model):
    cached, _, _ = run_together(model, long_prefill_token_threshold=64)  # "a" takes 8 steps to compute DOC
    assert cached["b"] == cached["c"] == len(DOC)
