"""Optional Redis tier: one string per block, PREFIX<layout hex>:<hash hex> -> record, LRU within a byte budget.

The budget is this replica's: give replicas that share a Redis distinct prefixes.
On start the index is rebuilt by scanning PREFIX* (oldest OBJECT IDLETIME first).
Redis being down is a miss (reads) or a dropped block (writes), never an error.
"""

from __future__ import annotations

import logging

import redis

from ragserve.keys import HASH_BYTES
from ragserve.v1 import cachestore_pb2 as pb
from ragserve_cachestore.lru import LRUIndex
from ragserve_cachestore.record import LAYOUT_BYTES, StoredBlock, decode, encode_header
from ragserve_cachestore.tiers import TierError

log = logging.getLogger(__name__)


class RedisTier:
    kind = pb.TIER_REDIS
    name = "redis"

    def __init__(self, url: str, capacity: int, prefix: str = "ragserve:kv:", timeout_s: float = 2.0) -> None:
        self.prefix = prefix
        self.index = LRUIndex(capacity)
        try:
            self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            self._redis.ping()
            self._rebuild()
        except (redis.RedisError, ValueError) as exc:
            raise ValueError(f"redis tier: cannot use {_redact(url)}: {exc}") from None

    def rkey(self, key: bytes) -> str:
        return f"{self.prefix}{key[:LAYOUT_BYTES].hex()}:{key[LAYOUT_BYTES:].hex()}"

    def read(self, key: bytes) -> StoredBlock:
        try:
            record = self._redis.get(self.rkey(key))
        except redis.RedisError as exc:
            raise TierError(f"redis GET: {exc}") from exc
        if record is None:
            raise KeyError(key)
        return decode(key, record)

    def write(self, key: bytes, block: StoredBlock) -> bool:
        try:
            self._redis.set(self.rkey(key), encode_header(key, block) + block.data)
        except redis.RedisError as exc:
            log.warning("redis tier: SET failed: %s", exc)
            return False
        self.index.add(key, block.size)
        return True

    def remove(self, key: bytes) -> None:
        self.index.discard(key)
        try:
            self._redis.delete(self.rkey(key))
        except redis.RedisError as exc:
            log.warning("redis tier: DEL failed: %s", exc)

    def _rebuild(self) -> None:
        names = list(self._redis.scan_iter(match=f"{self.prefix}*", count=1000))
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
            pipe.object("idletime", name)
        replies = pipe.execute(raise_on_error=False)  # OBJECT IDLETIME fails under an LFU maxmemory-policy
        found = []
        for i, name in enumerate(names):
            key = self._parse(name.decode(errors="replace"))
            size, idle = replies[2 * i], replies[2 * i + 1]
            if key is not None and isinstance(size, int):
                found.append((-idle if isinstance(idle, int) else 0, key, size))
        found.sort()
        self.index.fill(((key, size) for _, key, size in found), lambda key: self._redis.delete(self.rkey(key)))
        log.info("redis tier: %d blocks, %d bytes", len(self.index), self.index.used)

    def _parse(self, name: str) -> bytes | None:
        layout, _, block = name[len(self.prefix) :].partition(":")
        try:
            key = bytes.fromhex(layout) + bytes.fromhex(block)
        except ValueError:
            return None
        return key if len(key) == LAYOUT_BYTES + HASH_BYTES and len(layout) == 2 * LAYOUT_BYTES else None


def _redact(url: str) -> str:
    """Hide a password in redis://user:pass@host."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest
