"""KV-cache quantization: storage dtypes, scales, and the torch quantize/dequantize the kernels mirror.

- ``auto``: the model dtype, no scales.
- ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``: one per-tensor scale per layer for K and one for V
  (``LayerKVCache.k_scale`` / ``v_scale``), static 1.0 like vLLM without calibrated checkpoint
  scales; values are divided by the scale and saturated to the format's finite range.
- ``int8``: symmetric, one float32 scale per token per KV head for K and for V
  (``absmax / 127``), stored next to the data as ``scales[num_blocks, num_layers, 2, block_size, kv_heads]``
  so a block (data + scales) stays self-contained for swapping and offloading.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype -> canonical name (the KV layout fingerprint uses it: fp8 and fp8_e4m3 are the same bytes)
CANONICAL = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8": "int8"}
STORAGE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
INT8_MAX = 127.0
SCALE_DTYPE = torch.float32
MIN_SCALE = 1e-8  # an all-zero head still gets a usable scale

# quantization modes the kernels specialize on
QUANT_NONE, QUANT_PER_TENSOR, QUANT_PER_TOKEN_HEAD = 0, 1, 2


def canonical(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in CANONICAL:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(CANONICAL)}, got {kv_cache_dtype!r}")
    return CANONICAL[kv_cache_dtype]


def storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return STORAGE_DTYPES.get(canonical(kv_dtype), model_dtype)


def quant_mode(kv_dtype: str) -> int:
    kind = canonical(kv_dtype)
    if kind == "auto":
        return QUANT_NONE
    return QUANT_PER_TOKEN_HEAD if kind == "int8" else QUANT_PER_TENSOR


def has_scale_tensor(kv_dtype: str) -> bool:
    return quant_mode(kv_dtype) == QUANT_PER_TOKEN_HEAD


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(
    x: torch.Tensor, kv_dtype: str, dtype: torch.dtype, scale: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [..., head_dim] -> (stored values, per-row scales for int8 else None)."""
    mode = quant_mode(kv_dtype)
    x = x.float()
    if mode == QUANT_NONE:
        return x.to(dtype), None
    if mode == QUANT_PER_TENSOR:
        limit = fp8_max(dtype)
        return (x / scale).clamp(-limit, limit).to(dtype), None
    scales = x.abs().amax(dim=-1).clamp(min=MIN_SCALE) / INT8_MAX
    q = torch.floor(x / scales.unsqueeze(-1) + 0.5).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scales


def dequantize(q: torch.Tensor, kv_dtype: str, scale: float, scales: torch.Tensor | None) -> torch.Tensor:
    """Inverse of quantize, in float32 (scales: [...] matching q's leading dims for int8)."""
    mode = quant_mode(kv_dtype)
    if mode == QUANT_NONE:
        return q
    if mode == QUANT_PER_TENSOR:
        return q.float() * scale
    return q.float() * scales.unsqueeze(-1)
