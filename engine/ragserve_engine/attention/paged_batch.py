"""Random paged batches for checking attention backends against each other (tests and bench/kernels_gpu.py).

A batch is a list of (query length, context length) cases: each sequence has context - query tokens
already in the cache (written by the reference backend, so every backend reads the same quantized bytes)
and query-length new tokens whose K/V the backend under test writes. Physical blocks are shuffled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragserve_engine.attention import quant
from ragserve_engine.attention.backend import AttentionMetadata, LayerKVCache
from ragserve_engine.attention.kv_cache import KVCacheTensors, allocate_kv_cache
from ragserve_engine.attention.torch_ref import TorchAttentionBackend


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim] (padding tokens last)
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    meta: AttentionMetadata
    kv_cache: KVCacheTensors
    layer: int = 0
    k_scale: float = 1.0
    v_scale: float = 1.0

    def cache(self, kv_cache: KVCacheTensors | None = None) -> LayerKVCache:
        c = (kv_cache or self.kv_cache).layers()[self.layer]
        c.k_scale, c.v_scale = self.k_scale, self.v_scale
        return c

    def clone_kv(self) -> KVCacheTensors:
        scales = None if self.kv_cache.scales is None else self.kv_cache.scales.clone()
        return KVCacheTensors(self.kv_cache.data.clone(), scales, self.kv_cache.kv_dtype)

    @property
    def num_real_tokens(self) -> int:
        return self.meta.query_start_loc_cpu[-1]


def make_paged_batch(
    cases: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_layers: int = 1,
    layer: int = 0,
    first_block: int = 1,
    num_blocks: int | None = None,
    pad_tokens: int = 0,
    kv_cache: KVCacheTensors | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    seed: int = 0,
) -> PagedBatch:
    """first_block: the lowest physical block id used (pass > 30,000 to exercise 64-bit addressing);
    kv_cache: a preallocated cache (e.g. a lazily committed torch.empty one) instead of a fresh zeroed one."""
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    needed = sum(-(-ctx // block_size) for _, ctx in cases)
    num_blocks = num_blocks or first_block + needed
    if kv_cache is None:
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        kv_cache = allocate_kv_cache(kv_dtype, dtype, shape, device)
    ids = (torch.randperm(num_blocks - first_block, generator=gen)[:needed] + first_block).tolist()
    tables, slots, q_starts, seq_lens = [], [], [0], []
    batch = PagedBatch(None, None, None, None, kv_cache, layer, k_scale, v_scale)  # type: ignore[arg-type]
    ref = TorchAttentionBackend()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    for q_len, ctx in cases:
        assert 0 < q_len <= ctx, (q_len, ctx)
        n = -(-ctx // block_size)
        table, ids = ids[:n], ids[n:]
        tables.append(table)
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        cached = ctx - q_len
        if cached:
            prefix_slots = torch.tensor(seq_slots[:cached], dtype=torch.int64, device=device)
            k, v = randn(cached, num_kv_heads, head_dim), randn(cached, num_kv_heads, head_dim)
            ref.write_kv(k, v, batch.cache(), prefix_slots)
        slots += seq_slots[cached:]
        q_starts.append(q_starts[-1] + q_len)
        seq_lens.append(ctx)
    num_tokens = q_starts[-1] + pad_tokens
    width = max(len(t) for t in tables)
    batch.meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(q_starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        max_query_len=max(q for q, _ in cases),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=q_starts,
        seq_lens_cpu=seq_lens,
    )
    batch.query = randn(num_tokens, num_heads, head_dim)
    batch.key = randn(num_tokens, num_kv_heads, head_dim)
    batch.value = randn(num_tokens, num_kv_heads, head_dim)
    return batch


def lazy_kv_cache(
    kv_dtype: str, dtype: torch.dtype, shape: tuple[int, ...], device: str | torch.device = "cpu"
) -> KVCacheTensors:
    """A cache from torch.empty: on CPU, pages are committed only where written, so a cache with block ids
    above 30,000 (offsets past 2**31 elements) costs only the blocks a test touches."""
    kv_dtype = quant.canonical(kv_dtype)
    data = torch.empty(shape, dtype=quant.storage_dtype(kv_dtype, dtype), device=device)
    scale_shape = shape[:-1]
    scales = (
        torch.empty(scale_shape, dtype=quant.SCALE_DTYPE, device=device) if quant.has_scale_tensor(kv_dtype) else None
    )
    return KVCacheTensors(data, scales, kv_dtype)
