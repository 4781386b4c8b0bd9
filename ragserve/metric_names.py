"""Metric names: the vLLM-named series engines export, read by the router, the operator and the chart's
dashboard, alerts and autoscalers (docs/architecture.md). Torch-free, no dependencies.

Counters are named without `_total` and histograms without `_bucket`/`_sum`/`_count`, as prometheus_client
declares them; `total()` gives a counter's exposed sample name.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL_NAME_LABEL = "model_name"  # every engine series carries the served model's name

# Engine load gauges.
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # 0..1
KV_CACHE_USAGE_V0 = "vllm:gpu_cache_usage_perc"  # vLLM v0's name for the same gauge (other engines)

# Engine speeds and queued work, measured by the engine for the router's cost model (ragserve's own names;
# the same values travel in the registry heartbeat, proto/ragserve/v1/registry.proto Load).
PREFILL_TOKENS_PER_SECOND = "ragserve:prefill_tokens_per_second"
DECODE_STEP_SECONDS = "ragserve:decode_step_seconds"
QUEUED_PREFILL_TOKENS = "ragserve:num_queued_prefill_tokens"
CACHESTORE_FETCH_SECONDS_PER_BLOCK = "ragserve:cachestore_fetch_seconds_per_block"
# Compiled decode graphs (docs/kernels.md): capture sizes compiled, and sizes still compiling in the background;
# seconds spent compiling them, and how many were generated rather than loaded from the compile cache.
DECODE_GRAPHS_COMPILED = "ragserve:decode_graphs_compiled"
DECODE_GRAPHS_PENDING = "ragserve:decode_graphs_pending"
DECODE_GRAPH_COMPILE_SECONDS = "ragserve:decode_graph_compile_seconds"
DECODE_GRAPH_CACHE_MISSES = "ragserve:decode_graph_cache_misses"
WARMUP_DECODE_STEP_SECONDS = "ragserve:warmup_decode_step_seconds"  # histogram of the first decode steps

# Engine counters.
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
NUM_PREEMPTIONS = "vllm:num_preemptions"
# The tokenizer's cache of long prompt pieces (ragserve.token_cache): pieces found or tokenized (counter, by
# result: hit / miss), and the characters whose ids it keeps (gauge).
TOKEN_CACHE_PIECES = "ragserve:token_cache_pieces"
TOKEN_CACHE_CHARS = "ragserve:token_cache_chars"
# A blended prefill's prompt tokens, each in exactly one (blend.spec.BlendUsage): chunk tokens kept from KV that
# existed before the request; chunk tokens kept from chunks first computed for it; tokens its forward computed.
BLEND_REUSED_TOKENS = "ragserve:blend_reused_tokens"
BLEND_COMPUTED_CHUNK_TOKENS = "ragserve:blend_computed_chunk_tokens"
BLEND_RECOMPUTED_TOKENS = "ragserve:blend_recomputed_tokens"
# Swap preemptions that recomputed instead (host swap space full); also counted in NUM_PREEMPTIONS.
NUM_SWAP_FALLBACKS = "ragserve:num_preemption_swap_fallbacks"
# Cachestore fetches given up (past their deadline, so the request recomputed, or aborted).
CACHESTORE_FETCHES_ABANDONED = "ragserve:cachestore_fetches_abandoned"
# Fetched blocks left out for lack of free KV blocks (the request recomputes them).
CACHESTORE_BLOCKS_NOT_IMPORTED = "ragserve:cachestore_blocks_not_imported"
# Newly computed blocks never offloaded to the cachestore: the bounded offload queue was full.
CACHESTORE_OFFLOAD_DROPPED = "ragserve:cachestore_offload_dropped_blocks"
# KV moved through the cachestore, by KV_TRANSFER_DIRECTION_LABEL ("stored": put and accepted, "fetched":
# downloaded): block bytes, seconds in the calls (puts a down store dropped count nowhere), and requests (fetched: a
# request's download that brought blocks; stored: a prompt a --role prefill engine stored for a decode engine).
# Bytes or seconds per request: the ratio of their rates.
KV_TRANSFER_BYTES = "ragserve:kv_transfer_bytes"
KV_TRANSFER_SECONDS = "ragserve:kv_transfer_seconds"
KV_TRANSFER_REQUESTS = "ragserve:kv_transfer_requests"
KV_TRANSFER_DIRECTION_LABEL = "direction"
KV_TRANSFER_DIRECTIONS = ("stored", "fetched")
# Prefill legs a --role decode engine ran itself on the prefill engine the endpoint picker named (x-prefiller-host-
# port), by DISAGG_OUTCOME_LABEL (ragserve.disagg: ok, refused, failed; ignored: not allowed or malformed), and the
# seconds of those that worked; the router's own legs are ragserve_router_disagg_prefill_legs / _seconds.
DISAGG_PREFILL_LEGS = "ragserve:disagg_prefill_legs"
DISAGG_PREFILL_SECONDS = "ragserve:disagg_prefill_seconds"
DISAGG_OUTCOME_LABEL = "outcome"
# vLLM-format KV events an engine published (--kv-events-config): batches (one per step with events), and
# events by type (label KV_EVENT_TYPE_LABEL: BlockStored, BlockRemoved, AllBlocksCleared).
KV_EVENT_BATCHES_PUBLISHED = "ragserve:kv_event_batches_published"
KV_EVENTS_PUBLISHED = "ragserve:kv_events_published"
KV_EVENT_TYPE_LABEL = "type"

# Engine histograms and info.
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
CACHE_CONFIG_INFO = "vllm:cache_config_info"

# Every HTTP answer an engine sent, by final status and error code (ragserve.http.outcomes); not a vLLM series.
ENGINE_REQUESTS = "ragserve_engine_requests"

# Latency buckets (seconds) of TTFT, end-to-end and queue time, engine and router alike: 5 ms to 10 minutes
# (CPU engines and long RAG prompts), neighbours at most 2x apart (1.5x from 40 ms up), so a quantile read
# from them is off by at most one bucket. Inter-token latency: 1 ms to 80 s.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
LATENCY_BUCKETS += (4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 240.0, 300.0, 450.0, 600.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ITL_BUCKETS += (5.0, 10.0, 20.0, 40.0, 80.0)


def total(counter: str) -> str:
    """A counter's exposed sample name: vllm:prompt_tokens -> vllm:prompt_tokens_total."""
    return counter + "_total"


def adapter_name(name: str) -> str:
    """The custom-metrics name prometheus-adapter serves a series under (chart README rules): ':' -> '_'."""
    return name.replace(":", "_")


@dataclass(frozen=True)
class LoadMetric:
    """One engine load signal: where it is read, how it combines, and the autoscaling target that uses it."""

    field: str  # ragserve.prom_text.EngineLoad field
    name: str  # the gauge engines export
    per_pod: str  # combining one pod's series (one per served model): "sum" or "max"
    over_pool: str  # combining a pool's pods in autoscaler PromQL: "sum" (per-pod target) or "avg"
    target_key: str  # spec.autoscaling key in the RAGServe CRD (and the chart's engine autoscaling values)
    aliases: tuple[str, ...] = ()  # older names read when `name` is absent
    roles: tuple[str, ...] = ("prefill", "decode", "both")  # pools (engine --role) the signal sizes
    required: bool = True  # False: an engine without it (an older version) reads 0 instead of no metrics at all


# Requests are summed (each served model's queue is its own work); KV usage is one pool per engine process,
# repeated under each model_name label, so a pod's usage is the highest series, never the sum.
# A prefill pool is sized by the prompt work queued on it, a decode pool by what it holds while decoding
# (a prefill engine's running prompts and its KV of finished prompts, kept as prefix cache, are no pressure).
DECODING = ("decode", "both")
LOAD_METRICS: tuple[LoadMetric, ...] = (
    LoadMetric("waiting", NUM_REQUESTS_WAITING, "sum", "sum", "targetWaitingRequests"),
    LoadMetric("running", NUM_REQUESTS_RUNNING, "sum", "sum", "targetRunningRequests", roles=DECODING),
    LoadMetric("kv_usage", KV_CACHE_USAGE, "max", "avg", "targetKVCacheUsage", (KV_CACHE_USAGE_V0,), DECODING),
    LoadMetric(
        "queued_prefill_tokens",
        QUEUED_PREFILL_TOKENS,
        "sum",
        "sum",
        "targetQueuedPrefillTokens",
        roles=("prefill", "both"),
        required=False,
    ),
)


def load_metrics(role: str) -> tuple[LoadMetric, ...]:
    """The signals that size a pool of engines with this --role."""
    return tuple(m for m in LOAD_METRICS if role in m.roles)
