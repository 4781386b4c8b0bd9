"""The token caches' counters (ragserve.token_cache) as Prometheus families, read at each scrape: the router
exports them as ragserve_router_token_cache_*, an engine as ragserve:token_cache_* with its model_name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ragserve.token_cache import TokenCache


class TokenCacheCollector(Collector):
    """Long prompt pieces found in the caches or tokenized, and the characters they keep; `labels` on every
    sample."""

    def __init__(
        self,
        names: tuple[str, str],  # the pieces counter's and the characters gauge's
        caches: Callable[[], Iterable[TokenCache]],
        labels: dict[str, str] | None = None,
    ) -> None:
        self.names, self.caches, self.labels = names, caches, labels or {}

    def collect(self) -> Iterator[Metric]:
        caches, names, values = list(self.caches()), list(self.labels), list(self.labels.values())
        pieces = CounterMetricFamily(
            self.names[0], "Long prompt pieces looked up in the token cache",
            labels=[*names, "result"],
        )  # fmt: skip
        pieces.add_metric([*values, "hit"], sum(c.hits for c in caches))
        pieces.add_metric([*values, "miss"], sum(c.misses for c in caches))
        yield pieces
        chars = GaugeMetricFamily(self.names[1], "Characters of prompt text whose token ids are cached", labels=names)
        chars.add_metric(values, sum(c.chars for c in caches))
        yield chars
