"""What the cachestore holds, for kv_aware: a batched Lookup per routed prompt, remembered briefly.

A block in the store is fetchable by every engine that uses that store (the store an engine
reports in its heartbeat), so a hot prefix computed once need not pin traffic to its first engine.
Blocks found are remembered for `--store-lookup-ttl` seconds, so a prompt that extends a known
prefix (the next round of a chat) asks only about its new blocks. The store being down or slow
costs nothing but this knowledge: lookups have a short deadline and a failing store is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

from ragserve.router_args import RouterConfig
from ragserve_cachestore.client import CacheStoreClient, TLSConfig

log = logging.getLogger(__name__)
LOOKUP_TIMEOUT_S = 0.1
MAX_REMEMBERED = 200_000  # blocks per store and layout


class StoreIndex:
    def __init__(self, cfg: RouterConfig, clock=time.monotonic) -> None:
        self.ttl_s = cfg.store_lookup_ttl
        self._clock = clock
        self._token = None
        if cfg.cachestore_token_file:
            from ragserve.token_auth import read_token

            self._token = read_token(cfg.cachestore_token_file)
        self._tls = None
        if cfg.cachestore_tls_ca or cfg.cachestore_tls_cert:
            self._tls = TLSConfig(cfg.cachestore_tls_ca, cfg.cachestore_tls_cert, cfg.cachestore_tls_key)
        self._clients: dict[tuple[str, str], CacheStoreClient] = {}
        self._known: dict[tuple[str, str], OrderedDict[bytes, float]] = {}

    async def leading(self, address: str, layout: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the chain `hashes` the store at `address` holds (0 when it cannot say)."""
        if self.ttl_s <= 0 or not hashes:
            return 0
        known = self._known.setdefault((address, layout), OrderedDict())
        now = self._clock()
        n = 0
        while n < len(hashes) and known.get(hashes[n], 0.0) > now:
            n += 1
        if n == len(hashes):
            return n
        try:
            found = await asyncio.to_thread(self._client(address, layout).lookup, hashes[n:])
        except Exception as exc:  # a bad address or layout: route as if the store were empty
            log.warning("cachestore %s lookup failed: %s", address, exc)
            return n
        expires = self._clock() + self.ttl_s
        for h in hashes[n : n + found]:
            known[h] = expires
            known.move_to_end(h)
        while len(known) > MAX_REMEMBERED:
            known.popitem(last=False)
        return n + found

    def _client(self, address: str, layout: str) -> CacheStoreClient:
        client = self._clients.get((address, layout))
        if client is None:
            client = CacheStoreClient(address, layout, LOOKUP_TIMEOUT_S, tls=self._tls, token=self._token)
            self._clients[(address, layout)] = client
        return client

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
