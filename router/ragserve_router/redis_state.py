"""Router state in Redis, shared by all router replicas.

Keys (under the prefix): `engines` hash id -> EngineRecord JSON; `alive:<id>` expires
after 3 missed heartbeats; `seq:<id>` last applied KV-event seq; `blocks:<id>` set of
block hashes; `tok:<fingerprint>` tokenizer JSON; `approx:<hash hex>` hash engine ->
time routed (expires after the approximate TTL) and `approx_lru` bounding their number; `admin:<set>` the
admin API's draining, added and removed engine URLs (admin_view.py).

Redis is a cache of state, not its owner: each replica remembers the engines registered through it
and publishes them again when Redis lost them (a restart without persistence), then asks each such
engine to register again (its heartbeat answers known=false) so that its KV index is rebuilt. While
Redis is unreachable, heartbeats of those engines still succeed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ragserve_router.admin_view import ADMIN_SETS, AdminChange, AdminView
from ragserve_router.engines import EngineRecord, Load, TokenizerBlob
from ragserve_router.state import CLEARED, REMOVED, STORED, KVOp, RouterState, leading

log = logging.getLogger(__name__)
REJOIN_GRACE_S = 15.0  # an engine's registration backoff tops out at 10 s
# a heartbeat's write, only while the engine is registered: one that read the record as a Deregister dropped it
# must not bring it back (it would then be dropped again for missed heartbeats)
UPDATE_REGISTERED = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
return 1
"""


@dataclass
class Owned:
    """An engine registered through this replica: enough to publish it again."""

    record: EngineRecord
    tokenizer: TokenizerBlob
    ttl_s: float
    seen: float = field(default_factory=time.monotonic)  # its last registration or heartbeat here

    def recent(self) -> bool:
        """Heard from lately: alive, or retrying its registration while Redis was away."""
        return time.monotonic() - self.seen < self.ttl_s + REJOIN_GRACE_S


class RedisState(RouterState):
    def __init__(self, url: str, prefix: str = "ragserve:", approx_ttl: float = 600.0, approx_max: int = 200_000):
        self.redis = aioredis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self.p = prefix
        self.approx_ttl = approx_ttl
        self.approx_max = approx_max
        self.owned: dict[str, Owned] = {}
        self.resync: set[str] = set()  # published again after Redis lost them: must register again
        self._update_registered = self.redis.register_script(UPDATE_REGISTERED)

    def _k(self, *parts: str) -> str:
        return self.p + ":".join(parts)

    async def _publish(self, owned: Owned) -> int:
        """Write the engine's record, liveness and tokenizer; returns its last applied KV-event seq."""
        record = owned.record
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("tok", record.tokenizer_fingerprint), owned.tokenizer.to_json(), nx=True)
            pipe.hset(self._k("engines"), record.engine_id, record.to_json())
            pipe.set(self._k("alive", record.engine_id), b"1", px=int(owned.ttl_s * 1000))
            pipe.get(self._k("seq", record.engine_id))
            *_, seq = await pipe.execute()
        return int(seq or 0)

    async def register(self, record: EngineRecord, tokenizer: TokenizerBlob, ttl_s: float) -> int:
        owned = Owned(record, tokenizer, ttl_s)
        seq = await self._publish(owned)
        self.owned[record.engine_id] = owned
        self.resync.discard(record.engine_id)
        return seq

    async def heartbeat(self, engine_id: str, load: Load, ttl_s: float) -> bool:
        owned = self.owned.get(engine_id)
        if owned is not None:
            owned.record.load, owned.seen = load, time.monotonic()
        try:
            raw = await self.redis.hget(self._k("engines"), engine_id)
            if raw is None and owned is not None:
                await self._republish([engine_id])
                raw = owned.record.to_json()
            if raw is None:
                return False
            record = EngineRecord.from_json(raw)
            record.load = load
            keys = [self._k("engines"), self._k("alive", engine_id)]
            if not await self._update_registered(keys=keys, args=[engine_id, record.to_json(), int(ttl_s * 1000)]):
                return False  # dropped (deregistered) since the read: not brought back
        except (RedisError, OSError):
            if owned is None:
                raise
            return True  # this replica still knows the engine; Redis will be told when it is back
        if engine_id in self.resync:
            self.resync.discard(engine_id)
            return False  # register again: its KV index went with Redis
        return True

    async def _republish(self, engine_ids: list[str]) -> None:
        for engine_id in engine_ids:
            log.warning("engine %s was missing from Redis (restarted?): published again", engine_id)
            await self._publish(self.owned[engine_id])
            self.resync.add(engine_id)

    async def drop(self, engine_id: str) -> bool:
        self.owned.pop(engine_id, None)
        self.resync.discard(engine_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._k("engines"), engine_id)
            for part in ("alive", "seq", "blocks"):
                pipe.delete(self._k(part, engine_id))
            self._forget_routes(pipe, engine_id)
            removed, *_ = await pipe.execute()
        return bool(removed)

    def _forget_routes(self, pipe, engine_id: str) -> None:
        """Routes to the engine recorded until now no longer imply its blocks (it was dropped or cleared its
        cache). Routes are spread over one key per block hash, so instead of finding them all, a per-engine
        epoch hides the older ones; it expires with them, after approx_ttl."""
        pipe.set(self._k("approx_epoch", engine_id), repr(time.time()), px=int(self.approx_ttl * 1000))

    async def _records(self) -> tuple[list[EngineRecord], list[bool]]:
        raw = await self.redis.hgetall(self._k("engines"))
        missing = [e for e in self.owned if e.encode() not in raw]
        for engine_id in missing:
            if not self.owned[engine_id].recent():  # dropped by another replica, and silent here too
                del self.owned[engine_id]
        if lost := [e for e in missing if e in self.owned]:
            await self._republish(lost)
            raw |= {e.encode(): self.owned[e].record.to_json() for e in lost}
        records = [EngineRecord.from_json(v) for v in raw.values()]
        async with self.redis.pipeline(transaction=False) as pipe:
            for record in records:
                pipe.exists(self._k("alive", record.engine_id))
            alive = await pipe.execute() if records else []
        return records, [bool(a) for a in alive]

    async def engines(self) -> list[EngineRecord]:
        records, alive = await self._records()
        return [r for r, ok in zip(records, alive, strict=True) if ok]

    async def expired(self) -> list[str]:
        records, alive = await self._records()
        return [r.engine_id for r, ok in zip(records, alive, strict=True) if not ok]

    async def is_registered(self, engine_id: str) -> bool:
        return bool(await self.redis.hexists(self._k("engines"), engine_id))

    async def tokenizer(self, fingerprint: str) -> TokenizerBlob | None:
        raw = await self.redis.get(self._k("tok", fingerprint))
        return TokenizerBlob.from_json(raw) if raw else None

    async def last_seq(self, engine_id: str) -> int:
        return int(await self.redis.get(self._k("seq", engine_id)) or 0)

    async def apply(self, engine_id: str, ops: list[KVOp], new_seq: int) -> None:
        key = self._k("blocks", engine_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            for op in ops:
                if op.kind == STORED and op.hashes:
                    pipe.sadd(key, *op.hashes)
                elif op.kind == REMOVED and op.hashes:
                    pipe.srem(key, *op.hashes)
                    for h in op.hashes:  # an eviction newer than a route there: the route no longer implies it
                        pipe.hdel(self._k("approx", h.hex()), engine_id)
                elif op.kind == CLEARED:
                    pipe.delete(key)
                    self._forget_routes(pipe, engine_id)
            pipe.set(self._k("seq", engine_id), new_seq)
            await pipe.execute()

    async def num_blocks(self, engine_id: str) -> int:
        return int(await self.redis.scard(self._k("blocks", engine_id)))

    async def match_exact(self, engine_ids: Sequence[str], hashes: Sequence[bytes]) -> dict[str, int]:
        if not hashes or not engine_ids:
            return dict.fromkeys(engine_ids, 0)
        async with self.redis.pipeline(transaction=False) as pipe:
            for engine_id in engine_ids:
                pipe.smismember(self._k("blocks", engine_id), list(hashes))
            results = await pipe.execute()
        return {e: leading(hits) for e, hits in zip(engine_ids, results, strict=True)}

    async def record_route(self, hashes: Sequence[bytes], engine_id: str) -> None:
        now = time.time()
        ttl_ms = int(self.approx_ttl * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            for h in hashes:
                key = self._k("approx", h.hex())
                pipe.hset(key, engine_id, repr(now))
                pipe.pexpire(key, ttl_ms)
            if hashes:
                pipe.zadd(self._k("approx_lru"), {h.hex(): now + i * 1e-6 for i, h in enumerate(hashes)})
                await pipe.execute()

    async def match_approx(self, ttl_by_engine: dict[str, float], hashes: Sequence[bytes]) -> dict[str, int]:
        engine_ids = list(ttl_by_engine)
        if not hashes or not engine_ids:
            return dict.fromkeys(engine_ids, 0)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.mget([self._k("approx_epoch", e) for e in engine_ids])
            for h in hashes:
                pipe.hmget(self._k("approx", h.hex()), engine_ids)
            epochs, *rows = await pipe.execute()
        now = time.time()
        out = {}
        for i, engine_id in enumerate(engine_ids):
            oldest = max(now - ttl_by_engine[engine_id], float(epochs[i] or "-inf"))
            out[engine_id] = leading(row[i] is not None and float(row[i]) > oldest for row in rows)
        return out

    async def trim_approx(self) -> int:
        """Enforce the approximate index's size bound; returns how many entries were evicted."""
        excess = int(await self.redis.zcard(self._k("approx_lru"))) - self.approx_max
        if excess <= 0:
            return 0
        evicted = await self.redis.zpopmin(self._k("approx_lru"), excess)
        if evicted:
            await self.redis.delete(*(self._k("approx", member.decode()) for member, _ in evicted))
        return len(evicted)

    async def admin_view(self) -> AdminView:
        async with self.redis.pipeline(transaction=True) as pipe:
            for name in ADMIN_SETS:
                pipe.smembers(self._k("admin", name))
            sets = await pipe.execute()
        urls = (frozenset(url.decode() for url in members) for members in sets)
        return AdminView(**dict(zip(ADMIN_SETS, urls, strict=True)))

    async def admin_change(self, change: AdminChange) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for name, urls in change.discard.items():
                pipe.srem(self._k("admin", name), *urls)
            for name, urls in change.add.items():
                pipe.sadd(self._k("admin", name), *urls)
            await pipe.execute()

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except Exception:
            return False

    async def close(self) -> None:
        await self.redis.aclose()
