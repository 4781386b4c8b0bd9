"""Pick the attention backend for a device."""

from __future__ import annotations

import torch
from ragserve.engine.attention.torch_ref import TorchAttentionBackend


def get_attention_backend(name: str, device: torch.device):
    if name == "auto":
        name = "torch"
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"attention backend {name!r} is not available on {device}")
