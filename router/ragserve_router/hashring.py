"""Consistent hashing, optionally with bounded loads (Mirrokni et al.): no engine above c x average."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from functools import lru_cache

import xxhash

VNODES = 64


def point(key: bytes | str) -> int:
    return xxhash.xxh64_intdigest(key.encode() if isinstance(key, str) else key)


@lru_cache(maxsize=64)
def _ring(engine_ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
    pairs = sorted((point(f"{e}#{v}"), e) for e in engine_ids for v in range(VNODES))
    return [p for p, _ in pairs], [e for _, e in pairs]


def ring_order(key: bytes | str, engine_ids: Sequence[str]) -> list[str]:
    """Engines in the order met walking the ring clockwise from the key."""
    points, owners = _ring(tuple(sorted(set(engine_ids))))
    if not points:
        return []
    start = bisect.bisect(points, point(key))
    seen: dict[str, None] = {}
    for i in range(len(points)):
        seen.setdefault(owners[(start + i) % len(points)], None)
        if len(seen) == len(engine_ids):
            break
    return list(seen)


def bounded_order(key: bytes | str, engine_ids: Sequence[str], load: Callable[[str], float], c: float) -> list[str]:
    """Ring order, except engines at or above the bound (c x average load, counting this request) go last."""
    order = ring_order(key, engine_ids)
    if not order:
        return order
    total = sum(load(e) for e in order) + 1
    capacity = math.ceil(c * total / len(order))
    under = [e for e in order if load(e) + 1 <= capacity]
    return under + [e for e in order if e not in under]


def rendezvous_score(key: bytes | str, engine_id: str) -> int:
    """A per-(key, engine) pseudo-random rank: ties broken the same way on every replica."""
    return point((key.hex() if isinstance(key, bytes) else key) + "|" + engine_id)
