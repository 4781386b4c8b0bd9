"""Pick the attention backend: Triton kernels on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import os

import torch

from ragserve.engine.attention.torch_ref import TorchAttentionBackend

CPU_TRITON_ERROR = "Triton needs a CUDA device; set TRITON_INTERPRET=1 to run the interpreter on CPU (slow)"


def get_attention_backend(name: str, device: torch.device):
    """name: auto | torch | triton (--attention-backend)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name != "triton":
        raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(CPU_TRITON_ERROR)
    if not _triton_importable():
        raise ValueError("attention backend 'triton' needs the triton package (pip install triton)")
    from ragserve.engine.attention.triton_backend import TritonAttentionBackend
    from ragserve.engine.attention.triton_utils import kernels_interpreted

    if device.type != "cuda" and not kernels_interpreted():
        raise ValueError("the Triton kernels were imported before TRITON_INTERPRET=1 was set; set it at start-up")
    return TritonAttentionBackend()


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
