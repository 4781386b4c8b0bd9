"""Router state several replicas must agree on: the engine registry and the KV indexes.

`MemoryState` (router/memory_state.py) keeps it in one process; `RedisState`
(router/redis_state.py) shares it through Redis. Both implement this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from ragserve.v1 import registry_pb2
from ragserve_router.admin_view import AdminChange, AdminView
from ragserve_router.engines import EngineRecord, Load, TokenizerBlob

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass
class KVOp:
    kind: str  # STORED | REMOVED | CLEARED
    hashes: list[bytes]


def plan_events(last_seq: int, events: Sequence[registry_pb2.KVEvent]) -> tuple[list[KVOp], int]:
    """Ops to apply in order and the new last seq: duplicates are skipped, a gap stops the batch."""
    ops: list[KVOp] = []
    for event in events:
        if event.seq <= last_seq:
            continue
        if event.seq != last_seq + 1:
            break
        kind = event.WhichOneof("event")
        if kind == STORED:
            ops.append(KVOp(STORED, list(event.stored.block_hashes)))
        elif kind == REMOVED:
            ops.append(KVOp(REMOVED, list(event.removed.block_hashes)))
        elif kind == CLEARED:
            ops.append(KVOp(CLEARED, []))
        last_seq = event.seq
    return ops, last_seq


def leading(hits: Sequence[object]) -> int:
    """Length of the run of truthy values at the start (a prefix hit needs every earlier block)."""
    n = 0
    for hit in hits:
        if not hit:
            break
        n += 1
    return n


class RouterState(ABC):
    """Registry of gRPC-registered engines, exact KV index from their events, approximate routing history."""

    @abstractmethod
    async def register(self, record: EngineRecord, tokenizer: TokenizerBlob, ttl_s: float) -> int:
        """Add or refresh an engine; returns the last KV-event seq applied for it (0: unknown)."""

    @abstractmethod
    async def heartbeat(self, engine_id: str, load: Load, ttl_s: float) -> bool:
        """Refresh liveness and load; False if the engine is unknown."""

    @abstractmethod
    async def drop(self, engine_id: str) -> bool:
        """Forget an engine and its blocks; False if it was unknown."""

    @abstractmethod
    async def engines(self) -> list[EngineRecord]:
        """Live registered engines."""

    @abstractmethod
    async def expired(self) -> list[str]:
        """Engines whose heartbeats stopped (not yet dropped)."""

    @abstractmethod
    async def is_registered(self, engine_id: str) -> bool: ...

    @abstractmethod
    async def tokenizer(self, fingerprint: str) -> TokenizerBlob | None: ...

    @abstractmethod
    async def last_seq(self, engine_id: str) -> int: ...

    @abstractmethod
    async def apply(self, engine_id: str, ops: list[KVOp], new_seq: int) -> None:
        """Apply KV ops to the engine's block set and record new_seq, atomically."""

    @abstractmethod
    async def num_blocks(self, engine_id: str) -> int: ...

    @abstractmethod
    async def match_exact(self, engine_ids: Sequence[str], hashes: Sequence[bytes]) -> dict[str, int]:
        """Per engine, how many leading hashes it holds according to its KV events."""

    @abstractmethod
    async def record_route(self, hashes: Sequence[bytes], engine_id: str) -> None:
        """Remember that these blocks were just sent to engine_id (the approximate index)."""

    def record_route_now(self, hashes: Sequence[bytes], engine_id: str) -> bool:
        """record_route done at once where the index is in process (True); False: await record_route instead."""
        return False

    @abstractmethod
    async def match_approx(self, ttl_by_engine: dict[str, float], hashes: Sequence[bytes]) -> dict[str, int]:
        """Per engine, how many leading hashes were routed to it within its TTL."""

    @abstractmethod
    async def trim_approx(self) -> int:
        """Enforce the approximate index's size bound; returns how many entries were evicted."""

    @abstractmethod
    async def admin_view(self) -> AdminView:
        """What the admin API drained, added and removed (admin_view.py)."""

    @abstractmethod
    async def admin_change(self, change: AdminChange) -> None:
        """Apply the admin API's set updates atomically."""

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
