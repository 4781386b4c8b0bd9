"""GGUF checkpoints: metadata → ModelConfig, tensors dequantized to float with the `gguf` package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ragserve.gguf_file import read_gguf
from ragserve_engine.models.config import SUPPORTED, ModelConfig

_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_config(path: Path) -> ModelConfig:
    gguf = read_gguf(path)
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED)}")
    names = gguf.tensor_names()
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type=arch,
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_layers=meta[f"{arch}.block_count"],
        num_heads=heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=meta.get(f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        max_position=meta.get(f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        eos_token_ids=[eos] if eos is not None else [],
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows (interleaved → half-split)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(path: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named float32 tensors from a GGUF file."""
    from gguf import dequantize

    for tensor in read_gguf(path).tensors:
        w = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        name = tensor.name
        if name == "token_embd.weight":
            yield "embed_tokens.weight", torch.from_numpy(w)
        elif name == "output_norm.weight":
            yield "norm.weight", torch.from_numpy(w)
        elif name == "output.weight":
            yield "lm_head.weight", torch.from_numpy(w)
        elif name.startswith("blk."):
            _, idx, kind, suffix = name.split(".", 3)
            if cfg.model_type in ("llama", "mistral") and kind in ("attn_q", "attn_k"):
                w = _unpermute(w, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
            yield f"layers.{idx}.{_NAMES[kind]}.{suffix}", torch.from_numpy(np.ascontiguousarray(w))
