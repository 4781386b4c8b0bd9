"""CacheStoreConnector: the engine side of the shared KV-block store (best effort, never fatal).

On admission, full prompt blocks past the local prefix hit are looked up in the cachestore,
fetched, written into free paged-cache blocks and registered under their hash, so the request
prefills only the rest. After each step, newly cached blocks are offloaded by a background
thread through a bounded queue (dropped under backpressure, never blocking the step loop).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ragserve_engine.attention.kv_cache import KVCacheTensors
from ragserve_engine.block_pool import KVCacheBlock
from ragserve_engine.kv_cache_manager import KVCacheManager

log = logging.getLogger("ragserve_engine.connector")
_SEEN_LIMIT = 1 << 16


@dataclass
class ConnectorStats:
    queries: int = 0  # tokens looked up in the cachestore
    hits: int = 0  # tokens fetched from it
    offloaded: int = 0  # blocks handed to the store
    dropped: int = 0  # blocks dropped under backpressure


class CacheStoreConnector:
    def __init__(self, client, kv_cache: KVCacheTensors, kv_manager: KVCacheManager, queue_blocks: int = 512) -> None:
        self.client = client
        self.kv_cache, self.kv_manager = kv_cache, kv_manager
        self.block_size = kv_manager.block_size
        self.stats = ConnectorStats()
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # stored or fetched recently: skip offload
        self._queue: queue.Queue = queue.Queue(maxsize=queue_blocks)
        self._thread = threading.Thread(target=self._offload_loop, name="kv-offload", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls, config, layout: str, kv_cache: KVCacheTensors, kv_manager: KVCacheManager
    ) -> CacheStoreConnector:
        from ragserve_cachestore.auth import read_token
        from ragserve_cachestore.client import CacheStoreClient, TLSConfig

        tls = None
        if config.cachestore_tls_ca or config.cachestore_tls_cert:
            tls = TLSConfig(config.cachestore_tls_ca, config.cachestore_tls_cert, config.cachestore_tls_key)
        token = read_token(config.cachestore_token_file) if config.cachestore_token_file else None
        client = CacheStoreClient(config.cachestore, layout, timeout_s=2.0, tls=tls, token=token)
        return cls(client, kv_cache, kv_manager)

    # ---- fetch ------------------------------------------------------------------------------------
    def fetch(self, hashes: list[bytes], num_local_hits: int) -> int:
        """Load blocks hashes[num_local_hits:] that a peer computed; returns how many were added to the cache."""
        missing = hashes[num_local_hits:]
        if not missing:
            return 0
        self.stats.queries += len(missing) * self.block_size
        try:
            n = self.client.lookup(missing)
            blocks = self.client.get(missing[:n]) if n else []
        except Exception:  # a broken store costs a miss, never a request
            log.exception("cachestore fetch failed")
            return 0
        blocks = [b for b in blocks if self._fits(b)]
        blocks = blocks[: self.kv_manager.num_importable_blocks()]
        if not blocks:
            return 0
        fetched = missing[: len(blocks)]
        parent = hashes[num_local_hits - 1] if num_local_hits else None
        self.kv_manager.import_blocks(fetched, parent, lambda i, block_id: self._write(block_id, blocks[i].data))
        for h in fetched:
            self._remember(h)
        self.stats.hits += len(blocks) * self.block_size
        return len(blocks)

    def _fits(self, block) -> bool:
        return len(block.data) == self._block_nbytes()

    def _block_nbytes(self) -> int:
        n = self.kv_cache.data[0].numel() * self.kv_cache.data.element_size()
        if self.kv_cache.scales is not None:
            n += self.kv_cache.scales[0].numel() * self.kv_cache.scales.element_size()
        return n

    def _write(self, block_id: int, data: bytes) -> None:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = self.kv_cache.data[0].numel() * self.kv_cache.data.element_size()
        dst = self.kv_cache.data[block_id]
        dst.copy_(raw[:size].view(dst.dtype).view(dst.shape).to(dst.device))
        if self.kv_cache.scales is not None:
            sdst = self.kv_cache.scales[block_id]
            sdst.copy_(raw[size:].view(sdst.dtype).view(sdst.shape).to(sdst.device))

    # ---- offload ----------------------------------------------------------------------------------
    def offload(self, blocks: list[tuple[KVCacheBlock, bytes]]) -> None:
        """Queue newly cached (block, hash) pairs; copies the bytes now, sends them later."""
        todo = [(b, h) for b, h in blocks if h not in self._seen]
        if not todo:
            return
        ids = [b.block_id for b, _ in todo]
        data = self.kv_cache.data[ids].cpu()
        scales = self.kv_cache.scales[ids].cpu() if self.kv_cache.scales is not None else None
        for i, (_, h) in enumerate(todo):
            raw = data[i].contiguous().view(torch.uint8).numpy().tobytes()
            if scales is not None:
                raw += scales[i].contiguous().view(torch.uint8).numpy().tobytes()
            try:
                self._queue.put_nowait((h, raw))
                self._remember(h)
            except queue.Full:
                self.stats.dropped += 1

    def _offload_loop(self) -> None:
        from ragserve_cachestore.client import KVBlock

        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None and len(batch) < 64:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            blocks = [KVBlock(h, raw, "uint8", (len(raw),)) for h, raw in (i for i in batch if i is not None)]
            try:
                if blocks:
                    self.stats.offloaded += self.client.put(blocks)  # blocks newly stored
            except Exception:
                log.exception("cachestore offload failed")
            for _ in batch:
                self._queue.task_done()
            if batch[-1] is None:
                return

    def _remember(self, h: bytes) -> None:
        self._seen[h] = None
        self._seen.move_to_end(h)
        if len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)

    def flush(self) -> None:
        """Wait until every queued offload was sent (each put has a deadline)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self.client.close()
