"""Rotary position embeddings (neox style, as in HF Llama), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from ragserve_engine.layers import fused


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), _inv_freq(head_dim, theta, scaling))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self._positions: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] = ()

    def _apply(self, fn, recurse=True):
        """Follow the model's device, but keep float32 tables whatever its dtype (as HF does)."""
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        self._positions = None
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KVH, D]."""
        if torch.compiler.is_compiling():  # a compiled graph looks them up itself (no cached state)
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
            return fused.rotate(q, cos, sin), fused.rotate(k, cos, sin)
        if positions is not self._positions:  # every layer shares this module: look the step's rows up once
            self._positions, self._rows = (
                positions,
                (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)),
            )
        cos, sin = self._rows
        n = positions.shape[0]
        return fused.call("rotate", n, q, cos, sin), fused.call("rotate", n, k, cos, sin)


_rotate = fused.rotate  # one implementation; CacheBlend's re-rotation of cached keys imports this name
