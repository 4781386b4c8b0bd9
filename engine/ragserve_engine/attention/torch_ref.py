"""Torch reference attention backend: plain gathers and SDPA, runs on any device and every KV dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragserve_engine.attention import quant
from ragserve_engine.attention.backend import AttentionMetadata, LayerKVCache


class TorchAttentionBackend:
    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        bs = cache.block_size
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        for kv, x, scale in ((0, key, cache.k_scale), (1, value, cache.v_scale)):
            q, scales = quant.quantize(x, cache.kv_dtype, cache.data.dtype, scale)
            cache.data[blocks, kv, offsets] = q
            if scales is not None:
                cache.scales[blocks, kv, offsets] = scales

    def gather_kv(
        self, cache: LayerKVCache, block_table: torch.Tensor, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first seq_len K and V as [seq_len, num_kv_heads, head_dim], dequantized."""
        num_blocks = -(-seq_len // cache.block_size)
        ids = block_table[:num_blocks].long()
        kv = cache.data[ids]  # [nb, 2, bs, H, D]
        scales = None if cache.scales is None else cache.scales[ids]  # [nb, 2, bs, H]
        out = []
        for i, scale in ((0, cache.k_scale), (1, cache.v_scale)):
            x = kv[:, i].reshape(-1, *kv.shape[-2:])[:seq_len]
            s = None if scales is None else scales[:, i].reshape(-1, scales.shape[-1])[:seq_len]
            out.append(quant.dequantize(x, cache.kv_dtype, scale, s))
        return out[0], out[1]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        starts = meta.query_start_loc_cpu
        quantized = quant.quant_mode(cache.kv_dtype) != quant.QUANT_NONE
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            q_start, q_end = starts[i], starts[i + 1]
            q_len = q_end - q_start
            if q_len == 0:
                continue
            if q_len == seq_len and not quantized:  # nothing cached before this step: use the fresh K/V
                k, v = key[q_start:q_end], value[q_start:q_end]
            else:  # quantized caches always attend over the stored values, like the kernels
                k, v = self.gather_kv(cache, meta.block_tables[i], seq_len)
            out[q_start:q_end] = _causal_sdpa(query[q_start:q_end], k.to(query.dtype), v.to(query.dtype), scale)
        return out


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, H, D]; k, v: [ctx, KVH, D]; the queries are the last q_len positions."""
    q_len, ctx = q.shape[0], k.shape[0]
    mask = None
    if 1 < q_len < ctx:
        rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx - q_len)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
    # 4-D inputs take torch's fused CPU kernel (several times faster than the 3-D math path)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        is_causal=q_len == ctx and q_len > 1, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)
