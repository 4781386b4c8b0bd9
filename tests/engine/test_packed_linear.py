"""oneDNN-prepacked linears: the same products as nn.Linear, used unless --enforce-eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ragserve_engine.layers.packed_linear import PackedLinear, can_pack
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.engine.test_weight_quant import _logits
from tests.helpers.tiny_models import tiny_model


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_linear_equals_linear_at_any_batch(dtype, tol):
    """Where this CPU's oneDNN packs the dtype (bf16 needs AVX-512 or AVX-NE-CONVERT), the products equal
    nn.Linear's; where it does not, can_pack says so and an engine in that dtype keeps plain linears."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=True).to(dtype)
    if not can_pack(torch.device("cpu"), dtype):
        with pytest.raises(RuntimeError):
            PackedLinear(linear)
        dtype_name = str(dtype).removeprefix("torch.")
        llm = LLM(str(tiny_model("llama")), num_gpu_blocks=16, dtype=dtype_name, compile_at_start=False)
        model = llm.engine.runner.model
        assert not [m for m in model.modules() if isinstance(m, PackedLinear)] and isinstance(model.lm_head, nn.Linear)
        out = llm.generate([[300, 301, 302]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        return
    packed = PackedLinear(linear)
    assert not hasattr(packed, "weight") and packed.packed.numel() == linear.weight.numel()
    for shape in [(1, 96), (7, 96), (32, 96), (300, 96), (4, 3, 96)]:
        x = torch.randn(shape).to(dtype)
        with torch.inference_mode():
            out, ref = packed(x), linear(x)
        assert out.shape == ref.shape and out.dtype == dtype
        assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max(), shape


def test_engine_packs_unless_enforce_eager():
    """Every projection and the LM head are packed; the tied embedding keeps its plain table; outputs
    are those of the eager engine."""
    path = str(tiny_model("llama"))
    packed, eager = LLM(path, num_gpu_blocks=64), LLM(path, num_gpu_blocks=64, enforce_eager=True)
    model = packed.engine.runner.model
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    assert model.embed_tokens.weight.shape == (model.config.vocab_size, model.config.hidden_size)
    plain = eager.engine.runner.model
    assert isinstance(plain.lm_head, nn.Linear) and not [m for m in plain.modules() if isinstance(m, PackedLinear)]
    prompt = list(range(300, 340))
    a, b = _logits(packed, prompt), _logits(eager, prompt)
    assert (a - b).abs().max() < 1e-4 * b.abs().max()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [prompt, list(range(50, 57)), list(range(1000, 1100))]
    assert [o.outputs[0].token_ids for o in packed.generate(prompts, greedy)] == [
        o.outputs[0].token_ids for o in eager.generate(prompts, greedy)
    ]
