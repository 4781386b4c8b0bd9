"""The `ragserve router` command line, built once: the operator's router Deployment, `ragserve up` and the
compose file call `router_command()`, and tests/charts/test_router_command.py renders the chart's
templates/router/_args.tpl for the same settings and requires the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragserve.command_line import ServingTLS, TLSFiles, arg, serving_tls_flags, switch, tls_flags
from ragserve.router_args import ROUTER_GRPC_PORT, ROUTER_PORT


@dataclass(frozen=True)
class RouterLaunch:
    """What a router's command line depends on; None (or empty) leaves a flag out, so the router's default holds."""

    host: str = "0.0.0.0"
    port: int = ROUTER_PORT
    grpc_port: int = ROUTER_GRPC_PORT
    policy: str | None = None
    log_level: str | None = None
    redis: str | None = None  # redis:// URL of the shared state
    static_engines: tuple[str, ...] = ()  # engine base URLs
    external_engines: tuple[str, ...] = ()  # --external-engine values (URL,events=tcp://...), one per vLLM pod
    tokenizer: str | None = None  # the external engines' tokenizer (a dir with tokenizer.json, or a .gguf)
    external_block_size: int | None = None  # their KV block size (vLLM --block-size)
    k8s_selector: str | None = None  # discover engine pods by label selector ...
    k8s_namespace: str | None = None  # ... in this namespace
    engine_tls: TLSFiles = TLSFiles()  # https:// engines: verified against ca; cert and key for mutual TLS
    max_body_bytes: int | str | None = None
    drain_delay: float | None = None
    drain_timeout: float | None = None
    tls: ServingTLS = ServingTLS()  # the gRPC registry's certificate; client_ca: engines must present one
    tls_cert_file: str | None = None  # HTTPS on the client-facing HTTP API ...
    tls_key_file: str | None = None  # ... with this key
    registry_token_file: str | None = None
    registry_allow_unauthenticated: bool = False  # no token, no mTLS: say so, or every registration is refused
    cachestore_tls: TLSFiles = TLSFiles()  # the router's cachestore lookups
    cachestore_token_file: str | None = None
    api_keys_file: str | None = None
    tenant_quotas_file: str | None = None
    admin_api_key_file: str | None = None  # turns on /admin/*
    # Gateway API Inference Extension: the Endpoint Picker (Envoy ext_proc over gRPC) on this port; TLS with a
    # certificate made at start unless cert/key files are given, h2c with epp_plaintext.
    epp_port: int | None = None
    epp_plaintext: bool = False
    epp_cert_file: str | None = None
    epp_key_file: str | None = None
    otlp_traces_endpoint: str | None = None
    settings: tuple[tuple[str, object], ...] = ()  # router_args.group_settings: flow control, quotas, breaker, ...
    extra_args: tuple[str, ...] = ()  # passed through last (a later flag wins)


def engine_tls_flags(files: TLSFiles) -> list[str]:
    """--engine-ca-file / --engine-client-cert-file / --engine-client-key-file for the files that are set."""
    return (
        arg("engine_ca_file", files.ca)
        + arg("engine_client_cert_file", files.cert)
        + arg("engine_client_key_file", files.key)
    )


def router_command(launch: RouterLaunch) -> list[str]:
    """`ragserve router ...` arguments (a container's args; its command is `ragserve`)."""
    r = launch
    args = ["router", *arg("host", r.host), *arg("port", r.port), *arg("grpc_port", r.grpc_port)]
    args += arg("policy", r.policy) + arg("log_level", r.log_level) + arg("redis", r.redis)
    args += arg("static_engines", ",".join(r.static_engines))
    args += [a for spec in r.external_engines for a in arg("external_engine", spec)]
    args += arg("tokenizer", r.tokenizer) + arg("external_block_size", r.external_block_size)
    args += arg("k8s_selector", r.k8s_selector) + arg("k8s_namespace", r.k8s_namespace)
    args += engine_tls_flags(r.engine_tls)
    args += arg("max_body_bytes", r.max_body_bytes) + arg("drain_delay", r.drain_delay)
    args += arg("drain_timeout", r.drain_timeout) + serving_tls_flags(r.tls)
    args += arg("tls_cert_file", r.tls_cert_file) + arg("tls_key_file", r.tls_key_file)
    args += arg("registry_token_file", r.registry_token_file)
    args += switch("registry_allow_unauthenticated", r.registry_allow_unauthenticated)
    args += tls_flags("cachestore", r.cachestore_tls) + arg("cachestore_token_file", r.cachestore_token_file)
    args += arg("api_keys_file", r.api_keys_file) + arg("tenant_quotas_file", r.tenant_quotas_file)
    args += arg("admin_api_key_file", r.admin_api_key_file)
    args += arg("epp_port", r.epp_port)
    args += switch("epp_plaintext", r.epp_plaintext) + arg("epp_cert_file", r.epp_cert_file)
    args += arg("epp_key_file", r.epp_key_file) + arg("otlp_traces_endpoint", r.otlp_traces_endpoint)
    args += [a for name, value in r.settings for a in (switch if isinstance(value, bool) else arg)(name, value)]
    return args + list(r.extra_args)
