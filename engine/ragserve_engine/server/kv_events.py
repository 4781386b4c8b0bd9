"""KV events for the router: numbered from 1, strictly increasing, kept in a bounded replay buffer.

The engine's step thread appends; the registration task reads. A snapshot (after the router
lost our events) restarts numbering right after the router's last applied seq, so the
router can apply it without a gap.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque

from ragserve.v1 import registry_pb2
from ragserve_engine.engine_client import KVEvent, KVSnapshot

REPLAY_CAPACITY = 100_000  # events
SNAPSHOT_CHUNK = 4096  # hashes per BlocksStored event of a snapshot


def to_proto(events: list[KVEvent]) -> list[dict]:
    """Pool events as KVEvent oneof kwargs; a run of chained stores or of removals becomes one event."""
    out: list[dict] = []
    for ev in events:
        prev = out[-1] if out else None
        if ev.kind == "stored":
            stored = prev.get("stored") if prev else None
            if stored is not None and ev.parent_hash and stored.block_hashes[-1] == ev.parent_hash:
                stored.block_hashes.extend(ev.block_hashes)
                continue
            parent = ev.parent_hash or b""
            out.append({"stored": registry_pb2.BlocksStored(block_hashes=ev.block_hashes, parent_hash=parent)})
        elif ev.kind == "removed":
            if prev and "removed" in prev:
                prev["removed"].block_hashes.extend(ev.block_hashes)
                continue
            out.append({"removed": registry_pb2.BlocksRemoved(block_hashes=ev.block_hashes)})
        elif ev.kind == "cleared":
            out.append({"cleared": registry_pb2.AllBlocksCleared()})
    return out


class KVEventLog:
    def __init__(self, capacity: int = REPLAY_CAPACITY) -> None:
        self._lock = threading.Lock()
        self._events: deque[registry_pb2.KVEvent] = deque(maxlen=capacity)
        self.last_seq = 0
        self._skip = 0  # pool events still pending when a snapshot was taken (the snapshot covers them)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.changed = asyncio.Event()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def _append(self, **kind) -> None:
        self.last_seq += 1
        self._events.append(registry_pb2.KVEvent(seq=self.last_seq, **kind))

    def _notify(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.changed.set)

    def on_events(self, events: list[KVEvent]) -> None:
        """AsyncLLM KV-event listener (step thread)."""
        with self._lock:
            drop = min(self._skip, len(events))
            self._skip -= drop
            for kind in to_proto(events[drop:]):
                self._append(**kind)
        self._notify()

    def snapshot(self, snapshot: KVSnapshot, after_seq: int) -> int:
        """AllBlocksCleared + BlocksStored of every cached hash, numbered from after_seq + 1.

        Runs on the step thread (EngineClient.with_kv_snapshot), so no step changes the cache meanwhile.
        Returns the number of hashes.
        """
        hashes = snapshot.block_hashes
        with self._lock:
            self._skip = snapshot.num_pending_events
            self._events.clear()
            self.last_seq = after_seq
            self._append(cleared=registry_pb2.AllBlocksCleared())
            for i in range(0, len(hashes), SNAPSHOT_CHUNK):
                self._append(stored=registry_pb2.BlocksStored(block_hashes=hashes[i : i + SNAPSHOT_CHUNK]))
        self._notify()
        return len(hashes)

    def can_replay(self, after_seq: int) -> bool:
        """Whether every event with seq > after_seq is still in the buffer."""
        with self._lock:
            oldest = self._events[0].seq if self._events else self.last_seq + 1
            return 0 < after_seq <= self.last_seq and after_seq >= oldest - 1

    def since(self, after_seq: int, limit: int) -> list[registry_pb2.KVEvent]:
        """Up to `limit` events with seq > after_seq; raises LookupError if some were already dropped."""
        with self._lock:
            if after_seq >= self.last_seq:
                return []
            oldest = self._events[0].seq if self._events else self.last_seq + 1
            if after_seq < oldest - 1:
                raise LookupError(f"events after seq {after_seq} are no longer buffered (oldest {oldest})")
            start = after_seq + 1 - oldest
            return list(itertools.islice(self._events, start, start + limit))
