"""Greedy output equals Hugging Face transformers token for token, under every scheduling regime."""

from __future__ import annotations

import pytest
import torch

from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.parity import TEXTS, assert_parity, reference_greedy
from tests.helpers.tiny_models import tiny_model

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _regimes(path: str, base: LLM, prompts: list[list[int]]):
    """(label, LLM) pairs sharing the loaded weights: each must reproduce the reference."""
    need = [-(-(len(p) + MAX_NEW) // 16) for p in prompts]
    tiny_pool = max(need) + 2  # fits one sequence at a time: forces preemption
    assert tiny_pool < sum(need)
    shared = dict(loaded_model=base.engine.runner.model)
    yield "no-prefix-caching", LLM(path, enable_prefix_caching=False, num_gpu_blocks=512, **shared)
    yield "chunked-prefill-7", LLM(path, max_num_batched_tokens=7, num_gpu_blocks=512, **shared)
    yield "preempt-recompute", LLM(path, num_gpu_blocks=tiny_pool, preemption_mode="recompute", **shared)
    yield "preempt-swap", LLM(path, num_gpu_blocks=tiny_pool, preemption_mode="swap", swap_space=0.5, **shared)


def run_parity(path: str, hf_model, prompts: list[list[int]]) -> None:
    refs = [reference_greedy(hf_model, p, MAX_NEW) for p in prompts]
    base = LLM(path, num_gpu_blocks=512)
    outs = base.generate(prompts, GREEDY)
    for p, o, r in zip(prompts, outs, refs, strict=True):
        assert_parity(hf_model, p, o.outputs[0].token_ids, r, "prefix-caching-cold")
    # second pass: every full prompt block except the last token's is a hit, outputs unchanged
    again = base.generate(prompts, GREEDY)
    for p, o, first in zip(prompts, again, outs, strict=True):
        assert o.outputs[0].token_ids == first.outputs[0].token_ids
        assert o.num_cached_tokens == (len(p) - 1) // 16 * 16
    assert base.engine.kv.stats.hits > 0
    for label, llm in _regimes(path, base, prompts):
        outs = llm.generate(prompts, GREEDY)
        for o, first in zip(outs, again, strict=True):
            assert o.outputs[0].token_ids == first.outputs[0].token_ids, label
        if label.startswith("preempt"):
            assert llm.engine.scheduler.num_preemptions > 0, label
        assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks, label


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_model_parity(arch):
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm_tok = LLM(str(path), num_gpu_blocks=64).tokenizer
    prompts = [llm_tok.encode(t) for t in TEXTS]
    assert len(prompts) >= 8 and len({len(p) for p in prompts}) >= 6
    run_parity(str(path), hf, prompts)


def test_sharded_checkpoint_loads_identically():
    single = LLM(str(tiny_model("llama")), num_gpu_blocks=64)
    sharded = LLM(str(tiny_model("llama", sharded=True)), num_gpu_blocks=64)
    prompts = [single.tokenizer.encode(t) for t in TEXTS[:3]]
    a = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
    b = [o.outputs[0].token_ids for o in sharded.generate(prompts, GREEDY)]
    assert a == b


@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~2-5 minutes on 2 idle cores; much longer on a loaded machine
def test_smollm2_gguf_parity():
    """The real SmolLM2-135M GGUF, dequantized by both sides; chat prompts through the chat template."""
    from transformers import AutoModelForCausalLM

    from ragserve.model_source import resolve_model

    source = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                              dtype=torch.float32).eval()  # fmt: skip
    tok = LLM("smollm2-135m", num_gpu_blocks=8).tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]
    run_parity("smollm2-135m", hf, prompts)
