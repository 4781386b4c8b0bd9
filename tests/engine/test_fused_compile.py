"""torch.compile of the fused elementwise ops: used on prefill-sized steps, same greedy tokens as eager."""

from __future__ import annotations

from ragserve_engine.layers import fused
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [(i * 7919) % 40000 + 100 for i in range(fused.MIN_TOKENS + 40)]


def test_compiled_prefill_matches_eager(monkeypatch):
    monkeypatch.setattr(fused, "_compiled", {})
    path = str(tiny_model("llama"))
    eager = LLM(path, num_gpu_blocks=64, enforce_eager=True)
    want = eager.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    assert not fused.compile_enabled() and not fused._compiled
    compiled = LLM(path, num_gpu_blocks=64, loaded_model=eager.engine.runner.model, compile_at_start=False)
    got = compiled.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    assert fused.compile_enabled()
    assert set(fused._compiled) == {"rms_norm", "add_rms_norm", "rotate", "silu_and_mul"}
    assert got == want
