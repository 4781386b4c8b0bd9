"""Pick the attention backend: Triton kernels on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import logging
import os

import torch

from ragserve_engine.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)
CPU_TRITON_ERROR = "Triton needs a CUDA device; set TRITON_INTERPRET=1 to run the interpreter on CPU (slow)"


def get_attention_backend(name: str, device: torch.device, kv_cache_dtype: str = "auto"):
    """name: auto | torch | triton (--attention-backend). auto falls back to the torch reference on a GPU
    the kernels cannot serve this KV cache dtype on (fp8 e4m3 before compute capability 8.9)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_importable() else "torch"
        if name == "triton" and (reason := _unsupported(kv_cache_dtype, device)):
            logger.warning("%s: using the torch attention backend", reason)
            name = "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name != "triton":
        raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(CPU_TRITON_ERROR)
    if not _triton_importable():
        raise ValueError("attention backend 'triton' needs the triton package (pip install triton)")
    from ragserve_engine.attention.triton_backend import TritonAttentionBackend
    from ragserve_engine.attention.triton_utils import kernels_interpreted

    if device.type != "cuda" and not kernels_interpreted():
        raise ValueError("the Triton kernels were imported before TRITON_INTERPRET=1 was set; set it at start-up")
    if reason := _unsupported(kv_cache_dtype, device):
        raise ValueError(reason)
    return TritonAttentionBackend()


def _unsupported(kv_cache_dtype: str, device: torch.device) -> str | None:
    from ragserve_engine.attention.triton_backend import unsupported_reason

    return unsupported_reason(kv_cache_dtype, device)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
