"""Tiny random-weight models for tests and benchmarks, created offline, seeded, cached on disk.

Each is a Hugging Face directory (config.json + safetensors + SmolLM2's tokenizer
and chat template), so the engine and transformers load the very same files.
Needs the engine extra (torch, transformers).
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from ragserve.model_source import cache_dir, load_tokenizer, resolve_model

_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.1,  # wide enough that greedy picks are rarely near-ties
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS: dict[str, dict] = {
    # GQA, untied head, Llama-3 rope scaling
    "llama": dict(
        _COMMON,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        tie_word_embeddings=False,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=512,
        ),
    ),
    "mistral": dict(
        _COMMON,
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        tie_word_embeddings=False,
        sliding_window=None,
    ),
    # qkv bias, tied embeddings
    "qwen2": dict(
        _COMMON,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        tie_word_embeddings=True,
        use_sliding_window=False,
    ),
    # per-head q/k RMSNorm, head_dim != hidden / heads
    "qwen3": dict(
        _COMMON,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        tie_word_embeddings=True,
        head_dim=32,
        attention_bias=False,
    ),
}


def tiny_model(arch: str = "llama", seed: int = 0, sharded: bool = False, **overrides) -> Path:
    """Path to a cached tiny HF model directory, creating it on first use; overrides change its config."""
    if arch not in CONFIGS:
        raise ValueError(f"unknown tiny model {arch!r}; choose from {sorted(CONFIGS)}")
    # a deep copy: transformers' config classes edit nested dicts in place (rope_scaling), which gave a
    # model's second call in a process another tag, directory and model id than its first
    config = copy.deepcopy({**CONFIGS[arch], **overrides})
    tag = hashlib.sha256(json.dumps([config, seed, sharded], sort_keys=True).encode()).hexdigest()[:10]
    out = cache_dir() / "tiny-models" / f"{arch}-s{seed}{'-sharded' if sharded else ''}-{tag}"
    if not (out / "config.json").is_file():
        _create(out, config, seed, sharded)
    return out


def _create(out: Path, config: dict, seed: int, sharded: bool) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size="2MB" if sharded else "10GB")
    _write_tokenizer(tmp)
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_tokenizer(dest: Path) -> None:
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    (dest / "tokenizer.json").write_text(tok.tokenizer_json)
    # TokenizersBackend: transformers uses tokenizer.json as is, like the engine does
    config = {"tokenizer_class": "TokenizersBackend", **{k: v for k, v in tok.special_tokens.items() if v}}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (dest / "chat_template.jinja").write_text(tok.chat_template or "")
