"""One cachestore command line: the chart's templates/cachestore/_args.tpl renders, for every value set, exactly
what ragserve.cachestore_command.cachestore_command() (the function the operator calls) builds for the same
settings."""

from __future__ import annotations

import pytest

from ragserve.cachestore_command import CacheStoreLaunch, cachestore_command
from tests.charts.test_engine_command import DEFAULTS, FULLNAME, merged, redis_url, rendered_args, serving_tls

DISK_DIR = "/var/lib/ragserve/cachestore"
EXTRA = {
    "everything": {
        "logLevel": "debug",
        "redis": {"enabled": True},
        "cachestore": {
            "port": 6000,
            "metricsPort": 9191,
            "memory": "1GiB",
            "disk": {"budget": "2GiB"},
            "redisTier": True,
            "redisCapacity": "3GiB",
            "tls": {"enabled": True, "secretName": "s", "clientAuth": True, "engineClientSecret": "c"},
            "auth": {"existingSecret": "tok", "key": "k"},
            "maxMessageBytes": 2097152,
            "extraArgs": ["--workers", "4"],
        },
    },
    "ram-only-external-redis": {
        "redis": {"external": {"url": "redis://r.example:6379/5"}},
        "cachestore": {"disk": {"enabled": False}, "redisTier": True, "tls": {"enabled": True, "secretName": "s"}},
    },
}


def expected(values: dict) -> list[str]:
    """cachestore_command() for the chart's values, with the chart's wiring (mount paths, Redis Service)."""
    cs = values["cachestore"]
    disk, redis = cs["disk"]["enabled"], cs["redisTier"]
    pod = CacheStoreLaunch(
        port=cs["port"],
        metrics_port=cs["metricsPort"],
        memory=cs["memory"],
        log_level=values["logLevel"].upper(),
        disk_dir=DISK_DIR if disk else None,
        disk=cs["disk"]["budget"] if disk else None,
        redis=redis_url(values, 1) if redis else None,
        redis_capacity=cs["redisCapacity"] if redis else None,
        redis_prefix="ragserve-kv:$(POD_NAME):" if redis else None,
        tls=serving_tls(cs["tls"]),
        auth_token_file=f"/etc/ragserve/auth/{cs['auth']['key']}" if cs["auth"]["existingSecret"] else None,
        max_message_bytes=cs["maxMessageBytes"],
        extra_args=tuple(cs["extraArgs"]),
    )
    return cachestore_command(pod)


def check_cachestore_args(render, user_values: dict) -> None:
    values = merged(DEFAULTS, user_values)
    args = rendered_args(render(user_values), "StatefulSet", f"{FULLNAME}-cachestore", "cachestore")
    assert args == (expected(values) if values["cachestore"]["enabled"] else None)


def test_chart_cachestore_args_are_cachestore_command(render, values):
    check_cachestore_args(render, values)


@pytest.mark.parametrize("name", list(EXTRA))
def test_more_cachestore_settings(render, name):
    check_cachestore_args(render, EXTRA[name])
