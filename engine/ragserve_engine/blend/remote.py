"""Chunk K/V in the cachestore, so every engine computes a chunk once (docs/blend.md).

A chunk's K/V ([num_layers, 2, n, kvh, d]) travels as ceil(n / block_size) zero-padded records in the
engine's block layout ([num_layers, 2, block_size, kvh, d]), keyed SHA-256(chunk key | u32le(i)), under
the engine's layout namespace like its prefix blocks. Stores happen on a background thread.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragserve.chunks import chunk_record_keys
from ragserve.keys import KVLayout

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RemoteStats:
    hits: int = 0
    misses: int = 0
    stored: int = 0


class RemoteChunks:
    def __init__(self, client, layout: KVLayout) -> None:
        self.client = client
        self.layout = layout  # the engine's: its block size is the records' size
        self.stats = RemoteStats()
        self._puts = ThreadPoolExecutor(1, thread_name_prefix="chunk-offload")

    def record_keys(self, key: bytes, num_tokens: int) -> list[bytes]:
        return chunk_record_keys(key, num_tokens, self.layout.block_size)

    def get(self, key: bytes, num_tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        keys = self.record_keys(key, num_tokens)
        try:
            blocks = self.client.get(keys)
        except Exception as exc:  # the cachestore is an optimisation: compute instead
            log.warning("chunk fetch failed: %s", exc)
            blocks = []
        if len(blocks) < len(keys) or any(b.dtype not in _DTYPES for b in blocks):
            self.stats.misses += 1
            return None
        parts = [torch.frombuffer(bytearray(b.data), dtype=_DTYPES[b.dtype]).view(tuple(b.shape)) for b in blocks]
        self.stats.hits += 1
        return torch.cat(parts, dim=2)[:, :, :num_tokens].to(device=device, dtype=dtype)

    def put(self, key: bytes, kv: torch.Tensor) -> None:
        """Queue the chunk's records for the cachestore (kv: [num_layers, 2, n, kvh, d])."""
        self._puts.submit(self._put, key, kv.to("cpu"))

    def _put(self, key: bytes, kv: torch.Tensor) -> None:
        from ragserve_cachestore.client import KVBlock

        n, bs = kv.shape[2], self.layout.block_size
        padded = F.pad(kv, (0, 0, 0, 0, 0, -n % bs))
        name = str(kv.dtype).removeprefix("torch.")
        blocks = []
        for i, k in enumerate(self.record_keys(key, n)):
            part = padded[:, :, i * bs : (i + 1) * bs].contiguous()
            blocks.append(KVBlock(k, part.view(torch.uint8).numpy().tobytes(), name, tuple(part.shape)))
        try:
            self.stats.stored += self.client.put(blocks)
        except Exception as exc:
            log.warning("chunk offload failed: %s", exc)

    def flush(self) -> None:
        """Wait for queued stores (tests, shutdown)."""
        self._puts.submit(lambda: None).result()
