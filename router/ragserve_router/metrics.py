"""Prometheus metrics of the router (prefix ragserve_router_), in a registry of their own.

Every answer is counted once by `count` (ragserve.http.outcomes), with the labels the request left in its
state: `model` (only a served model, so clients cannot mint series), `engine` and `policy` once routed.
Series with a known label set start at zero, so "no data" never stands for zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ragserve.disagg import LEG_SECONDS_BUCKETS
from ragserve.http.outcomes import Outcome
from ragserve.metric_names import LATENCY_BUCKETS
from ragserve.token_cache import TokenCache
from ragserve.token_cache_metrics import TokenCacheCollector
from ragserve_router.engines import CONNECT, SERVER_ERROR, SOURCES, TIMEOUT
from ragserve_router.priority import CLASSES
from ragserve_router.state import CLEARED, REMOVED, STORED

REGISTRATION_REFUSALS = ("invalid", "tokenizer", "key_scheme", "tokenizer_fingerprint", "block_size")
REGISTRATION_REFUSALS += ("model_conflict", "probe_hashes")  # ragserve_router.admission.Refused reasons
DROP_REASONS = ("heartbeat_timeout", "deregister")
SHED_REASONS = ("saturated", "queue_full", "queue_timeout")  # ragserve_router.flow's refusals
QUOTA_REASONS = ("tokens", "concurrency")  # ragserve_router.quotas' refusals


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "ragserve_router_"
        self._children: dict[tuple[Any, tuple], Any] = {}  # child()'s
        self.requests = Counter(
            p + "requests",
            "HTTP answers by final status (499: the client left first) and error code",
            ["model", "engine", "policy", "code", "reason"],
            registry=r,
        )
        self.engine_errors = Counter(p + "engine_errors", "Engine failures seen", ["engine", "kind"], registry=r)
        self.retries = Counter(p + "retries", "Requests retried on another engine", ["reason"], registry=r)
        self.decisions = Counter(p + "routing_decisions", "Routing decisions", ["policy", "reason"], registry=r)
        self.predicted_cached = Counter(
            p + "predicted_cached_tokens", "Cached prompt tokens the router predicted", ["engine"], registry=r
        )
        self.actual_cached = Counter(
            p + "actual_cached_tokens", "Cached prompt tokens engines reported (usage)", ["engine"], registry=r
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens engines reported", ["engine"], registry=r)

        def latency(name: str, doc: str, label: str) -> Histogram:
            return Histogram(p + name, doc, [label], buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = latency(
            "time_to_first_token_seconds",
            "Time from request arrival to the first streamed byte from the engine",
            "model",
        )
        self.predicted_ttft = latency(
            "predicted_ttft_seconds",
            "kv_aware's predicted time to first token on the engine it chose (compare engine_ttft_seconds)",
            "engine",
        )
        self.engine_ttft = latency(
            "engine_ttft_seconds", "Time from request arrival to the first streamed byte, by engine", "engine"
        )
        self.disagg_legs = Counter(
            p + "disagg_prefill_legs",
            "Prefill legs by outcome (delegated: the endpoint picker named a prefill engine to the decode engine)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.disagg_leg_seconds = Histogram(
            p + "disagg_prefill_seconds", "Prefill leg: sent to the prefill engine until its KV is in the cachestore",
            registry=r, buckets=LEG_SECONDS_BUCKETS,
        )  # fmt: skip
        self.disagg_decode_ttft = Histogram(
            p + "disagg_decode_ttft_seconds",
            "Disaggregated requests: the decode leg's part of the TTFT (the prefill leg's end to the first byte)",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.predicted_tokens = Counter(
            p + "predicted_prompt_tokens",
            "kv_aware's split of the prompt tokens it routed: local cache hits, fetched from the cachestore, computed",
            ["engine", "source"],
            registry=r,
        )
        self.engine_prompt_tokens = Gauge(
            p + "engine_prompt_tokens",
            "Prompt tokens each engine reports (heartbeat, cumulative) it computed or fetched from the cachestore",
            ["engine", "source"],
            registry=r,
        )
        self.latency = latency("request_duration_seconds", "End-to-end request latency", "model")
        self.routing_latency = Histogram(
            p + "routing_seconds",
            "Time spent choosing an engine (tokenize, hash, index lookup)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1),
            registry=r,
        )
        self.engines_registered = Gauge(p + "engines_registered", "Known engines", ["source"], registry=r)
        self.engines_healthy = Gauge(p + "engines_healthy", "Engines accepting traffic", registry=r)
        self.health_transitions = Counter(
            p + "engine_health_transitions", "Engines turning healthy or unhealthy (probes, failed connections)",
            ["engine", "state"], registry=r,
        )  # fmt: skip
        self.registrations = Counter(p + "registrations", "Engine registrations accepted", registry=r)
        self.registrations_refused = Counter(
            p + "registrations_refused", "Engine registrations refused", ["reason"], registry=r
        )
        self.engines_dropped = Counter(p + "engines_dropped", "Engines removed", ["reason"], registry=r)
        self.kv_events = Counter(p + "kv_events", "KV events applied", ["kind"], registry=r)
        self.rate_limited = Counter(p + "rate_limited", "Requests refused by the rate limiter", registry=r)
        self.inflight = Gauge(p + "requests_in_flight", "Requests being proxied", registry=r)
        self.migrations = Counter(
            p + "migrations", "Broken engine answers resumed or resent elsewhere, or why not", ["outcome"], registry=r
        )
        self._flow_control(p, r)
        self._zero()

    def _flow_control(self, p: str, r: CollectorRegistry) -> None:
        """The router queue, shedding, tenant quotas and circuit breakers (flow.py, quotas.py, breaker.py)."""
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting in the router queue, by class", ["class"],
                                 registry=r)  # fmt: skip
        self.queue_wait = Histogram(
            p + "queue_wait_seconds", "Time admitted requests waited in the router queue", ["class"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.shed = Counter(p + "shed", "Requests refused to protect the engines, by class and reason",
                            ["class", "reason"], registry=r)  # fmt: skip
        self.quota_limited = Counter(
            p + "quota_limited", "Requests refused by their tenant's quota (tokens per minute, concurrency)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.breaker_state = Gauge(
            p + "breaker_state", "Each engine's circuit breaker: 0 closed, 1 half-open, 2 open", ["engine"], registry=r
        )
        self.breaker_transitions = Counter(
            p + "breaker_transitions", "Circuit breaker state changes, by engine and new state", ["engine", "state"],
            registry=r,
        )  # fmt: skip
        for cls in CLASSES:
            self.queue_depth.labels(cls)
            self.queue_wait.labels(cls)
            for reason in SHED_REASONS:
                self.shed.labels(cls, reason)
        for reason in QUOTA_REASONS:
            self.quota_limited.labels(reason)

    def _zero(self) -> None:
        for family, values in (
            (self.retries, (CONNECT, TIMEOUT, SERVER_ERROR)),
            (self.registrations_refused, REGISTRATION_REFUSALS),
            (self.engines_dropped, DROP_REASONS),
            (self.kv_events, (STORED, REMOVED, CLEARED)),
            (self.engines_registered, SOURCES),
            (self.migrations, ("resumed", "resent", "no_engine", "limit")),
        ):
            for value in values:
                family.labels(value)

    def child(self, family: Any, *values: Any) -> Any:
        """family.labels(*values), kept for the next time: prometheus_client's labels() converts and checks the values
        and takes a lock on every call, and a request looks a dozen up (no child is ever removed here)."""
        key = (family, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = family.labels(*values)
        return found

    def observe_prediction(self, engine_id: str, prediction) -> None:
        """kv_aware's cost_model.Prediction for the engine a request was sent to."""
        self.child(self.predicted_ttft, engine_id).observe(prediction.ttft_s)
        for source, tokens in (
            ("local", prediction.local_tokens),
            ("fetched", prediction.fetched_tokens),
            ("computed", prediction.computed_tokens),
        ):
            self.child(self.predicted_tokens, engine_id, source).inc(tokens)

    def count_kv_ops(self, ops: Iterable) -> None:
        """KV-index ops applied (a registered engine's events, or an external engine's vLLM events)."""
        for op in ops:
            self.kv_events.labels(op.kind).inc()

    def count(self, outcome: Outcome) -> None:
        """One answer (ragserve.http.outcomes.CountResponses)."""
        model, engine, policy = (outcome.state.get(k, "") for k in ("model", "engine", "policy"))
        self.child(self.requests, model, engine, policy, str(outcome.status), outcome.reason).inc()
        if engine:  # an engine's token counters exist from its first answer, even without usage
            for family in (self.predicted_cached, self.actual_cached, self.prompt_tokens):
                self.child(family, engine)

    def watch_token_caches(self, caches: Callable[[], Iterable[TokenCache]]) -> None:
        """Export the token caches (ragserve.token_cache) of the tokenizers `caches` gives, read at each scrape."""
        names = ("ragserve_router_token_cache_pieces", "ragserve_router_token_cache_chars")
        self.registry.register(TokenCacheCollector(names, caches))

    def render(self, models: Iterable[str] = ()) -> bytes:
        """The exposition; each served model's histograms exist (at zero) before its first request."""
        for model in models:
            self.ttft.labels(model)
            self.latency.labels(model)
        return generate_latest(self.registry)
