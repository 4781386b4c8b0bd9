"""Build a model and load its weights (HF safetensors, sharded or not, or GGUF)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from ragserve.model_source import ModelSource
from ragserve_engine.models.config import ModelConfig
from ragserve_engine.models.llama import LlamaForCausalLM

# HF checkpoint names → (our fused parameter, shard index in it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name.removeprefix("model."), f.get_tensor(name)


def _shard_slices(model: LlamaForCausalLM, fused: str) -> list[int]:
    cfg = model.config
    if fused == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [0, q, q + kv, q + 2 * kv]
    return [0, cfg.intermediate_size, 2 * cfg.intermediate_size]


def load_weights(model: LlamaForCausalLM, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            target = ".".join([*parts[:-2], fused, parts[-1]])
            bounds = _shard_slices(model, fused)
            param = params[target]
            param.data[bounds[shard] : bounds[shard + 1]].copy_(tensor)
            loaded.add(f"{target}#{shard}")
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        params[name].data.copy_(tensor)
        loaded.add(name)
    missing = [n for n in params if n not in loaded and not any(k.startswith(n + "#") for k in loaded)]
    missing = [n for n in missing if not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}")


def model_config(source: ModelSource) -> ModelConfig:
    """The architecture of an HF directory (config.json) or a GGUF file (its metadata)."""
    if source.kind == "gguf":
        from ragserve_engine.models.gguf_loader import gguf_config

        return gguf_config(source.path)
    return ModelConfig.from_hf(json.loads((source.path / "config.json").read_text()))


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    cfg = model_config(source)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg)
    if source.kind == "gguf":
        from ragserve_engine.models.gguf_loader import iter_gguf_weights

        load_weights(model, iter_gguf_weights(source.path, cfg))
    else:
        load_weights(model, iter_safetensors(source.path))
    return model.to(device=device, dtype=dtype).eval()
