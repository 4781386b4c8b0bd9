"""ModelConfig: the architecture facts the engine needs, from config.json (GGUF metadata: models.gguf_loader)."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED)}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=_rope_scaling(cfg),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict) -> dict | None:
    """transformers 5 folds rope_scaling into rope_parameters; accept both spellings."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return None
    return scaling
