"""The attention backend interface and the per-step metadata every backend reads.

The KV cache is block-major: ``data[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``,
so one block's K and V for all layers are contiguous (offloading a block is one copy).
A slot is ``block_id * block_size + offset``; slot -1 marks padding that is never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


def slot_mapping(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The slot of each token: token i is at `positions[i]` of the sequence whose block table is
    `tables[rows[i]]`."""
    return tables[rows, positions // block_size] * block_size + positions % block_size


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V goes
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class LayerKVCache:
    """One layer's view of the paged cache (and its quantization scales, if any)."""

    data: torch.Tensor  # [num_blocks, 2, block_size, num_kv_heads, head_dim] (strided view)
    kv_dtype: str = "auto"
    scales: torch.Tensor | None = None  # int8: [num_blocks, 2, block_size, num_kv_heads] float32, per token per head
    k_scale: float = 1.0  # fp8: per-tensor scales (stored = value / scale)
    v_scale: float = 1.0

    @property
    def block_size(self) -> int:
        return self.data.shape[2]


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        """Scatter new K/V ([num_tokens, num_kv_heads, head_dim]) into their slots."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of each sequence's new queries over its whole context.

        query: [num_tokens, num_heads, head_dim]; key/value: this step's new K/V, already
        written to the cache. Returns [num_tokens, num_heads, head_dim].
        """
