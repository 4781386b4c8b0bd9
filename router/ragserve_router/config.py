"""Router configuration: one dataclass, filled from CLI flags or RAGSERVE_* environment variables."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field, fields

from ragserve.flags import add_flag, parse_bytes, positive_int
from ragserve.logs import LOG_LEVELS
from ragserve.router_args import DEFAULT_POLICY, POLICIES


@dataclass
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    grpc_port: int = 50051
    router_id: str = ""
    policy: str = DEFAULT_POLICY
    allow_policy_header: bool = False
    redis: str | None = None
    redis_prefix: str = "ragserve:"
    static_engines: list[str] = field(default_factory=list)
    k8s_selector: str | None = None
    k8s_namespace: str | None = None
    k8s_port: int = 8000
    api_keys_file: str | None = None
    engine_api_key: str | None = None
    rate_limit_rps: float = 0.0
    rate_limit_burst: int = 0
    max_body_bytes: int = 8 * 1024**2
    grpc_max_message_bytes: int = 64 * 1024**2
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    registry_token_file: str | None = None
    registry_allow_unauthenticated: bool = False
    heartbeat_interval_ms: int = 1000
    work_weight: float = 0.5
    store_lookup_ttl: float = 1.0
    cachestore_token_file: str | None = None
    cachestore_tls_ca: str | None = None
    cachestore_tls_cert: str | None = None
    cachestore_tls_key: str | None = None
    bounded_load: float = 1.25
    prefix_key_blocks: int = 8
    session_header: str = "X-Session-Id"
    context_header: str = "X-Context-Hash"
    approx_ttl: float = 600.0
    approx_pending_ttl: float = 10.0
    approx_max_entries: int = 200_000
    max_attempts: int = 3
    retry_backoff: float = 0.05
    connect_timeout: float = 5.0
    upstream_timeout: float = 600.0
    breaker_failures: int = 3
    migration_limit: int = 3
    probe_interval: float = 2.0
    drain_delay: float = 0.0
    drain_timeout: float = 30.0
    log_level: str = "info"
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not self.router_id:
            self.router_id = f"{socket.gethostname()}-{os.getpid()}"
        checks = [
            (self.policy in POLICIES, f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}"),
            (bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key must be given together"),
            (not self.tls_client_ca or bool(self.tls_cert), "--tls-client-ca needs --tls-cert and --tls-key"),
            (self.bounded_load >= 1.0, "--bounded-load must be >= 1.0"),
            (self.max_attempts >= 1, "--max-attempts must be >= 1"),
            (self.migration_limit >= 0, "--migration-limit must be >= 0"),
            (self.max_body_bytes > 0, "--max-body-bytes must be positive"),
            (self.heartbeat_interval_ms > 0, "--heartbeat-interval-ms must be positive"),
            (self.work_weight >= 0, "--work-weight must be >= 0"),
            (not self.redis or self.redis.startswith(("redis://", "rediss://", "unix://")), "--redis must be a URL"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        paths = (self.tls_cert, self.tls_key, self.tls_client_ca, self.api_keys_file, self.cachestore_token_file)
        for path in (*paths, self.registry_token_file):
            if path and not os.path.isfile(path):
                raise FileNotFoundError(f"no such file: {path}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _url_list(text: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"engine URL must start with http:// or https://, got {url!r}")
    return urls


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serving")
    add_flag(g, "--host", default="0.0.0.0", help="bind address for HTTP and gRPC")
    add_flag(g, "--port", type=int, default=8080, help="OpenAI-compatible HTTP port")
    add_flag(g, "--grpc-port", type=int, default=50051, help="gRPC registry port engines register on")
    add_flag(g, "--router-id", default="", help="this replica's name (default: hostname-pid)")
    add_flag(g, "--log-level", default="info", choices=LOG_LEVELS, type=str.lower, help="log level")
    add_flag(g, "--drain-delay", type=float, default=0.0, help="seconds /ready reports 503 before stopping")
    add_flag(g, "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests")
    add_flag(g, "--otlp-traces-endpoint", default=None, help="OTLP/gRPC collector for traces (off when unset)")
    g = parser.add_argument_group("engines")
    add_flag(g, "--static-engines", type=_url_list, default=[], help="comma-separated OpenAI base URLs")
    add_flag(g, "--k8s-selector", default=None, help="discover ready pods by label selector")
    add_flag(g, "--k8s-namespace", default=None, help="namespace to watch (default: the pod's own)")
    add_flag(g, "--k8s-port", type=int, default=8000, help="engine port unless annotated ragserve.io/port")
    add_flag(g, "--engine-api-key", default=None, help="API key the router sends to engines")
    add_flag(g, "--heartbeat-interval-ms", type=positive_int, default=1000, help="engine heartbeat interval")
    g = parser.add_argument_group("routing")
    add_flag(g, "--policy", default=DEFAULT_POLICY, choices=POLICIES, help="routing policy")
    add_flag(g, "--allow-policy-header", action="store_true", help="let clients pick via X-Ragserve-Policy")
    add_flag(g, "--work-weight", type=float, default=0.5, help="kv_aware: weight of the request's own prefill time")
    add_flag(g, "--store-lookup-ttl", type=float, default=1.0, help="kv_aware: seconds to trust a cachestore lookup")
    add_flag(g, "--cachestore-token-file", default=None, help="the cachestore's shared token (for lookups)")
    add_flag(g, "--cachestore-tls-ca", default=None, help="CA bundle to verify the cachestore (enables TLS)")
    add_flag(g, "--cachestore-tls-cert", default=None, help="client certificate for mutual TLS with the cachestore")
    add_flag(g, "--cachestore-tls-key", default=None, help="client key for mutual TLS with the cachestore")
    add_flag(g, "--bounded-load", type=float, default=1.25, help="prefix/session: no engine above c x average")
    add_flag(g, "--prefix-key-blocks", type=positive_int, default=8, help="prefix policy: leading blocks hashed")
    add_flag(g, "--session-header", default="X-Session-Id", help="session policy header (else body 'user')")
    add_flag(g, "--context-header", default="X-Context-Hash", help="prefix policy: explicit context identity")
    add_flag(g, "--approx-ttl", type=float, default=600.0, help="approximate index TTL, seconds")
    add_flag(g, "--approx-pending-ttl", type=float, default=10.0, help="trust routing history for engines with events")
    add_flag(g, "--approx-max-entries", type=positive_int, default=200_000, help="approximate index size bound")
    g = parser.add_argument_group("shared state")
    add_flag(g, "--redis", default=None, help="redis:// URL: share registry and KV index between replicas")
    add_flag(g, "--redis-prefix", default="ragserve:", help="key prefix in Redis")
    g = parser.add_argument_group("reliability")
    add_flag(g, "--max-attempts", type=positive_int, default=3, help="engines tried before the first byte")
    add_flag(g, "--retry-backoff", type=float, default=0.05, help="seconds before the 1st retry, doubling")
    add_flag(g, "--connect-timeout", type=float, default=5.0, help="engine connect timeout, seconds")
    add_flag(g, "--upstream-timeout", type=float, default=600.0, help="engine read timeout, seconds")
    add_flag(g, "--breaker-failures", type=positive_int, default=3, help="consecutive engine 5xx before a probe")
    add_flag(g, "--migration-limit", type=int, default=3, help="times a stream may move to another engine (0: off)")
    add_flag(g, "--probe-interval", type=float, default=2.0, help="health probe interval, seconds")
    g = parser.add_argument_group("security and limits")
    add_flag(g, "--api-keys-file", default=None, help="one key per line, optional 'rps=N burst=M'")
    add_flag(g, "--rate-limit-rps", type=float, default=0.0, help="default requests/s per key (0: off)")
    add_flag(g, "--rate-limit-burst", type=int, default=0, help="default bucket size (0: 2 x rps)")
    add_flag(g, "--max-body-bytes", type=parse_bytes, default=8 * 1024**2, help="request body limit")
    add_flag(g, "--grpc-max-message-bytes", type=parse_bytes, default=64 * 1024**2, help="gRPC message limit")
    add_flag(g, "--tls-cert", default=None, help="gRPC registry TLS certificate (PEM)")
    add_flag(g, "--tls-key", default=None, help="gRPC registry TLS private key (PEM)")
    add_flag(g, "--tls-client-ca", default=None, help="require engine client certificates signed by this CA")
    add_flag(g, "--registry-token-file", default=None, help="engines must register with this shared token")
    add_flag(
        g,
        "--registry-allow-unauthenticated",
        action="store_true",
        help="accept registrations without a token or mTLS (else they are refused)",
    )
