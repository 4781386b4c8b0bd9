"""Decode attention written for a compiled graph: the paged cache is read in place.

Every sequence has one query. Its keys are gathered by block table inside the score reduction
(``q * K[block_tables]`` summed over head_dim), so inductor emits one C++ loop with indirect loads
instead of an index_select copy of the whole context plus an SDPA call. Rows past a sequence's length
are masked. Padding rows of a bucket write their K/V to a scratch block and attend to that slot only.
Only the model-dtype cache (--kv-cache-dtype auto) is read this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragserve_engine.attention.backend import AttentionMetadata


@torch.library.custom_op("ragserve::write_kv_layer", mutates_args=("kv",))
def write_kv_layer(kv: torch.Tensor, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """kv[slot's block, layer, 0/1, slot's offset] = key/value. An opaque in-place op: traced as a plain
    index_put on a view of the cache, functionalization would copy the whole cache per layer."""
    # a flat [num_blocks * layers * 2 * block_size, KVH * D] view: one index_copy_ per K and V
    _, layers, _, bs, kvh, d = kv.shape
    rows = slots // bs * (layers * 2 * bs) + layer * 2 * bs + slots % bs
    flat = kv.view(-1, kvh * d)
    flat.index_copy_(0, rows, key.reshape(-1, kvh * d).to(kv.dtype))
    flat.index_copy_(0, rows + bs, value.reshape(-1, kvh * d).to(kv.dtype))


@write_kv_layer.register_fake
def _(kv: torch.Tensor, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    return None


@dataclass
class GraphLayerCache:
    """A layer of the whole cache tensor, as the compiled graph sees it (the cache itself is the input)."""

    kv: torch.Tensor  # [num_blocks, num_layers, 2, block_size, KVH, D]
    layer: int

    @property
    def data(self) -> torch.Tensor:
        return self.kv[:, self.layer]


class GraphDecodeAttention:
    """An AttentionBackend for one-query-per-sequence steps traced by torch.compile."""

    name = "graph-decode"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: GraphLayerCache, slot_mapping: torch.Tensor):
        torch.ops.ragserve.write_kv_layer(cache.kv, cache.layer, slot_mapping, key, value)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: GraphLayerCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_decode_attention(query, cache.data, meta.block_tables, meta.seq_lens, scale)


def paged_decode_attention(
    query: torch.Tensor, data: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [B, H, D]; data [num_blocks, 2, block_size, KVH, D]; block_tables [B, W]; seq_lens [B].

    Returns [B, H, D]. Query head h reads KV head h // (H / KVH), as HF's repeat_kv."""
    b, h, d = query.shape
    _, _, bs, kvh, _ = data.shape
    w = block_tables.shape[1]
    q = query.float().view(b, 1, kvh, h // kvh, d)
    ids = block_tables.long()
    k = data[:, 0][ids].view(b, w * bs, kvh, 1, d)  # fused into the reduction below, not materialised
    v = data[:, 1][ids].view(b, w * bs, kvh, 1, d)
    scores = (q * k.float()).sum(-1) * scale  # [B, L, KVH, G]
    valid = torch.arange(w * bs, device=query.device)[None, :] < seq_lens[:, None]
    scores = scores.masked_fill(~valid[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs[..., None] * v.float()).sum(1)  # [B, KVH, G, D]
    return out.reshape(b, h, d).to(query.dtype)
