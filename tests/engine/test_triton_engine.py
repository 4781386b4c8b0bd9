"""The engine end to end on the Triton backend (interpreter on CPU): greedy output equals the reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ragserve_engine.attention.selector import CPU_TRITON_ERROR, get_attention_backend
from ragserve_engine.attention.torch_ref import TorchAttentionBackend
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model
from tests.helpers.triton_interpret import interpreted_import

with interpreted_import():  # the kernels run on CPU, interpreted
    from ragserve_engine.attention.triton_backend import TritonAttentionBackend

pytestmark = pytest.mark.usefixtures("triton_interpret")

PROMPTS = [
    "Retrieval-augmented generation retrieves documents and puts them in the prompt, so the model can",
    "Q: What is 17 + 25?\nA:",
    "PagedAttention splits the KV cache into fixed-size blocks, like pages of virtual memory. " * 2,
    "Hi",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
CPU = torch.device("cpu")


def test_selection(monkeypatch):
    assert isinstance(get_attention_backend("auto", CPU), TorchAttentionBackend)
    assert isinstance(get_attention_backend("torch", CPU), TorchAttentionBackend)
    assert isinstance(get_attention_backend("triton", CPU), TritonAttentionBackend)  # TRITON_INTERPRET=1
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="Triton needs a CUDA device; set TRITON_INTERPRET=1"):
        get_attention_backend("triton", CPU)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", CPU)


def test_fp8_e4m3_needs_ada_or_hopper(monkeypatch):
    """No pre-Ada GPU here: the capability query is the one thing faked; the decision logic is real."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # A100
    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        get_attention_backend("triton", cuda, "fp8")
    assert isinstance(get_attention_backend("auto", cuda, "fp8_e4m3"), TorchAttentionBackend)  # falls back
    assert isinstance(get_attention_backend("auto", cuda, "fp8_e5m2"), TritonAttentionBackend)
    assert isinstance(get_attention_backend("triton", cuda, "int8"), TritonAttentionBackend)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # H100/H200
    assert isinstance(get_attention_backend("auto", cuda, "fp8"), TritonAttentionBackend)


def test_cli_refuses_triton_on_cpu_without_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "ragserve.cli", "generate", "--model", str(tiny_model("llama")), "--device", "cpu"]
    cmd += ["--attention-backend", "triton", "--max-tokens", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert CPU_TRITON_ERROR in proc.stderr
    assert "Traceback" not in proc.stderr


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # head_dim 16 (GQA 2) and 32 (q/k norm)
def test_greedy_output_equals_reference_backend(arch):
    path = str(tiny_model(arch))
    ref = LLM(path, num_gpu_blocks=128, attention_backend="torch", enforce_eager=True)
    prompts = [ref.tokenizer.encode(t) for t in PROMPTS]
    expected = _greedy(ref, prompts)
    llm = LLM(path, num_gpu_blocks=128, attention_backend="triton", loaded_model=ref.engine.runner.model)
    assert llm.engine.runner.backend.name == "triton"
    assert _greedy(llm, prompts) == expected
    if arch == "llama":  # second pass: prefix hits, so prefills run on top of cached blocks
        again = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0


def test_chunked_prefill_mixed_steps_equal_reference():
    """A 7-token budget: steps mix decodes with prefill chunks over the already written part of a prompt."""
    path = str(tiny_model("llama"))
    ref = LLM(path, num_gpu_blocks=128, attention_backend="torch", enforce_eager=True, max_num_batched_tokens=7)
    prompts = [ref.tokenizer.encode(t) for t in PROMPTS[:3]]
    expected = _greedy(ref, prompts)
    model = ref.engine.runner.model
    llm = LLM(path, num_gpu_blocks=128, attention_backend="triton", max_num_batched_tokens=7, loaded_model=model)
    assert _greedy(llm, prompts) == expected


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_cache_triton_equals_reference(kv_dtype):
    path = str(tiny_model("llama"))
    ref = LLM(path, num_gpu_blocks=128, attention_backend="torch", enforce_eager=True, kv_cache_dtype=kv_dtype)
    prompts = [ref.tokenizer.encode(t) for t in PROMPTS]
    model = ref.engine.runner.model
    llm = LLM(path, num_gpu_blocks=128, attention_backend="triton", kv_cache_dtype=kv_dtype, loaded_model=model)
    assert _greedy(llm, prompts) == _greedy(ref, prompts)
