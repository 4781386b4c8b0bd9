"""Lower-precision weights: weight-only int8 and int4 linears and bfloat16 models against float32."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from ragserve.model_source import resolve_model
from ragserve_engine.attention.backend import AttentionMetadata
from ragserve_engine.compilation import cpu_ops
from ragserve_engine.layers.attention import ForwardContext
from ragserve_engine.layers.quant_linear import Int4Linear, Int8Linear, quantize_weights
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 15, 49, 200])  # tiles of 4 rows
def test_int8_linear_is_the_dequantized_matmul(rows: int):
    """The C++ kernel (blocked weight, float32 activations) is the float32 product with the int8 weight,
    for any number of rows and output features that are not a multiple of the 64-channel block."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 72, bias=True)
    q = Int8Linear(linear)
    assert q.blocked and q.qweight.shape == (2, 96, 64)  # CI builds the C++ ops; 72 channels pad to 128
    weight = q.dequantized()
    assert weight.shape == (72, 96) and (weight / q.scales[:72, None]).round().abs().amax(dim=1).eq(127).all()
    x = torch.randn(rows, 2, 96)
    expected = x.double() @ weight.double().T + linear.bias.double()
    out = q(x)
    assert out.shape == (rows, 2, 72) and out.dtype == torch.float32
    assert (out - expected).abs().max() < 1e-5 * expected.abs().max()
    assert (out - linear(x)).abs().max() < 5e-2 * linear(x).abs().max()  # and close to the float32 layer


def test_int8_linear_without_the_cpp_ops_uses_torch_int8_matmul(monkeypatch: pytest.MonkeyPatch):
    """No compiler (the build fails): the plain [out, in] weight and torch's bf16-activation int8 matmul."""
    monkeypatch.setattr(cpu_ops, "load", lambda: False)
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True)
    q = Int8Linear(linear)
    assert not q.blocked and q.qweight.shape == (40, 96) and q.qweight.abs().max() == 127
    x = torch.randn(5, 3, 96)
    expected = x.bfloat16().float() @ q.dequantized().T + linear.bias
    out = q(x)
    assert out.shape == (5, 3, 40) and out.dtype == torch.float32
    assert (out - expected).abs().max() < 2e-2 * expected.abs().max()


@pytest.mark.parametrize("rows", [1, 4, 7, 60])
def test_grouped_int8_linear_is_its_dequantized_matmul(rows: int):
    """ragserve::int8_group_linear (int4's LM head): the float32 product with d * q, a float16 d per 32 input
    features; output and input features not multiples of the block or the group."""
    torch.manual_seed(0)
    linear = nn.Linear(100, 72, bias=True)
    q = Int8Linear(linear, grouped=True)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (2, 100, 64) and q.scales.shape == (2, 4, 64)
    weight = q.dequantized()
    assert weight.shape == (72, 100)
    assert (weight - linear.weight).abs().max() < 0.6 * q.scales.float().max()  # within half a step, per group
    x = torch.randn(rows, 100)
    expected = x.double() @ weight.double().T + linear.bias.double()
    assert (q(x) - expected).abs().max() < 1e-5 * expected.abs().max()


@pytest.mark.parametrize("rows", [1, 4, 7, 60])
def test_int4_linear_is_its_dequantized_matmul(rows: int):
    """ragserve::int4_linear is the float32 product with d * q + m (q 4-bit, d and m per 32 input features),
    here with output and input features that are not multiples of the 64-channel block or the group."""
    torch.manual_seed(0)
    linear = nn.Linear(100, 72, bias=True)
    q = Int4Linear(linear)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (2, 100, 32)  # two 4-bit weights a byte
    assert q.scales.dtype == torch.float16 and q.scales.shape == q.mins.shape == (2, 4, 64)
    weight = q.dequantized()
    group_range = linear.weight.view(72, -1)[:, :96].reshape(72, 3, 32)
    step = (group_range.amax(dim=2) - group_range.amin(dim=2)) / 15
    assert ((weight - linear.weight)[:, :96].reshape(72, 3, 32).abs() <= step[..., None] * 0.51).all()
    x = torch.randn(rows, 100)
    expected = x.double() @ weight.double().T + linear.bias.double()
    out = q(x)
    assert out.shape == (rows, 72) and (out - expected).abs().max() < 1e-5 * expected.abs().max()


def test_int4_keeps_a_q4_1_gguf_s_own_weights():
    """SmolLM2's GGUF stores its projections as Q4_1 (the same scheme): int4 gets the file's values back."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(resolve_model("smollm2-135m").path)
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight"):
        t = tensors[name]
        assert t.tensor_type.name == "Q4_1"
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32")).reshape(int(t.shape[1]), -1)
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        assert (Int4Linear(linear).dequantized() - w).abs().max() < 1e-4 * w.abs().max()


def test_int4_s_lm_head_keeps_the_gguf_s_q8_0_output_weights():
    """The file's output (its tied embedding) is Q8_0: int4's LM head, int8 in groups of 32, gets those values
    back exactly, where one scale per channel (int8's) cannot."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(resolve_model("smollm2-135m").path)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert t.tensor_type.name == "Q8_0"
    w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32")).reshape(int(t.shape[1]), -1)
    w = w[:4096]  # a slice of the 49,152 rows keeps the test quick
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w
    assert torch.equal(Int8Linear(linear, grouped=True).dequantized(), w)
    assert not torch.equal(Int8Linear(linear).dequantized(), w)


@pytest.mark.parametrize("make", [Int8Linear, partial(Int8Linear, grouped=True), Int4Linear])
def test_quantized_linear_runs_inside_a_compiled_graph(make):
    """Decode graphs call ragserve::int8_linear / int4_linear as extern kernels: same result as eager."""
    torch.manual_seed(0)
    q = make(nn.Linear(64, 48, bias=False))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        compiled = torch.compile(lambda t: torch.relu(q(t)) * 2, fullgraph=True)
        assert torch.equal(compiled(x), torch.relu(q(x)) * 2)


@pytest.mark.parametrize(("method", "layer", "min_cos"), [("int8", Int8Linear, 0.99), ("int4", Int4Linear, 0.9)])
def test_quantized_engine_tracks_float32(method: str, layer: type, min_cos: float):
    """Every projection becomes int8 / int4 and the LM head int8; the tied embedding keeps its float32
    table. (The tiny model's weights are random: 4 bits of them move its logits more than a trained
    model's, whose greedy agreement bench/engine.py --part precision measures.)"""
    path = str(tiny_model("llama"))
    ref = LLM(path, num_gpu_blocks=64, compile_at_start=False)  # the weights are tested, not the graphs
    llm = LLM(path, num_gpu_blocks=64, quantization=method, compile_at_start=False)
    model = llm.engine.runner.model
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert isinstance(model.layers[0].mlp.down_proj, layer) and isinstance(model.lm_head, Int8Linear)
    assert model.lm_head.grouped == (method == "int4")  # int4's head: Q8_0-style groups, as llama.cpp's files
    assert model.embed_tokens.weight.dtype == torch.float32
    prompt = list(range(300, 340))
    logits = [_logits(r, prompt) for r in (ref, llm)]
    cos = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1)
    assert cos.min() > min_cos and cos.mean() > 0.97, cos
    assert len(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids) == 8


def test_bfloat16_engine_keeps_float32_rotary_tables():
    path = str(tiny_model("llama"))
    llm = LLM(path, num_gpu_blocks=64, dtype="bfloat16", compile_at_start=False)
    model = llm.engine.runner.model
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.layers[0].self_attn.rotary.cos.dtype == torch.float32
    ref = LLM(path, num_gpu_blocks=64, compile_at_start=False)
    prompt = list(range(300, 340))
    logits = [_logits(r, prompt) for r in (ref, llm)]
    assert torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1).min() > 0.99


def test_quantize_rejects_unknown_method():
    with pytest.raises(ValueError, match="int3"):
        quantize_weights(nn.Sequential(nn.Linear(4, 4)), "int3")


def _logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of a one-sequence prefill through the engine's own runner."""
    runner = llm.engine.runner
    n, bs = len(prompt), runner.layout.block_size
    table = list(range(1, 1 + -(-n // bs)))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in range(n)]),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([table], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
    )
    with torch.inference_mode():
        ctx = ForwardContext(meta, runner.backend, runner.kv_layers)
        return runner.model.compute_logits(runner.model(torch.tensor(prompt), torch.arange(n), ctx))
