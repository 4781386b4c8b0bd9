"""Prometheus metrics with vLLM's names and the `model_name` label, one registry per server.

Engine state (queue lengths, KV usage, local and external prefix-cache counters,
preemptions) is read from `EngineClient.stats()` at scrape time, so it is never stale;
per-request metrics are observed by the server as requests finish.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from ragserve_engine.engine_client import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
FINISH_REASONS = ("stop", "length", "abort")


class EngineStateCollector:
    """vLLM gauges and counters derived from the engine's own counters."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        stats = self.stats()
        if stats is None:  # model still loading
            return
        label = [self.model_name]
        gauges = [
            ("vllm:num_requests_running", "Requests in model execution batches", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting (or swapped out)", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent", stats.kv_usage),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        counters = [
            ("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens", stats.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative preemptions", stats.num_preemptions),
            (
                "vllm:external_prefix_cache_queries",
                "External (cachestore) prefix-cache queries, in tokens",
                stats.external_prefix_cache_queries,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External (cachestore) prefix-cache hits, in tokens",
                stats.external_prefix_cache_hits,
            ),
        ]
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: list[str] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed")
        self.request_success = counter("vllm:request_success", "Successfully finished requests", ["finished_reason"])
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time spent waiting", LATENCY_BUCKETS)
        self.cache_config = Gauge(
            "vllm:cache_config_info", "Information of the KV cache config", ["block_size", "num_gpu_blocks"], registry=r
        )
        for family in (self.prompt_tokens, self.generation_tokens):
            family.labels(model_name)  # export zeros before the first request
        for family in (self.ttft, self.itl, self.e2e, self.queue_time):
            family.labels(model_name)
        for reason in FINISH_REASONS[:2]:
            self.request_success.labels(model_name, reason)

    def attach_engine(self, stats: Callable[[], EngineStats | None], block_size: int, num_blocks: int) -> None:
        self.registry.register(EngineStateCollector(self.model_name, stats))
        self.cache_config.labels(str(block_size), str(num_blocks)).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
