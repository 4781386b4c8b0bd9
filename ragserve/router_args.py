"""`ragserve router` settings, written once: RouterConfig's fields are also the router's CLI flags and
RAGSERVE_* variables (ragserve.flags.option), and its spec=True fields the RAGServe CRD's router properties.
Torch-free and importable without the router package, so `ragserve up`, the operator and the chart tests
read the same policy names and defaults.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import Field, dataclass

from ragserve.engine_args import DEFAULT_MAX_BODY_BYTES, ENGINE_PORT
from ragserve.external_engine import FORMAT as EXTERNAL_FORMAT
from ragserve.external_engine import ExternalEngineSpec, external_engine
from ragserve.flags import (
    GRPC_MAX_MESSAGE,
    PORT_SCHEMA,
    FromArgs,
    add_options,
    option,
    options,
    parse_bytes,
    positive_int,
    spec_fields,
    spec_key,
)
from ragserve.logs import LOG_LEVELS

# The routing policies, in the order the router registers them (ragserve_router.policies keys its classes by these).
POLICIES: tuple[str, ...] = ("round_robin", "least_loaded", "session", "prefix", "kv_aware")
DEFAULT_POLICY = "kv_aware"
ROUTER_PORT, ROUTER_GRPC_PORT = 8080, 50051
ROUTER_GROUPS = ("serving", "engines", "routing", "flow control", "shared state", "reliability", "security and limits")
ROUTER_GROUPS += ("endpoint picker",)  # the Gateway API Inference Extension EPP (docs/gateway.md)


# Router flags set from the chart's values and a RAGServe's spec.router in groups (router.flowControl.queueSize):
# group -> RouterConfig fields. A key is the field's camelCase name less the group's prefix (breaker_failures ->
# breaker.failures); a key left unset leaves its flag out, so the router's default holds.
SETTING_GROUPS: dict[str, tuple[str, ...]] = {
    "flowControl": (
        "max_inflight_per_engine", "queue_size", "queue_timeout", "saturation_queue_depth", "saturation_kv_usage",
        "critical_reserve_per_engine", "engine_priority",
    ),
    "tenantQuotas": ("tenant_header", "tenant_tokens_per_minute", "tenant_max_concurrent", "tenant_fair_share"),
    "breaker": ("breaker_failures", "breaker_cooldown", "breaker_probes"),
    "retry": ("max_attempts", "retry_backoff", "retry_backoff_max", "retry_jitter"),
    "health": ("probe_interval", "health_failure_threshold", "health_success_threshold"),
}  # fmt: skip
AT_LEAST_0 = {"minimum": 0}
GROUP_PREFIXES = {"tenantQuotas": "tenant_", "breaker": "breaker_", "retry": "retry_", "health": "health_"}


def url_list(text: str) -> list[str]:
    """'http://a:8000, http://b:8000/' -> engine base URLs (no trailing slash)."""
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"engine URL must start with http:// or https://, got {url!r}")
    return urls


@dataclass
class RouterConfig(FromArgs):
    host: str = option("0.0.0.0", "bind address for HTTP and gRPC", "serving")
    port: int = option(ROUTER_PORT, "OpenAI-compatible HTTP port", "serving", type=int, spec=True, schema=PORT_SCHEMA)
    grpc_port: int = option(
        ROUTER_GRPC_PORT, "gRPC registry port engines register on", "serving", type=int, spec=True, schema=PORT_SCHEMA
    )
    router_id: str = option("", "this replica's name (default: hostname-pid)", "serving")
    log_level: str = option("info", "log level", "serving", choices=LOG_LEVELS, type=str.lower)
    drain_delay: float = option(0.0, "seconds /ready reports 503 before stopping", "serving", type=float)
    drain_timeout: float = option(30.0, "seconds to finish in-flight requests", "serving", type=float)
    otlp_traces_endpoint: str | None = option(None, "OTLP/gRPC collector for traces (off when unset)", "serving")
    static_engines: list[str] = option([], "comma-separated OpenAI base URLs", "engines", type=url_list)
    external_engine: list[ExternalEngineSpec] = option(
        [], f"an unmodified vLLM engine routed from its KV events, {EXTERNAL_FORMAT} (repeatable)", "engines",
        type=external_engine, repeat=True,
    )  # fmt: skip
    tokenizer: str | None = option(None, "external engines' tokenizer: a local model dir or .gguf", "engines")
    external_block_size: int = option(16, "external engines' KV block size (vLLM --block-size)", "engines",
                                      type=positive_int)  # fmt: skip
    k8s_selector: str | None = option(None, "discover ready pods by label selector", "engines")
    external_k8s_selector: str | None = option(
        None, "discover ready external (vLLM) engine pods by label selector, routed from their KV events", "engines"
    )
    k8s_namespace: str | None = option(None, "namespace to watch (default: the pod's own)", "engines")
    k8s_port: int = option(ENGINE_PORT, "engine port unless annotated ragserve.io/port", "engines", type=int)
    engine_api_key: str | None = option(None, "API key the router sends to engines", "engines")
    engine_ca_file: str | None = option(None, "CA bundle to verify https:// engines (default: the system roots)",
                                        "engines")  # fmt: skip
    engine_client_cert_file: str | None = option(None, "client certificate for mutual TLS with engines", "engines")
    engine_client_key_file: str | None = option(None, "client key for mutual TLS with engines", "engines")
    heartbeat_interval_ms: int = option(1000, "engine heartbeat interval", "engines", type=positive_int)
    policy: str = option(DEFAULT_POLICY, "routing policy", "routing", choices=POLICIES, spec=True)
    allow_policy_header: bool = option(False, "let clients pick via X-Ragserve-Policy", "routing", negatable=False)
    work_weight: float = option(0.5, "kv_aware: weight of the request's own prefill time", "routing", type=float)
    store_lookup_ttl: float = option(1.0, "kv_aware: seconds to trust a cachestore lookup", "routing", type=float)
    cachestore_token_file: str | None = option(None, "the cachestore's shared token (for lookups)", "routing")
    cachestore_tls_ca: str | None = option(None, "CA bundle to verify the cachestore (enables TLS)", "routing")
    cachestore_tls_cert: str | None = option(None, "client certificate for mutual TLS with the cachestore", "routing")
    cachestore_tls_key: str | None = option(None, "client key for mutual TLS with the cachestore", "routing")
    bounded_load: float = option(1.25, "prefix/session: no engine above c x average", "routing", type=float)
    prefix_key_blocks: int = option(8, "prefix policy: leading blocks hashed", "routing", type=positive_int)
    session_header: str = option("X-Session-Id", "session policy header (else body 'user')", "routing")
    context_header: str = option("X-Context-Hash", "prefix policy: explicit context identity", "routing")
    approx_ttl: float = option(600.0, "approximate index TTL, seconds", "routing", type=float)
    approx_pending_ttl: float = option(10.0, "trust routing history for engines with events", "routing", type=float)
    approx_max_entries: int = option(200_000, "approximate index size bound", "routing", type=positive_int)
    saturation_queue_depth: int = option(
        5, "an engine with more prompts waiting for prefill is saturated (sheddable requests get 429)", "routing",
        type=int, schema=AT_LEAST_0,
    )  # fmt: skip
    saturation_kv_usage: float = option(
        0.8, "an engine using more of its KV cache (0-1) is saturated (sheddable requests get 429)", "routing",
        type=float, schema=AT_LEAST_0,
    )  # fmt: skip
    disagg_min_prompt_tokens: int = option(
        512, "a prompt this long runs its prefill on a --role prefill engine when the model has one and a decode "
        "engine (shorter ones go straight to a decode or both engine)", "routing", type=int,
    )  # fmt: skip
    max_inflight_per_engine: int = option(
        0, "requests this replica sends an engine at once; more wait in the router queue (0: no limit, no queue)",
        "flow control", type=int, schema=AT_LEAST_0,
    )  # fmt: skip
    critical_reserve_per_engine: int = option(
        0, "places per engine kept for critical requests: standard and sheddable ones are admitted only while an "
        "engine has fewer than --max-inflight-per-engine minus this in flight", "flow control", type=int,
        schema=AT_LEAST_0,
    )  # fmt: skip
    engine_priority: bool = option(
        False, "send the class to the engine as its scheduling priority (body `priority`: critical -1, sheddable 1; "
        "with --tenant-fair-share a request's rank, the places its tenant held, so the engine preempts the tenant "
        "holding the most) when the client set none; for engines run with --scheduling-policy priority", "flow control",
        negatable=False,
    )  # fmt: skip
    queue_size: int = option(256, "requests that may wait in the router queue (full: 429)", "flow control",
                             type=int, schema=AT_LEAST_0)  # fmt: skip
    queue_timeout: float = option(30.0, "seconds a request may wait in the router queue (then 503)", "flow control",
                                  type=float, schema={"exclusiveMinimum": True, "minimum": 0})  # fmt: skip
    tenant_header: str = option(
        "", "header naming the tenant for quotas and fair queueing (default: the API key's name, else the client)",
        "flow control",
    )  # fmt: skip
    tenant_tokens_per_minute: int = option(
        0, "prompt + completion tokens per minute per tenant (0: no limit; over it: 429)", "flow control", type=int,
        schema=AT_LEAST_0,
    )  # fmt: skip
    tenant_max_concurrent: int = option(0, "requests per tenant at once (0: no limit; over it: 429)", "flow control",
                                        type=int, schema=AT_LEAST_0)  # fmt: skip
    tenant_fair_share: bool = option(
        False, "with --max-inflight-per-engine: each active tenant's max-min fair share of the places, by its "
        "recent demand, is kept free for it (others take a place only while more stay free)", "flow control",
        negatable=False,
    )  # fmt: skip
    tenant_quotas_file: str | None = option(
        None, "per-tenant quotas, one a line: 'TENANT [tpm=N] [concurrent=M]' (others: the two flags above)",
        "flow control",
    )  # fmt: skip
    redis: str | None = option(None, "redis:// URL: share registry and KV index between replicas", "shared state")
    redis_prefix: str = option("ragserve:", "key prefix in Redis", "shared state")
    max_attempts: int = option(3, "engines tried before the first byte", "reliability", type=positive_int)
    retry_backoff: float = option(0.05, "seconds before the 1st retry, doubling", "reliability", type=float,
                                  schema=AT_LEAST_0)  # fmt: skip
    retry_backoff_max: float = option(2.0, "longest wait before a retry, seconds", "reliability", type=float,
                                      schema=AT_LEAST_0)  # fmt: skip
    retry_jitter: float = option(
        0.5,
        "share of each retry's backoff drawn at random (0: none, 1: full jitter)",
        "reliability",
        type=float,
        schema={"minimum": 0, "maximum": 1},
    )
    connect_timeout: float = option(5.0, "engine connect timeout, seconds", "reliability", type=float)
    upstream_timeout: float = option(600.0, "engine read timeout, seconds", "reliability", type=float)
    breaker_failures: int = option(
        3, "consecutive engine failures (5xx, connection) that open its circuit breaker", "reliability",
        type=positive_int,
    )  # fmt: skip
    breaker_cooldown: float = option(10.0, "seconds an open breaker keeps its engine out before probes",
                                     "reliability", type=float, schema=AT_LEAST_0)  # fmt: skip
    breaker_probes: int = option(1, "requests let through a half-open breaker", "reliability", type=positive_int)
    migration_limit: int = option(3, "times a stream may move to another engine (0: off)", "reliability", type=int)
    probe_interval: float = option(2.0, "health probe interval, seconds", "reliability", type=float,
                                   schema={"exclusiveMinimum": True, "minimum": 0})  # fmt: skip
    health_failure_threshold: int = option(
        1, "consecutive failed health probes before an engine is unhealthy", "reliability", type=positive_int
    )
    health_success_threshold: int = option(
        1, "consecutive passed health probes before an unhealthy engine is healthy again", "reliability",
        type=positive_int,
    )  # fmt: skip
    api_keys_file: str | None = option(None, "one key per line, optional 'rps=N burst=M'", "security and limits")
    admin_api_key_file: str | None = option(
        None, "file holding the admin key: turns the /admin API on (drain, undrain, add, remove engines)",
        "security and limits",
    )  # fmt: skip
    rate_limit_rps: float = option(0.0, "default requests/s per key (0: off)", "security and limits", type=float)
    rate_limit_burst: int = option(0, "default bucket size (0: 2 x rps)", "security and limits", type=int)
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, "request body limit", "security and limits", type=parse_bytes)
    grpc_max_message_bytes: int = option(
        parse_bytes(GRPC_MAX_MESSAGE), "gRPC message limit", "security and limits", type=parse_bytes
    )
    tls_cert_file: str | None = option(None, "HTTP API (client-facing) TLS certificate (PEM): serve HTTPS",
                                       "security and limits")  # fmt: skip
    tls_key_file: str | None = option(None, "HTTP API TLS private key (PEM)", "security and limits")
    tls_cert: str | None = option(None, "gRPC registry TLS certificate (PEM)", "security and limits")
    tls_key: str | None = option(None, "gRPC registry TLS private key (PEM)", "security and limits")
    tls_client_ca: str | None = option(None, "require engine client certificates signed by this CA",
                                       "security and limits")  # fmt: skip
    registry_token_file: str | None = option(None, "engines must register with this shared token",
                                             "security and limits")  # fmt: skip
    registry_allow_unauthenticated: bool = option(
        False, "accept registrations without a token or mTLS (else they are refused)", "security and limits",
        negatable=False,
    )  # fmt: skip

    epp_port: int = option(0, "Envoy ext_proc (endpoint picker) gRPC port beside the HTTP gateway (0: off)",
                           "endpoint picker", type=int)  # fmt: skip
    epp_cert_file: str | None = option(None, "endpoint picker TLS certificate (PEM; default: self-signed)",
                                       "endpoint picker")  # fmt: skip
    epp_key_file: str | None = option(None, "endpoint picker TLS private key (PEM)", "endpoint picker")
    epp_plaintext: bool = option(False, "serve the endpoint picker without TLS", "endpoint picker", negatable=False)

    def __post_init__(self) -> None:
        if not self.router_id:
            self.router_id = f"{socket.gethostname()}-{os.getpid()}"
        checks = [
            (self.policy in POLICIES, f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}"),
            (bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key must be given together"),
            (not self.tls_client_ca or bool(self.tls_cert), "--tls-client-ca needs --tls-cert and --tls-key"),
            (bool(self.tls_cert_file) == bool(self.tls_key_file), "--tls-cert-file and --tls-key-file go together"),
            (
                bool(self.engine_client_cert_file) == bool(self.engine_client_key_file),
                "--engine-client-cert-file and --engine-client-key-file go together",
            ),
            (self.bounded_load >= 1.0, "--bounded-load must be >= 1.0"),
            (0 <= self.epp_port <= 65535, "--epp-port must be a port number (0: off)"),
            (bool(self.epp_cert_file) == bool(self.epp_key_file), "--epp-cert-file and --epp-key-file go together"),
            (not (self.epp_plaintext and self.epp_cert_file), "--epp-plaintext excludes --epp-cert-file"),
            (self.saturation_queue_depth >= 0, "--saturation-queue-depth must be >= 0"),
            (self.saturation_kv_usage >= 0, "--saturation-kv-usage must be >= 0"),
            (self.max_inflight_per_engine >= 0, "--max-inflight-per-engine must be >= 0"),
            (
                not self.critical_reserve_per_engine or self.critical_reserve_per_engine < self.max_inflight_per_engine,
                "--critical-reserve-per-engine must be below --max-inflight-per-engine",
            ),
            (self.queue_size >= 0 and self.queue_timeout > 0, "--queue-size must be >= 0, --queue-timeout > 0"),
            (min(self.tenant_tokens_per_minute, self.tenant_max_concurrent) >= 0, "tenant quotas must be >= 0"),
            (self.breaker_cooldown >= 0, "--breaker-cooldown must be >= 0"),
            (self.max_attempts >= 1, "--max-attempts must be >= 1"),
            (min(self.retry_backoff, self.retry_backoff_max) >= 0, "--retry-backoff(-max) must be >= 0"),
            (0 <= self.retry_jitter <= 1, "--retry-jitter must be between 0 and 1"),
            (self.migration_limit >= 0, "--migration-limit must be >= 0"),
            (self.disagg_min_prompt_tokens >= 0, "--disagg-min-prompt-tokens must be >= 0"),
            (self.max_body_bytes > 0, "--max-body-bytes must be positive"),
            (self.heartbeat_interval_ms > 0, "--heartbeat-interval-ms must be positive"),
            (self.work_weight >= 0, "--work-weight must be >= 0"),
            (not self.external_engine or bool(self.tokenizer), "--external-engine needs --tokenizer"),
            (not self.external_k8s_selector or bool(self.tokenizer), "--external-k8s-selector needs --tokenizer"),
            (self.external_block_size > 0, "--external-block-size must be positive"),
            (not self.redis or self.redis.startswith(("redis://", "rediss://", "unix://")), "--redis must be a URL"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        paths = (self.tls_cert, self.tls_key, self.tls_client_ca, self.api_keys_file, self.cachestore_token_file)
        paths += (self.tenant_quotas_file, self.tls_cert_file, self.tls_key_file, self.engine_ca_file)
        paths += (self.engine_client_cert_file, self.engine_client_key_file, self.admin_api_key_file)
        if self.tokenizer and not os.path.exists(self.tokenizer):
            raise FileNotFoundError(f"--tokenizer: no such file or directory: {self.tokenizer}")
        for path in (*paths, self.registry_token_file, self.epp_cert_file, self.epp_key_file):
            if path and not os.path.isfile(path):
                raise FileNotFoundError(f"no such file: {path}")


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """`ragserve router`'s flags, one argument group per ROUTER_GROUPS name."""
    add_options(parser, (RouterConfig,), ROUTER_GROUPS)


def spec_options() -> list[tuple[str, Field]]:
    """(camelCase key, field) of every router setting a RAGServe CR sets (spec.router), in field order."""
    return spec_fields(RouterConfig)


def group_options() -> list[tuple[str, list[tuple[str, Field]]]]:
    """(group, [(key, field)]) of SETTING_GROUPS, in order."""
    fields = {f.name: f for f in options(RouterConfig)}
    out = []
    for group, names in SETTING_GROUPS.items():
        prefix = GROUP_PREFIXES.get(group, "")
        out.append((group, [(spec_key(name.removeprefix(prefix)), fields[name]) for name in names]))
    return out


def group_settings(values: dict) -> tuple[tuple[str, object], ...]:
    """(field name, value) of every grouped setting `values` (the chart's router values, a spec.router) sets."""
    out = []
    for group, keys in group_options():
        chosen = values.get(group) or {}
        out += [(f.name, chosen[key]) for key, f in keys if chosen.get(key) is not None]
    return tuple(out)
