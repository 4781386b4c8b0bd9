"""Torch reference attention backend: batched gathers and SDPA, runs on any device and every KV dtype.

A step's sequences attend in few padded SDPA calls per layer, whatever the batch size: the decodes (one
query each) in one per context-length band (contexts within PAD_RATIO of each other) and one for the prefills
(chunks, with or without a cached prefix).
The per-step plan (padded token indices, block ids, masks) is built once and shared by every layer.
Padded key columns read real cache blocks (the cache is zero-initialised and only ever holds finite
values) and are masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ragserve_engine.attention import quant
from ragserve_engine.attention.backend import AttentionMetadata, LayerKVCache

PAD_RATIO = 4  # decodes share a padded SDPA call while their contexts are within this ratio (by_length)


@dataclass
class AttentionGroup:
    """Sequences attended in one padded SDPA call: queries [G, Q], keys [G, L]."""

    token_idx: torch.Tensor  # [G, Q] each query row's index into the step's tokens (padding rows: 0)
    span: tuple[int, int] | None  # G == 1 and its queries are tokens[a:b]: slice instead of gather
    real_rows: torch.Tensor | None  # flat indices into [G * Q] of the real rows; None: all rows are real
    dst: torch.Tensor  # [num real rows] their token indices (where the output goes)
    block_ids: torch.Tensor | None  # [G, NB] blocks to gather keys from; None: fresh K/V (nothing cached)
    key_len: int  # L
    mask: torch.Tensor | None  # [G, 1, Q, L] bool, True = attend
    is_causal: bool


def plan_groups(meta: AttentionMetadata, block_size: int, quantized: bool) -> list[AttentionGroup]:
    starts = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
    q_lens, ctxs = np.diff(starts), np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    seqs = np.arange(len(ctxs))
    groups = [*by_length(seqs[q_lens == 1], ctxs), seqs[q_lens > 1]]
    return [_group(meta, s, starts[s], q_lens[s], ctxs[s], block_size, quantized) for s in groups if len(s)]


def by_length(seqs: np.ndarray, ctxs: np.ndarray) -> list[np.ndarray]:
    """Decodes in groups whose contexts are within PAD_RATIO of the group's longest: a 2k-token RAG answer
    decoding beside short chats would otherwise pad every chat's keys to 2k (gathered and attended)."""
    groups, rest = [], seqs[np.argsort(-ctxs[seqs], kind="stable")]
    while len(rest):
        n = int(np.searchsorted(-ctxs[rest], -ctxs[rest[0]] / PAD_RATIO, side="right"))
        groups.append(np.sort(rest[:n]))
        rest = rest[n:]
    return groups


def _group(meta, seqs, starts, q_lens, ctxs, block_size: int, quantized: bool) -> AttentionGroup:
    device = meta.slot_mapping.device
    n_rows = int(q_lens.max())
    fresh = not quantized and bool((q_lens == ctxs).all())  # nothing cached: attend over this step's K/V
    key_len = n_rows if fresh else int(ctxs.max())
    rows = np.arange(n_rows)
    real = rows[None, :] < q_lens[:, None]
    token_idx = np.where(real, starts[:, None] + rows[None, :], 0)
    # last key column each row may see: causal over the context; padding rows see column 0 only
    limit = np.where(real, (ctxs - q_lens)[:, None] + rows[None, :], 0)
    uniform = bool(real.all()) and bool((ctxs == key_len).all())
    mask, is_causal = None, False
    if uniform and (n_rows == 1 or fresh):
        is_causal = n_rows > 1
    else:
        mask = torch.from_numpy(np.arange(key_len)[None, None, :] <= limit[:, :, None]).unsqueeze(1).to(device)
    flat_real = np.flatnonzero(real.reshape(-1))
    block_ids = None
    if not fresh:
        block_ids = meta.block_tables[torch.from_numpy(seqs).to(device), : -(-key_len // block_size)].long()
    return AttentionGroup(
        token_idx=torch.from_numpy(token_idx).to(device),
        span=(int(starts[0]), int(starts[0] + q_lens[0])) if len(seqs) == 1 else None,
        real_rows=None if real.all() else torch.from_numpy(flat_real).to(device),
        dst=torch.from_numpy(token_idx.reshape(-1)[flat_real]).to(device),
        block_ids=block_ids,
        key_len=key_len,
        mask=mask,
        is_causal=is_causal,
    )


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._plan_meta: AttentionMetadata | None = None  # the plan is rebuilt when the step's metadata changes
        self._plan: list[AttentionGroup] = []
        self._slots_src: tuple[torch.Tensor, int] | None = None
        self._slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def _slot_plan(self, slot_mapping: torch.Tensor, block_size: int):
        if self._slots_src is None or self._slots_src[0] is not slot_mapping or self._slots_src[1] != block_size:
            valid = slot_mapping >= 0
            keep = None if bool(valid.all()) else valid
            slots = slot_mapping if keep is None else slot_mapping[keep]
            self._slots_src, self._slots = (slot_mapping, block_size), (slots // block_size, slots % block_size, keep)
        return self._slots

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        blocks, offsets, keep = self._slot_plan(slot_mapping, cache.block_size)
        if keep is not None:
            key, value = key[keep], value[keep]
        for kv, x, scale in ((0, key, cache.k_scale), (1, value, cache.v_scale)):
            q, scales = quant.quantize(x, cache.kv_dtype, cache.data.dtype, scale)
            cache.data[blocks, kv, offsets] = q
            if scales is not None:
                cache.scales[blocks, kv, offsets] = scales

    def gather_kv(
        self, cache: LayerKVCache, block_table: torch.Tensor, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first seq_len K and V as [seq_len, num_kv_heads, head_dim], dequantized."""
        ids = block_table[: -(-seq_len // cache.block_size)].long()[None]
        k, v = gather_padded_kv(cache, ids, seq_len)
        return k[0], v[0]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta is not self._plan_meta:
            quantized = quant.quant_mode(cache.kv_dtype) != quant.QUANT_NONE
            self._plan_meta, self._plan = meta, plan_groups(meta, cache.block_size, quantized)
        out = torch.empty_like(query)
        for g in self._plan:
            out[g.dst] = _attend_group(g, query, key, value, cache, scale)
        return out


def gather_padded_kv(cache: LayerKVCache, block_ids: torch.Tensor, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks block_ids [G, NB] as [G, key_len, num_kv_heads, head_dim], dequantized."""
    g, nb = block_ids.shape
    flat_ids = block_ids.reshape(-1)
    out = []
    for i, scale in ((0, cache.k_scale), (1, cache.v_scale)):
        # index_select copies whole blocks (several times faster here than advanced indexing)
        x = cache.data[:, i].index_select(0, flat_ids)  # [G * NB, bs, KVH, D], contiguous
        x = x.view(g, nb * x.shape[1], *x.shape[2:])[:, :key_len]
        s = None
        if cache.scales is not None:
            s = cache.scales[:, i].index_select(0, flat_ids)
            s = s.view(g, nb * s.shape[1], s.shape[2])[:, :key_len]
        out.append(quant.dequantize(x, cache.kv_dtype, scale, s))
    return out[0], out[1]


def _attend_group(g: AttentionGroup, query, key, value, cache: LayerKVCache, scale: float) -> torch.Tensor:
    """The group's real query rows' outputs, [num real rows, H, D]."""

    def rows(x: torch.Tensor) -> torch.Tensor:  # [G, Q, heads, D]
        return x[g.span[0] : g.span[1]][None] if g.span is not None else x[g.token_idx]

    q = rows(query)
    k, v = (rows(key), rows(value)) if g.block_ids is None else gather_padded_kv(cache, g.block_ids, g.key_len)
    # 4-D [G, heads, len, D] inputs take torch's fused CPU kernel; strided K/V are read in place
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2), attn_mask=g.mask,
        is_causal=g.is_causal, scale=scale, enable_gqa=True,
    )  # fmt: skip
    o = o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])  # [G * Q, H, D]
    return o if g.real_rows is None else o[g.real_rows]
