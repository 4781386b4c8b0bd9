"""Approximate prefix index from routing history: block hash -> {engine: last routed time}, TTL + LRU bound.

Each engine's hashes are also kept by engine, so forgetting an engine (dropped, cleared) touches only its own
entries rather than the whole index."""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence


class ApproxIndex:
    def __init__(self, max_entries: int, clock=time.monotonic) -> None:
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        self._by_engine: defaultdict[str, set[bytes]] = defaultdict(set)

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, hashes: Sequence[bytes], engine_id: str) -> None:
        now, entries = self._clock(), self._entries
        for h in hashes:
            entry = entries.get(h)
            if entry is None:
                entries[h] = {engine_id: now}
            else:
                entries.move_to_end(h)
                entry[engine_id] = now
        self._by_engine[engine_id].update(hashes)
        while len(self._entries) > self.max_entries:
            h, entry = self._entries.popitem(last=False)
            for e in entry:
                self._by_engine[e].discard(h)

    def match(self, ttl_by_engine: dict[str, float], hashes: Sequence[bytes]) -> dict[str, int]:
        now, entries, none = self._clock(), self._entries, {}
        out = {}
        for engine_id, ttl in ttl_by_engine.items():
            n = 0
            for h in hashes:
                seen = entries.get(h, none).get(engine_id)
                if seen is None or now - seen > ttl:
                    break
                n += 1
            out[engine_id] = n
        return out

    def forget_blocks(self, engine_id: str, hashes: Sequence[bytes]) -> None:
        """The engine reported evicting these blocks: an earlier route there no longer implies them."""
        mine = self._by_engine.get(engine_id)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                self._entries[h].pop(engine_id, None)

    def forget(self, engine_id: str) -> None:
        for h in self._by_engine.pop(engine_id, ()):
            entry = self._entries.get(h)
            if entry is not None:
                entry.pop(engine_id, None)
