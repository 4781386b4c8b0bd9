"""Decode attention written for a compiled graph: the paged cache is read in place, never written.

Every sequence has one query. Its keys are gathered by block table inside the score reduction
(``q * K[block_tables]`` summed over head_dim), so inductor emits one C++ loop with indirect loads
instead of an index_select copy of the whole context plus an SDPA call. The cache holds a sequence's
earlier tokens; the new token's own key and value join the softmax as one more term, and the graph
returns every layer's new K/V, which the caller writes into the cache with one index_copy_ per K and V
after the step (no per-layer in-place op, which a compiled graph can only call back into Python for).
Rows past a sequence's length are masked; padding rows of a bucket attend to their own token only.
Only the model-dtype cache (--kv-cache-dtype auto) is read this way. On CPU, once the C++ kernel
(cpu_ops.py) is loaded, the graph calls it instead: same inputs and result, each block read once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragserve_engine.attention.backend import AttentionMetadata
from ragserve_engine.compilation import cpu_ops


@dataclass
class GraphLayerCache:
    """A layer of the whole cache tensor, as the compiled graph sees it (the cache itself is the input)."""

    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, KVH, D]
    layer: int
    new_kv: list[tuple[torch.Tensor, torch.Tensor]]  # every layer's (key, value) of this step, in order

    @property
    def data(self) -> torch.Tensor:
        return self.kv_cache[:, self.layer]


class GraphDecodeAttention:
    """An AttentionBackend for one-query-per-sequence steps traced by torch.compile."""

    name = "graph-decode"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: GraphLayerCache, slot_mapping: torch.Tensor):
        cache.new_kv.append((key, value))  # written by the caller, after the graph

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: GraphLayerCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if query.device.type == "cpu" and cpu_ops.loaded():
            return torch.ops.ragserve.paged_decode_attention(
                query, key, value, cache.kv_cache, cache.layer, meta.block_tables, meta.seq_lens, scale
            )
        return paged_decode_attention(query, key, value, cache.data, meta.block_tables, meta.seq_lens, scale)


def paged_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    data: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [B, H, D]; key, value [B, KVH, D] (the new token's); data [num_blocks, 2, block_size, KVH, D]
    holding the first seq_len - 1 tokens; block_tables [B, W]; seq_lens [B] (the new token included).

    Returns [B, H, D]. Query head h reads KV head h // (H / KVH), as HF's repeat_kv."""
    b, h, d = query.shape
    _, _, bs, kvh, _ = data.shape
    w = block_tables.shape[1]
    q = query.float().view(b, 1, kvh, h // kvh, d)
    ids = block_tables.long()
    k = data[:, 0][ids].view(b, w * bs, kvh, 1, d)  # fused into the reduction below, not materialised
    v = data[:, 1][ids].view(b, w * bs, kvh, 1, d)
    cached = (q * k.float()).sum(-1) * scale  # [B, L, KVH, G]
    valid = torch.arange(w * bs, device=query.device)[None, :] < seq_lens[:, None] - 1
    cached = cached.masked_fill(~valid[:, :, None, None], float("-inf"))
    own = (q[:, 0] * key.float()[:, :, None, :]).sum(-1) * scale  # [B, KVH, G]
    probs = torch.softmax(torch.cat([cached, own[:, None]], dim=1), dim=1)
    out = (probs[:, :-1, ..., None] * v.float()).sum(1) + probs[:, -1, ..., None] * value.float()[:, :, None, :]
    return out.reshape(b, h, d).to(query.dtype)


def write_new_kv(kv: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """kv[slot's block, layer, 0/1, slot's offset] = keys/values [layers, n, KVH, D] for every layer at once,
    through a flat [num_blocks * layers * 2 * block_size, KVH * D] view."""
    _, layers, _, bs, kvh, d = kv.shape
    layer_rows = torch.arange(layers, device=kv.device)[:, None] * (2 * bs)
    rows = (slots // bs * (layers * 2 * bs) + slots % bs)[None, :] + layer_rows  # [layers, n]
    flat = kv.view(-1, kvh * d)
    flat.index_copy_(0, rows.flatten(), keys.reshape(-1, kvh * d).to(kv.dtype))
    flat.index_copy_(0, rows.flatten() + bs, values.reshape(-1, kvh * d).to(kv.dtype))
