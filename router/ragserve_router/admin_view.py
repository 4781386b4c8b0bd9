"""What the admin API changed, shared by every router replica through the router state (Redis with several
replicas): engine URLs draining, added and removed. A call on one replica writes here and applies at once; the
others apply it at their next registry sync (pool.refresh, every half second at most)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ragserve_router.engines import STATIC, EngineRecord

ADMIN_SETS = ("draining", "added", "removed")


@dataclass(frozen=True)
class AdminView:
    draining: frozenset[str] = frozenset()  # engine URLs that take no new requests
    added: frozenset[str] = frozenset()  # engine URLs added by POST /admin/engines
    removed: frozenset[str] = frozenset()  # static or discovered engine URLs every replica forgets


@dataclass
class AdminChange:
    """Set updates the state applies atomically: set name -> URLs."""

    add: dict[str, list[str]] = field(default_factory=dict)
    discard: dict[str, list[str]] = field(default_factory=dict)

    @staticmethod
    def drain(url: str, on: bool) -> AdminChange:
        return AdminChange(add={"draining": [url]}) if on else AdminChange(discard={"draining": [url]})

    @staticmethod
    def add_engine(url: str) -> AdminChange:
        return AdminChange(add={"added": [url]}, discard={"removed": [url]})

    @staticmethod
    def remove_engine(url: str, view: AdminView) -> AdminChange:
        if url in view.added:
            return AdminChange(discard={"added": [url], "draining": [url]})
        return AdminChange(add={"removed": [url]}, discard={"draining": [url]})


def admin_id(url: str) -> str:
    """The same id on every replica for an engine added by URL."""
    return "admin-" + hashlib.sha256(url.encode()).hexdigest()[:10]


def sync(discovered: dict[str, EngineRecord], registered_urls: set[str], view: AdminView) -> list[EngineRecord]:
    """Bring a replica's discovered engines (edited in place) to the view; returns the engines it added."""
    for engine_id, record in list(discovered.items()):
        added_here = engine_id == admin_id(record.url)
        if record.url in view.removed or (added_here and record.url not in view.added):
            del discovered[engine_id]
    known = registered_urls | {r.url for r in discovered.values()}
    new = [EngineRecord(admin_id(url), url, [], source=STATIC) for url in sorted(view.added - known)]
    discovered.update((record.engine_id, record) for record in new)
    return new
