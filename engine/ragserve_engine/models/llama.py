"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) built from the engine's layers."""

from __future__ import annotations

import torch
from torch import nn

from ragserve_engine.layers import fused
from ragserve_engine.layers.attention import Attention, ForwardContext
from ragserve_engine.layers.norm import RMSNorm
from ragserve_engine.layers.rotary import RotaryEmbedding
from ragserve_engine.models.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.call("silu_and_mul", x.shape[0], self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(
            idx, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary,
            bias=cfg.attention_bias, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps,
        )  # fmt: skip
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, ctx: ForwardContext):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
