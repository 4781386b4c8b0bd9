"""The `ragserve cachestore` command line, built once: the operator's StatefulSet, `ragserve up`'s child and
the compose service call `cachestore_command()`; tests/charts/test_cachestore_command.py renders the chart's
templates/cachestore/_args.tpl for the same settings and requires the same arguments."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ragserve.cachestore_args import CACHESTORE_PORT
from ragserve.command_line import ServingTLS, arg, serving_tls_flags


@dataclass(frozen=True)
class CacheStoreLaunch:
    """What a cachestore's command line depends on; each field but tls and extra_args is the CacheStoreConfig
    flag of that name, given in this order (unset ones left out)."""

    host: str = "0.0.0.0"
    port: int = CACHESTORE_PORT
    metrics_port: int | None = None
    memory: str | int | None = None
    log_level: str | None = None
    disk_dir: str | None = None
    disk: str | int | None = None
    redis: str | None = None
    redis_capacity: str | int | None = None
    redis_prefix: str | None = None
    tls: ServingTLS = ServingTLS()
    auth_token_file: str | None = None
    max_message_bytes: str | int | None = None
    otlp_traces_endpoint: str | None = None
    extra_args: tuple[str, ...] = ()


def cachestore_command(pod: CacheStoreLaunch) -> list[str]:
    """`ragserve cachestore ...` arguments (a container's args; its command is `ragserve`)."""
    args = ["cachestore"]
    for f in fields(pod):
        if f.name == "tls":
            args += serving_tls_flags(pod.tls)
        elif f.name != "extra_args":
            args += arg(f.name, getattr(pod, f.name))
    return args + list(pod.extra_args)
