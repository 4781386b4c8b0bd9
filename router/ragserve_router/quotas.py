"""Per-tenant quotas: tokens per minute (prompt + completion) and requests at once. Local to this replica.

Tokens: a token bucket per tenant holding a minute's worth, refilled continuously. A request takes its prompt
tokens when it is admitted (a prompt larger than the whole quota waits for a full bucket) and its completion
tokens when its usage comes back (the bucket may go below zero: the next request waits longer). Over quota:
429 with Retry-After (the seconds until the bucket holds the prompt) and OpenAI's x-ratelimit-limit-tokens,
x-ratelimit-remaining-tokens and x-ratelimit-reset-tokens (until full), which admitted answers carry too.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

from ragserve.http.errors import ApiError
from ragserve_router.auth import Bucket, option_lines
from ragserve_router.metrics import RouterMetrics

MAX_BUCKETS = 10_000


@dataclass(frozen=True)
class Quota:
    tokens_per_minute: int = 0  # 0: no limit
    max_concurrent: int = 0  # 0: no limit


def parse_quotas_file(path: str) -> dict[str, dict[str, int]]:
    """One tenant per line: `TENANT [tpm=N] [concurrent=M]`; '#' starts a comment. Unset fields: the flags'."""
    quotas = {}
    for lineno, tenant, options in option_lines(path):
        values = {}
        for option in options:
            name, _, value = option.partition("=")
            if name not in ("tpm", "concurrent") or not value.isdigit():
                raise ValueError(f"{path}:{lineno}: bad option {option!r} (use tpm=N, concurrent=M)")
            values[name] = int(value)
        quotas[tenant] = values
    return quotas  # resolved against the flags' defaults by Quotas


def duration(seconds: float) -> str:
    """OpenAI's reset format, e.g. 1.5s."""
    return f"{max(0.0, seconds):.3f}".rstrip("0").rstrip(".") + "s"


class Quotas:
    def __init__(
        self, default: Quota, tenants: dict[str, dict[str, int]], metrics: RouterMetrics, clock=time.monotonic
    ) -> None:
        self.default, self.metrics, self._clock = default, metrics, clock
        self.tenants = {
            name: Quota(v.get("tpm", default.tokens_per_minute), v.get("concurrent", default.max_concurrent))
            for name, v in tenants.items()
        }
        self.active: Counter[str] = Counter()
        self._buckets: dict[str, Bucket] = {}

    def quota(self, tenant: str) -> Quota:
        return self.tenants.get(tenant, self.default)

    def enter(self, tenant: str, prompt_tokens: int) -> dict[str, str]:
        """Admit a request (its prompt tokens taken, one concurrent place held) and return its x-ratelimit
        headers, or raise a 429."""
        quota = self.quota(tenant)
        if quota.max_concurrent and self.active[tenant] >= quota.max_concurrent:
            self._refuse("concurrency", f"{quota.max_concurrent} requests at once", 1.0, {})
        headers = {}
        if quota.tokens_per_minute:
            bucket = self._bucket(tenant, quota.tokens_per_minute)
            wait = bucket.take(self._clock(), min(float(prompt_tokens), bucket.capacity))
            headers = self._headers(bucket)
            if wait > 0:
                self._refuse("tokens", f"{quota.tokens_per_minute} tokens per minute", wait, headers)
        self.active[tenant] += 1
        return headers

    def settle(self, tenant: str, tokens: float) -> None:
        """Tokens the request used beyond what it was charged on entry (negative: a refund)."""
        if (bucket := self._buckets.get(tenant)) is not None:
            bucket.refill(self._clock())
            bucket.tokens = min(bucket.capacity, bucket.tokens - tokens)

    def leave(self, tenant: str) -> None:
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]

    def _bucket(self, tenant: str, per_minute: int) -> Bucket:
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.capacity != per_minute:
            if len(self._buckets) > MAX_BUCKETS:
                self._prune()
            bucket = self._buckets[tenant] = Bucket(per_minute / 60.0, float(per_minute), float(per_minute),
                                                    self._clock())  # fmt: skip
        return bucket

    def _headers(self, bucket: Bucket) -> dict[str, str]:
        return {
            "x-ratelimit-limit-tokens": str(int(bucket.capacity)),
            "x-ratelimit-remaining-tokens": str(max(0, math.floor(bucket.tokens))),
            "x-ratelimit-reset-tokens": duration((bucket.capacity - bucket.tokens) / bucket.rate),
        }

    def _refuse(self, reason: str, limit: str, wait: float, headers: dict[str, str]) -> None:
        self.metrics.quota_limited.labels(reason).inc()
        retry = str(max(1, math.ceil(wait)))
        raise ApiError(
            429, f"this tenant's quota of {limit} is used up; retry after {retry} s", f"quota_{reason}", None,
            {**headers, "Retry-After": retry},
        )  # fmt: skip

    def _prune(self) -> None:
        """Forget buckets that have refilled: they behave exactly like new ones."""
        now = self._clock()
        for tenant, b in list(self._buckets.items()):
            if b.refill(now) >= b.capacity:
                del self._buckets[tenant]
