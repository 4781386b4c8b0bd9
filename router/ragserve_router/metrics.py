"""Prometheus metrics of the router (prefix ragserve_router_), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "ragserve_router_"
        self.requests = Counter(p + "requests", "Requests answered", ["model", "engine", "policy", "code"], registry=r)
        self.request_errors = Counter(
            p + "request_errors", "Client-visible errors by kind", ["model", "kind"], registry=r
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
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time from request arrival to the first streamed byte from the engine",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            p + "request_duration_seconds", "End-to-end request latency", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.routing_latency = Histogram(
            p + "routing_seconds",
            "Time spent choosing an engine (tokenize, hash, index lookup)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1),
            registry=r,
        )
        self.engines_registered = Gauge(p + "engines_registered", "Known engines", ["source"], registry=r)
        self.engines_healthy = Gauge(p + "engines_healthy", "Engines accepting traffic", registry=r)
        self.registrations = Counter(p + "registrations", "Engine registrations accepted", registry=r)
        self.registrations_refused = Counter(
            p + "registrations_refused", "Engine registrations refused", ["reason"], registry=r
        )
        self.engines_dropped = Counter(p + "engines_dropped", "Engines removed", ["reason"], registry=r)
        self.kv_events = Counter(p + "kv_events", "KV events applied", ["kind"], registry=r)
        self.rate_limited = Counter(p + "rate_limited", "Requests refused by the rate limiter", registry=r)
        self.inflight = Gauge(p + "requests_in_flight", "Requests being proxied", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
