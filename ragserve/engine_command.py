"""The `ragserve engine` command line of an engine pod in Kubernetes, built once: the operator calls
`engine_command()`, and tests/charts/test_engine_command.py renders the chart's
templates/engine/_args.tpl for the same settings and requires the same arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ragserve.command_line import TLSFiles, arg, bool_flag, tls_flags
from ragserve.engine_args import ENGINE_PORT, spec_options

# The kubelet expands $(POD_IP) from the container's POD_IP env var (the downward API's status.podIP).
ADVERTISE_URL = "{scheme}://$(POD_IP):{port}"


@dataclass(frozen=True)
class EnginePod:
    """What an engine pod's command line depends on (`ragserve up`'s engines are pods on loopback)."""

    model: str
    served_model_name: str | None = None
    task: str = "generate"  # embed: an embedding pool (`--task embed`; no cachestore: nothing to cache)
    role: str = "both"  # prefill | decode: a disaggregated pool (`--role`, docs/disaggregation.md)
    prefiller_allow: tuple[str, ...] = ()  # a decode pool: CIDRs of prefill engines the endpoint picker may name
    prefiller_timeout: float | None = None  # a decode pool: seconds a prefill leg may take (unset: the engine's)
    engine: Mapping[str, Any] = field(default_factory=dict)  # settings by camelCase key (spec_options())
    host: str = "0.0.0.0"
    port: int = ENGINE_PORT
    engine_id: str | None = None  # unset: the engine's own (hostname-pid-starttime)
    router: str | None = None  # registry HOST:PORT; the pod then advertises advertise_url
    advertise_url: str = ADVERTISE_URL  # {scheme} and {port} are filled in; the default is the pod's own IP
    router_tls: TLSFiles = TLSFiles()
    tls_cert_file: str | None = None  # HTTPS on the engine's port (advertised as https://) ...
    tls_key_file: str | None = None  # ... with this key
    tls_client_ca_file: str | None = None  # HTTPS clients (the router) must present a certificate signed by it
    registry_token_file: str | None = None  # the router registry's shared token (--registry-token-file)
    cachestore: tuple[str, ...] = ()  # every cachestore pod's HOST:PORT (the client shards over them)
    cachestore_tls: TLSFiles = TLSFiles()
    cachestore_token_file: str | None = None
    max_body_bytes: int | None = None
    log_level: str | None = None
    drain_timeout: int | None = None
    otlp_traces_endpoint: str | None = None
    extra_args: tuple[str, ...] = ()


def spec_flags(engine: Mapping[str, Any]) -> list[str]:
    """The engine settings a pool sets, in field order; bools as --flag / --no-flag, unset ones left out."""
    out: list[str] = []
    for key, f in spec_options():
        value = engine.get(key)
        out += bool_flag(f.name, value) if isinstance(value, bool) else arg(f.name, value)
    return out


def task_flags(task: str) -> list[str]:
    """--task for an embedding pool; a generating pool's command line leaves the default out."""
    return [] if task == "generate" else arg("task", task)


def role_flags(role: str) -> list[str]:
    """--role for a prefill or decode pool; a `both` pool's command line leaves the default out."""
    return [] if role == "both" else arg("role", role)


def prefiller_flags(allow: tuple[str, ...], timeout: float | None) -> list[str]:
    """A decode pool's prefill leg behind the endpoint picker (docs/gateway.md): --prefiller-allow per CIDR and
    --prefiller-timeout, each left out when unset."""
    return [a for cidr in allow for a in arg("prefiller_allow", cidr)] + arg("prefiller_timeout", timeout)


def engine_command(pod: EnginePod) -> list[str]:
    """`ragserve engine ...` arguments (the container's args; its command is `ragserve`)."""
    args = ["engine", *arg("host", pod.host), *arg("port", pod.port), *arg("model", pod.model)]
    args += arg("served_model_name", pod.served_model_name) + task_flags(pod.task) + role_flags(pod.role)
    args += prefiller_flags(pod.prefiller_allow, pod.prefiller_timeout)
    args += spec_flags(pod.engine)
    args += arg("engine_id", pod.engine_id) + arg("tls_cert_file", pod.tls_cert_file)
    args += arg("tls_key_file", pod.tls_key_file) + arg("tls_client_ca_file", pod.tls_client_ca_file)
    if pod.router:
        url = pod.advertise_url.format(scheme="https" if pod.tls_cert_file else "http", port=pod.port)
        args += arg("router", pod.router) + arg("advertise_url", url)
        args += arg("registry_token_file", pod.registry_token_file) + tls_flags("router", pod.router_tls)
    if pod.cachestore and pod.task != "embed":
        args += arg("cachestore", ",".join(pod.cachestore)) + tls_flags("cachestore", pod.cachestore_tls)
        args += arg("cachestore_token_file", pod.cachestore_token_file)
    args += arg("max_body_bytes", pod.max_body_bytes) + arg("log_level", pod.log_level)
    args += arg("drain_timeout", pod.drain_timeout) + arg("otlp_traces_endpoint", pod.otlp_traces_endpoint)
    return args + list(pod.extra_args)
