"""The router's API keys file and per-key token-bucket rate limits (the key check is ragserve.http.auth)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ragserve.http.auth import ApiKey, digest
from ragserve.http.errors import ApiError

MAX_BUCKETS = 10_000


@dataclass
class LimitedKey(ApiKey):
    rps: float | None = None  # None: the router's default rate limit
    burst: int | None = None


def option_lines(path: str) -> Iterator[tuple[int, str, list[str]]]:
    """A `FIRST [name=value ...]` file ('#' starts a comment): (line number, first field, options) per line."""
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if fields:
            yield lineno, fields[0], fields[1:]


def parse_keys_file(path: str) -> list[LimitedKey]:
    """One key per line: `KEY [name=NAME] [rps=N] [burst=M]`; '#' starts a comment."""
    keys = []
    for lineno, secret, options in option_lines(path):
        key = LimitedKey(f"key{len(keys) + 1}", digest(secret))
        for option in options:
            name, _, value = option.partition("=")
            try:
                if name == "name" and value:
                    key.name = value
                elif name == "rps":
                    key.rps = float(value)
                elif name == "burst":
                    key.burst = int(value)
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(f"{path}:{lineno}: bad option {option!r} (use name=, rps=, burst=)") from None
        keys.append(key)
    if not keys:
        raise ValueError(f"{path} has no API keys")
    return keys


@dataclass
class Bucket:
    rate: float
    capacity: float
    tokens: float
    stamp: float = field(default_factory=time.monotonic)

    def refill(self, now: float) -> float:
        """The tokens in the bucket now."""
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.tokens

    def take(self, now: float, cost: float = 1.0) -> float:
        """0 if `cost` tokens were taken, else the seconds until that many are available."""
        if self.refill(now) >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate


class RateLimiter:
    """Token buckets per API key (or per client address when keys are off). Local to this replica."""

    def __init__(self, default_rps: float, default_burst: int, clock=time.monotonic) -> None:
        self.default_rps = default_rps
        self.default_burst = default_burst
        self._clock = clock
        self._buckets: dict[str, Bucket] = {}

    def check(self, who: str, key: LimitedKey | None) -> None:
        rps = key.rps if key and key.rps is not None else self.default_rps
        if rps <= 0:
            return
        burst = key.burst if key and key.burst is not None else self.default_burst
        capacity = float(burst or max(1, math.ceil(2 * rps)))
        if len(self._buckets) > MAX_BUCKETS:
            self._prune()
        bucket = self._buckets.get(who)
        if bucket is None or bucket.rate != rps or bucket.capacity != capacity:
            bucket = self._buckets[who] = Bucket(rps, capacity, capacity, self._clock())
        wait = bucket.take(self._clock())
        if wait > 0:
            raise ApiError(
                429,
                f"rate limit of {rps:g} requests/s exceeded; retry after {math.ceil(wait)} s",
                "rate_limit_exceeded",
                headers={"Retry-After": str(math.ceil(wait))},
            )

    def _prune(self) -> None:
        """Forget buckets that have refilled: they behave exactly like new ones."""
        now = self._clock()
        for who, b in list(self._buckets.items()):
            if b.tokens + (now - b.stamp) * b.rate >= b.capacity:
                del self._buckets[who]
