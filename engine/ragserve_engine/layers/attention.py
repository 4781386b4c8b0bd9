"""Self-attention: fused QKV projection, optional q/k norm, rotary, paged KV through a backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ragserve_engine.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from ragserve_engine.layers.norm import RMSNorm
from ragserve_engine.layers.rotary import RotaryEmbedding


@dataclass
class ForwardContext:
    """What every attention layer needs for one step."""

    meta: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[LayerKVCache]


class Attention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)
        self.rotary = rotary
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v for x: projections, q/k norm and rotary, without the paged-cache step."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(positions, x)
        cache = ctx.kv_caches[self.layer_idx]
        ctx.backend.write_kv(k, v, cache, ctx.meta.slot_mapping)
        out = ctx.backend.forward(q, k, v, cache, ctx.meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))
