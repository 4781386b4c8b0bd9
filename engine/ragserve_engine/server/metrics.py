"""Prometheus metrics with vLLM's names and the `model_name` label, one registry per server.

Engine state (queue lengths, KV usage, local and external prefix-cache counters,
preemptions) is read from `EngineClient.stats()` at scrape time, so it is never stale;
per-request metrics are observed by the server as requests finish, and every HTTP answer is
counted once by its final status (ragserve.http.outcomes). Series with a known label set start at zero.
Buckets: ragserve.metric_names (5 ms to 10 minutes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ragserve import metric_names as m
from ragserve.http.outcomes import Outcome
from ragserve.token_cache import TokenCache
from ragserve.token_cache_metrics import TokenCacheCollector

if TYPE_CHECKING:
    from ragserve_engine.engine_client import EngineStats
    from ragserve_engine.server.vllm_kv_events import PublishStats

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
            (m.NUM_REQUESTS_RUNNING, "Requests in model execution batches", stats.num_running),
            (m.NUM_REQUESTS_WAITING, "Requests waiting (or swapped out)", stats.num_waiting),
            (m.KV_CACHE_USAGE, "KV-cache usage; 1 means 100 percent", stats.kv_usage),
            (m.PREFILL_TOKENS_PER_SECOND, "Measured prefill throughput (0: not yet)", stats.prefill_tokens_per_s),
            (m.DECODE_STEP_SECONDS, "Measured step time at the current decode batch", stats.decode_step_s),
            (m.QUEUED_PREFILL_TOKENS, "Prompt tokens waiting or partially prefilled", stats.queued_prefill_tokens),
            (m.CACHESTORE_FETCH_SECONDS_PER_BLOCK, "Measured cachestore fetch cost per block", stats.fetch_s_per_block),
            (m.DECODE_GRAPHS_COMPILED, "Decode-graph capture sizes compiled", stats.decode_graphs_compiled),
            (m.DECODE_GRAPHS_PENDING, "Decode-graph sizes still compiling", stats.decode_graphs_pending),
            (m.DECODE_GRAPH_COMPILE_SECONDS, "Seconds compiling decode graphs", stats.decode_graph_compile_seconds),
            (m.DECODE_GRAPH_CACHE_MISSES, "Decode graphs not in the compile cache", stats.decode_graph_cache_misses),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=[m.MODEL_NAME_LABEL])
            family.add_metric(label, value)
            yield family
        if (warmup := stats.warmup_decode_steps) is not None:
            doc = "Decode step time over the engine's first decode steps (compilation/warmup_steps.py)"
            family = HistogramMetricFamily(m.WARMUP_DECODE_STEP_SECONDS, doc, labels=[m.MODEL_NAME_LABEL])
            family.add_metric(label, warmup.cumulative(), warmup.total_seconds)
            yield family
        counters = [
            (m.PREFIX_CACHE_QUERIES, "Prefix-cache queries, in tokens", stats.prefix_cache_queries),
            (m.PREFIX_CACHE_HITS, "Prefix-cache hits, in tokens", stats.prefix_cache_hits),
            (m.NUM_PREEMPTIONS, "Cumulative preemptions", stats.num_preemptions),
            (
                m.BLEND_REUSED_TOKENS,
                "Blended-prefill chunk tokens kept from KV that existed before the request (chunk store or cachestore)",
                stats.blend_reused_tokens,
            ),
            (
                m.BLEND_COMPUTED_CHUNK_TOKENS,
                "Blended-prefill chunk tokens kept from chunks first computed for the request (not reuse)",
                stats.blend_computed_chunk_tokens,
            ),
            (
                m.BLEND_RECOMPUTED_TOKENS,
                "Blended-prefill prompt tokens the blended forward computed (non-chunk and selected chunk tokens)",
                stats.blend_recomputed_tokens,
            ),
            (
                m.EXTERNAL_PREFIX_CACHE_QUERIES,
                "External (cachestore) prefix-cache queries, in tokens",
                stats.external_prefix_cache_queries,
            ),
            (
                m.EXTERNAL_PREFIX_CACHE_HITS,
                "External (cachestore) prefix-cache hits, in tokens",
                stats.fetched_prompt_tokens,
            ),
            (m.NUM_SWAP_FALLBACKS, "Swap preemptions that found the host swap space full", stats.num_swap_fallbacks),
            (
                m.CACHESTORE_FETCHES_ABANDONED,
                "Cachestore fetches given up (deadline passed: the request recomputed; or aborted)",
                stats.cachestore_fetches_abandoned,
            ),
            (
                m.CACHESTORE_BLOCKS_NOT_IMPORTED,
                "Fetched cachestore blocks left out for lack of free KV blocks (recomputed)",
                stats.cachestore_blocks_not_imported,
            ),
            (
                m.CACHESTORE_OFFLOAD_DROPPED,
                "Blocks never offloaded to the cachestore: the offload queue was full",
                stats.cachestore_offload_dropped,
            ),
        ]
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=[m.MODEL_NAME_LABEL])
            family.add_metric(label, value)
            yield family
        yield from self.transfers(stats)

    def transfers(self, stats: EngineStats):
        """KV moved through the cachestore, by direction (zeros without a cachestore)."""
        labels = [m.MODEL_NAME_LABEL, m.KV_TRANSFER_DIRECTION_LABEL]
        for name, doc, values in (
            (m.KV_TRANSFER_BYTES, "KV block bytes the cachestore accepted / fetched from it", stats.kv_transfer_bytes),
            (m.KV_TRANSFER_SECONDS, "Seconds in cachestore puts / fetches", stats.kv_transfer_seconds),
            (m.KV_TRANSFER_REQUESTS, "Requests whose KV was stored / fetched", stats.kv_transfer_requests),
        ):
            family = CounterMetricFamily(name, doc, labels=labels)
            for direction in m.KV_TRANSFER_DIRECTIONS:
                family.add_metric([self.model_name, direction], values.get(direction, 0))
            yield family


class KVPublishCollector:
    """Counters of the vLLM-format KV events published (--kv-events-config)."""

    EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")

    def __init__(self, model_name: str, stats: PublishStats) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        batches = CounterMetricFamily(
            m.KV_EVENT_BATCHES_PUBLISHED, "vLLM KV-event batches published", labels=[m.MODEL_NAME_LABEL]
        )
        batches.add_metric([self.model_name], self.stats.batches)
        yield batches
        labels = [m.MODEL_NAME_LABEL, m.KV_EVENT_TYPE_LABEL]
        events = CounterMetricFamily(m.KV_EVENTS_PUBLISHED, "vLLM KV events published, by type", labels=labels)
        for kind in self.EVENT_TYPES:
            events.add_metric([self.model_name, kind], self.stats.events[kind])
        yield events


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        labels = [m.MODEL_NAME_LABEL]

        def counter(name: str, doc: str, extra: list[str] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.prompt_tokens = counter(m.PROMPT_TOKENS, "Prefill tokens processed")
        self.generation_tokens = counter(m.GENERATION_TOKENS, "Generation tokens processed")
        self.request_success = counter(m.REQUEST_SUCCESS, "Successfully finished requests", ["finished_reason"])
        self.requests = counter(m.ENGINE_REQUESTS, "HTTP answers by final status and error code", ["code", "reason"])
        self.ttft = histogram(m.TIME_TO_FIRST_TOKEN, "Time to first token", m.LATENCY_BUCKETS)
        self.itl = histogram(m.INTER_TOKEN_LATENCY, "Inter-token latency", m.ITL_BUCKETS)
        self.e2e = histogram(m.E2E_REQUEST_LATENCY, "End-to-end request latency", m.LATENCY_BUCKETS)
        self.queue_time = histogram(m.REQUEST_QUEUE_TIME, "Time spent waiting", m.LATENCY_BUCKETS)
        self.cache_config = Gauge(
            m.CACHE_CONFIG_INFO, "Information of the KV cache config", ["block_size", "num_gpu_blocks"], registry=r
        )
        for family in (self.prompt_tokens, self.generation_tokens):
            family.labels(model_name)  # export zeros before the first request
        for family in (self.ttft, self.itl, self.e2e, self.queue_time):
            family.labels(model_name)
        for reason in FINISH_REASONS[:2]:
            self.request_success.labels(model_name, reason)
        self.requests.labels(model_name, "200", "")

    def count(self, outcome: Outcome) -> None:
        """One HTTP answer (ragserve.http.outcomes.CountResponses)."""
        self.requests.labels(self.model_name, str(outcome.status), outcome.reason).inc()

    def attach_engine(self, stats: Callable[[], EngineStats | None], block_size: int, num_blocks: int) -> None:
        self.registry.register(EngineStateCollector(self.model_name, stats))
        self.cache_config.labels(str(block_size), str(num_blocks)).set(1)

    def attach_token_cache(self, cache: TokenCache) -> None:
        names, label = (m.TOKEN_CACHE_PIECES, m.TOKEN_CACHE_CHARS), {m.MODEL_NAME_LABEL: self.model_name}
        self.registry.register(TokenCacheCollector(names, lambda: [cache], label))

    def attach_kv_publisher(self, stats: PublishStats) -> None:
        self.registry.register(KVPublishCollector(self.model_name, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
