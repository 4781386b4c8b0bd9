"""Prometheus metrics (ragserve_cachestore_*), read from the store's counters at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ragserve_cachestore.store import TieredStore

P = "ragserve_cachestore_"


class StoreCollector(Collector):
    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        snap = self.store.snapshot()
        per_tier = {
            "hits": (CounterMetricFamily, "blocks served from the tier"),
            "misses": (CounterMetricFamily, "reads that did not find the block in the tier"),
            "corrupt": (CounterMetricFamily, "blocks that failed verification and were deleted"),
            "evictions": (CounterMetricFamily, "blocks evicted from the tier (demoted or dropped)"),
        }
        for name, (kind, doc) in per_tier.items():
            family = kind(P + name, doc, labels=["tier"])
            for tier in snap.tiers:
                family.add_metric([tier.name], getattr(tier.counters, name))
            yield family
        gauges = {
            "used_bytes": ("used", "bytes stored in the tier (headers included)"),
            "capacity_bytes": ("capacity", "byte budget of the tier"),
            "blocks": ("blocks", "blocks stored in the tier"),
        }
        for name, (attr, doc) in gauges.items():
            family = GaugeMetricFamily(P + name, doc, labels=["tier"])
            for tier in snap.tiers:
                family.add_metric([tier.name], getattr(tier, attr))
            yield family
        c = snap.counters
        yield CounterMetricFamily(P + "puts", "blocks stored by Put", value=c.puts)
        yield CounterMetricFamily(P + "puts_skipped", "Put blocks already present or too large", value=c.skipped)
        yield CounterMetricFamily(P + "lookups", "Lookup calls", value=c.lookups)
        yield CounterMetricFamily(P + "block_hits", "blocks found by Lookup or Get", value=c.hits)
        yield CounterMetricFamily(P + "block_misses", "Lookup/Get calls stopped by a missing block", value=c.misses)
        yield CounterMetricFamily(P + "dropped", "blocks evicted from the last tier holding them", value=c.dropped)


def serve_metrics(store: TieredStore, host: str, port: int):
    """Start the /metrics HTTP server; returns the WSGI server (call .shutdown())."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ValueError(f"cannot serve metrics on {host}:{port}: {exc}") from None
    return server
