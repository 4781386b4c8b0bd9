"""The `ragserve engine` command line of an engine pod in Kubernetes, built once: the operator calls
`engine_command()`, and tests/charts/test_engine_command.py renders the chart's
templates/engine/_args.tpl for the same settings and requires the same arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ragserve.engine_args import ENGINE_PORT, spec_options
from ragserve.flags import flag_of

# The kubelet expands $(POD_IP) from the container's POD_IP env var (the downward API's status.podIP).
ADVERTISE_URL = "http://$(POD_IP):{port}"


@dataclass(frozen=True)
class TLSFiles:
    """Client-side TLS files mounted in the pod; ca alone is TLS, with cert and key it is mutual TLS."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class EnginePod:
    """What an engine pod's command line depends on."""

    model: str
    served_model_name: str | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)  # settings by camelCase key (spec_options())
    port: int = ENGINE_PORT
    router: str | None = None  # registry HOST:PORT; the pod then advertises its own IP
    router_tls: TLSFiles = TLSFiles()
    registry_token_file: str | None = None  # the router registry's shared token (--registry-token-file)
    cachestore: tuple[str, ...] = ()  # every cachestore pod's HOST:PORT (the client shards over them)
    cachestore_tls: TLSFiles = TLSFiles()
    cachestore_token_file: str | None = None
    max_body_bytes: int | None = None
    log_level: str | None = None
    drain_timeout: int | None = None
    extra_args: tuple[str, ...] = ()


def scalar(value: Any) -> str:
    """A flag value as text; whole floats as integers (YAML and JSON numbers may arrive as floats)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def arg(name: str, value: Any) -> list[str]:
    """[--flag, value] for a field name, or nothing when the value is unset (None or "")."""
    return [] if value is None or value == "" else [flag_of(name), scalar(value)]


def spec_flags(engine: Mapping[str, Any]) -> list[str]:
    """The engine settings a pool sets, in field order; bools as --flag / --no-flag, unset ones left out."""
    out: list[str] = []
    for key, f in spec_options():
        value = engine.get(key)
        if isinstance(value, bool):
            out.append(flag_of(f.name) if value else "--no-" + flag_of(f.name)[2:])
        else:
            out += arg(f.name, value)
    return out


def tls_flags(peer: str, files: TLSFiles) -> list[str]:
    """--<peer>-tls-ca/-cert/-key for the files that are set."""
    return [a for part in ("ca", "cert", "key") for a in arg(f"{peer}_tls_{part}", getattr(files, part))]


def engine_command(pod: EnginePod) -> list[str]:
    """`ragserve engine ...` arguments (the container's args; its command is `ragserve`)."""
    args = ["engine", *arg("host", "0.0.0.0"), *arg("port", pod.port), *arg("model", pod.model)]
    args += arg("served_model_name", pod.served_model_name) + spec_flags(pod.engine)
    if pod.router:
        args += arg("router", pod.router) + arg("advertise_url", ADVERTISE_URL.format(port=pod.port))
        args += arg("registry_token_file", pod.registry_token_file) + tls_flags("router", pod.router_tls)
    if pod.cachestore:
        args += arg("cachestore", ",".join(pod.cachestore)) + tls_flags("cachestore", pod.cachestore_tls)
        args += arg("cachestore_token_file", pod.cachestore_token_file)
    args += arg("max_body_bytes", pod.max_body_bytes) + arg("log_level", pod.log_level)
    args += arg("drain_timeout", pod.drain_timeout)
    return args + list(pod.extra_args)
