"""Position fix-up: stored keys re-rotated to their real position equal keys computed there."""

from __future__ import annotations

import pytest
import torch

from ragserve_engine.blend.forward import blend_forward
from ragserve_engine.blend.rope import rerotate
from ragserve_engine.blend.runner import Blender
from ragserve_engine.layers.rotary import RotaryEmbedding
from ragserve_engine.llm import LLM
from tests.helpers.tiny_models import tiny_model

LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=512
)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}, LLAMA3])
@pytest.mark.parametrize(("start", "target"), [(0, 37), (5, 1900), (300, 12)])
def test_rerotated_keys_equal_keys_rotated_in_place(scaling, start, target):
    rotary = RotaryEmbedding(64, 4096, 500000.0, scaling)
    raw = torch.randn(20, 3, 64, generator=torch.Generator().manual_seed(start))
    positions = torch.arange(20)
    _, stored = rotary(positions + start, raw, raw)
    _, in_place = rotary(positions + target, raw, raw)
    moved = rerotate(stored, target - start, rotary)
    # the engine's own float32 angle tables are good to ~1e-4 at position ~2000: the same bound here
    torch.testing.assert_close(moved, in_place, atol=2e-4, rtol=1e-5)
    assert not torch.allclose(stored, in_place, atol=1e-3)  # the fix-up did something


def _keys(model, token_ids: list[int], layer: int) -> torch.Tensor:
    keys = {}
    ids = torch.tensor(token_ids)
    with torch.inference_mode():
        blend_forward(model, ids, torch.arange(len(ids)), None, lambda i, k, v: keys.setdefault(i, k))
    return keys[layer]


@pytest.fixture(scope="module")
def runner():
    return LLM(str(tiny_model("llama")), num_gpu_blocks=64, enforce_eager=True).engine.runner


@pytest.mark.parametrize("prefix", [[], [1, 17]])
def test_stored_chunk_keys_fixed_up_equal_keys_computed_in_place(runner, prefix):
    """Layer 0 keys depend on the token and its position only: a stored chunk moved to its real position
    must give exactly the keys a full prefill computes there (llama3 rope scaling, GQA)."""
    blender = Blender(runner, b"\0" * 32, 0.15, 1 << 24, canonical_prefix=prefix)
    chunk = [300 + i for i in range(45)]
    stored = blender.compute_chunk(chunk)  # [layers, 2, n, kvh, d] at positions len(prefix)..
    before = [7, 8, 9, 10, 11, 12, 13] * 30  # 210 tokens
    prompt = before + chunk + [5, 6]
    in_place = _keys(runner.model, prompt, layer=0)[len(before) : len(before) + len(chunk)]
    moved = rerotate(stored[0, 0], len(before) - len(prefix), runner.model.layers[0].self_attn.rotary)
    torch.testing.assert_close(moved, in_place, atol=1e-5, rtol=1e-5)
    # deeper layers differ: the chunk attended to nothing before it (what selective recompute repairs)
    deeper = _keys(runner.model, prompt, layer=1)[len(before) : len(before) + len(chunk)]
    assert not torch.allclose(
        rerotate(stored[1, 0], len(before) - len(prefix), runner.model.layers[0].self_attn.rotary), deeper, atol=1e-3
    )
