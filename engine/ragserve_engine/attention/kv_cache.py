"""Allocation of the paged KV cache for a --kv-cache-dtype (quantized dtypes carry scales)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragserve_engine.attention import quant
from ragserve_engine.attention.backend import LayerKVCache


@dataclass
class KVCacheTensors:
    data: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    scales: torch.Tensor | None  # int8: [num_blocks, num_layers, 2, block_size, num_kv_heads] float32
    kv_dtype: str  # canonical --kv-cache-dtype ("auto" = model dtype, "fp8" -> "fp8_e4m3")

    def layers(self) -> list[LayerKVCache]:
        return [
            LayerKVCache(self.data[:, i], self.kv_dtype, None if self.scales is None else self.scales[:, i])
            for i in range(self.data.shape[1])
        ]

    @property
    def storage_dtype_name(self) -> str:
        return str(self.data.dtype).removeprefix("torch.")

    def host_copy(self, num_blocks: int, pin: bool) -> KVCacheTensors:
        """An empty host-memory cache of the same layout (swap space)."""

        def alloc(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)

        return KVCacheTensors(alloc(self.data), alloc(self.scales), self.kv_dtype)

    def copy_from(self, other: KVCacheTensors, src: list[int], dst: list[int]) -> None:
        """self[dst] = other[src], block by block (other may live on another device)."""
        self.data[dst] = other.data[src].to(self.data.device)
        if self.scales is not None:
            self.scales[dst] = other.scales[src].to(self.scales.device)


def bytes_per_block(kv_cache_dtype: str, model_dtype: torch.dtype, block_shape: tuple[int, ...]) -> int:
    """Bytes of one block (data + int8 scales); block_shape = (1, num_layers, 2, block_size, kv_heads, head_dim)."""
    numel = 1
    for d in block_shape:
        numel *= d
    size = numel * _element_size(quant.storage_dtype(kv_cache_dtype, model_dtype))
    if quant.has_scale_tensor(kv_cache_dtype):
        size += numel // block_shape[-1] * _element_size(quant.SCALE_DTYPE)
    return size


def allocate_kv_cache(
    kv_cache_dtype: str, model_dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> KVCacheTensors:
    """shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)."""
    kv_dtype = quant.canonical(kv_cache_dtype)
    data = torch.zeros(shape, dtype=quant.storage_dtype(kv_dtype, model_dtype), device=device)
    scales = None
    if quant.has_scale_tensor(kv_dtype):
        scales = torch.ones(shape[:-1], dtype=quant.SCALE_DTYPE, device=device)
    return KVCacheTensors(data, scales, kv_dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
