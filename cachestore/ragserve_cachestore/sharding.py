"""Client-side sharding over cachestore replicas: rendezvous hashing and per-replica backoff."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field


def rendezvous_owner(key: bytes, addresses: list[str]) -> int:
    """Index of the replica with the highest random weight sha256(addr|key) for `key`.

    Adding or removing a replica only moves the keys that it wins or owned.
    """
    weights = [hashlib.sha256(addr.encode() + b"|" + key).digest() for addr in addresses]
    return max(range(len(addresses)), key=weights.__getitem__)


def parse_addresses(text: str | list[str]) -> list[str]:
    """'h1:p1,h2:p2' (the --cachestore flag) or a list -> unique HOST:PORT strings, in order."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for item in (s.strip() for s in items):
        host, sep, port = item.rpartition(":")
        if not item or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cachestore address must be HOST:PORT, got {item!r}")
        if item not in out:
            out.append(item)
    if not out:
        raise ValueError("at least one cachestore address is required")
    return out


@dataclass
class Backoff:
    """A replica that failed is skipped until `retry_at`; the wait doubles per failure up to `max_s`."""

    base_s: float = 1.0
    max_s: float = 30.0
    failures: int = 0
    retry_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def available(self) -> bool:
        return time.monotonic() >= self.retry_at

    def failed(self) -> None:
        with self._lock:
            self.failures += 1
            self.retry_at = time.monotonic() + min(self.max_s, self.base_s * 2 ** (self.failures - 1))

    def succeeded(self) -> None:
        with self._lock:
            self.failures, self.retry_at = 0, 0.0
