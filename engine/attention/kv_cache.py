"""Allocation of the paged KV cache for a --kv-cache-dtype (quantized dtypes carry scales)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ragserve.engine.attention.backend import LayerKVCache


@dataclass
class KVCacheTensors:
    data: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    scales: torch.Tensor | None
    kv_dtype: str  # the --kv-cache-dtype in effect ("auto" = model dtype)

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
    numel = 1
    for d in block_shape:
        numel *= d
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported yet")
    return numel * torch.empty((), dtype=model_dtype).element_size()


def allocate_kv_cache(
    kv_cache_dtype: str, model_dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> KVCacheTensors:
    """shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported yet")
    return KVCacheTensors(torch.zeros(shape, dtype=model_dtype, device=device), None, "auto")
