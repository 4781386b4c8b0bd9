"""One router command line: the chart's templates/router/_args.tpl renders, for every value set, exactly what
ragserve.router_command.router_command() (the function the operator calls) builds for the same settings."""

from __future__ import annotations

import pytest

from ragserve.command_line import TLSFiles
from ragserve.router_args import group_settings
from ragserve.router_command import RouterLaunch, router_command
from tests.charts.conftest import NAMESPACE, RELEASE
from tests.charts.test_engine_command import DEFAULTS, FULLNAME, merged, redis_url, rendered_args, serving_tls, tls
from tests.charts.test_vllm_pool import vllm_block_size, vllm_external_engines

EXTRA = {
    "everything": {
        "logLevel": "warning",
        "redis": {"enabled": True},
        "router": {
            "policy": "prefix",
            "port": 9080,
            "grpcPort": 9051,
            "staticEngines": ["http://a:8000", "http://b:8000"],
            "kubernetesDiscovery": {"enabled": True},
            "apiKeys": {"existingSecret": "keys", "key": "k"},
            "tenantQuotasFile": {"existingSecret": "quotas", "key": "q"},
            "adminApiKey": {"existingSecret": "admin", "key": "a"},
            "maxBodyBytes": 2097152,
            "drainDelaySeconds": 10,
            "terminationGracePeriodSeconds": 120,
            "tls": {"enabled": True, "secretName": "s"},
            "registryAuth": {"key": "tok"},
            "extraArgs": ["--max-attempts", "5", "--allow-policy-header"],
        },
        "cachestore": {"tls": {"enabled": True, "secretName": "cs"}, "auth": {"existingSecret": "cs-tok"}},
    },
    "unauthenticated-no-cachestore": {
        "router": {"registryAuth": {"enabled": False, "allowUnauthenticated": True}, "drainDelaySeconds": 70},
        "cachestore": {"enabled": False},
    },
    "epp-plaintext": {"gateway": {"inferencePool": {"enabled": True, "eppPort": 9102, "tls": {"mode": "plaintext"}}}},
    "epp-secret": {"gateway": {"inferencePool": {"enabled": True, "tls": {"mode": "secret", "secretName": "epp"}}}},
    "flow-control-quotas-breaker-retry-health": {
        "router": {
            "flowControl": {
                "maxInflightPerEngine": 4,
                "queueSize": 0,
                "queueTimeout": 2.5,
                "saturationQueueDepth": 0,
                "criticalReservePerEngine": 1,
                "enginePriority": True,
            },
            "tenantQuotas": {"header": "X-Tenant", "tokensPerMinute": 60000, "maxConcurrent": 8, "fairShare": True},
            "breaker": {"failures": 5, "cooldown": 1.5, "probes": 2},
            "retry": {"maxAttempts": 4, "backoff": 0.1, "backoffMax": 1.5, "jitter": 0.25},
            "health": {"probeInterval": 0.5, "failureThreshold": 3, "successThreshold": 2},
            "extraArgs": ["--queue-size", "8"],
        },
    },
    "switches-off": {"router": {"flowControl": {"enginePriority": False}, "tenantQuotas": {"fairShare": False}}},
    "https-api": {"router": {"httpTls": {"enabled": True, "secretName": "router-https"}}},
    "engine-ca-and-client-cert": {"router": {"engineTls": {"caSecret": "engine-ca", "clientSecret": "router-client"}}},
    "engine-ca-only": {"router": {"engineTls": {"caSecret": "engine-ca"}}},
    "mtls-instead-of-token": {
        "router": {
            "registryAuth": {"enabled": False},
            "tls": {"enabled": True, "secretName": "s", "clientAuth": True, "engineClientSecret": "c"},
        },
    },
}


def epp_launch(values: dict) -> dict:
    """RouterLaunch's epp_* settings for gateway.inferencePool (its Secret mounted at /etc/ragserve/epp-tls)."""
    ip = values["gateway"]["inferencePool"]
    if not ip["enabled"]:
        return {}
    secret = ip["tls"]["mode"] == "secret"
    return {
        "epp_port": ip["eppPort"],
        "epp_plaintext": ip["tls"]["mode"] == "plaintext",
        "epp_cert_file": "/etc/ragserve/epp-tls/tls.crt" if secret else None,
        "epp_key_file": "/etc/ragserve/epp-tls/tls.key" if secret else None,
    }


def engine_tls(side: dict) -> TLSFiles:
    """router.engineTls as the chart mounts it: caSecret's ca.crt, clientSecret's tls.crt and tls.key."""
    ca = "/etc/ragserve/engine-ca/ca.crt" if side["caSecret"] else None
    if not side["clientSecret"]:
        return TLSFiles(ca=ca)
    return TLSFiles(ca, "/etc/ragserve/engine-client/tls.crt", "/etc/ragserve/engine-client/tls.key")


def expected(values: dict) -> list[str]:
    """router_command() for the chart's values, with the chart's wiring (mount paths, Services, grace period)."""
    r, store = values["router"], values["cachestore"]
    auth, discover = r["registryAuth"], r["kubernetesDiscovery"]["enabled"]
    keys, quotas, admin = r["apiKeys"], r["tenantQuotasFile"], r["adminApiKey"]
    launch = RouterLaunch(
        port=r["port"],
        grpc_port=r["grpcPort"],
        policy=r["policy"],
        log_level=values["logLevel"],
        redis=redis_url(values, 0),
        static_engines=tuple(r["staticEngines"]),
        external_engines=tuple(vllm_external_engines(values)),
        tokenizer=r["tokenizer"]["path"] if vllm_external_engines(values) else None,
        external_block_size=vllm_block_size(values),
        k8s_selector=f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=engine" if discover else None,
        k8s_namespace=NAMESPACE if discover else None,
        engine_tls=engine_tls(r["engineTls"]),
        max_body_bytes=r["maxBodyBytes"],
        drain_delay=r["drainDelaySeconds"],
        drain_timeout=max(0, r["terminationGracePeriodSeconds"] - r["drainDelaySeconds"] - 5),
        tls=serving_tls(r["tls"]),
        tls_cert_file="/etc/ragserve/http-tls/tls.crt" if r["httpTls"]["enabled"] else None,
        tls_key_file="/etc/ragserve/http-tls/tls.key" if r["httpTls"]["enabled"] else None,
        registry_token_file=f"/etc/ragserve/registry-token/{auth['key']}" if auth["enabled"] else None,
        registry_allow_unauthenticated=not auth["enabled"] and auth["allowUnauthenticated"],
        cachestore_tls=tls(store, "cachestore") if store["enabled"] else TLSFiles(),
        cachestore_token_file=f"/etc/ragserve/cachestore-token/{store['auth']['key']}"
        if store["enabled"] and store["auth"]["existingSecret"]
        else None,
        api_keys_file=f"/etc/ragserve/api-keys/{keys['key']}" if keys["existingSecret"] else None,
        tenant_quotas_file=f"/etc/ragserve/tenant-quotas/{quotas['key']}" if quotas["existingSecret"] else None,
        admin_api_key_file=f"/etc/ragserve/admin-key/{admin['key']}" if admin["existingSecret"] else None,
        **epp_launch(values),
        settings=group_settings(r),
        extra_args=tuple(r["extraArgs"]),
    )
    return router_command(launch)


def check_router_args(render, user_values: dict) -> None:
    values = merged(DEFAULTS, user_values)
    args = rendered_args(render(user_values), "Deployment", f"{FULLNAME}-router", "router")
    assert args == (expected(values) if values["router"]["enabled"] else None)


def test_chart_router_args_are_router_command(render, values):
    check_router_args(render, values)


@pytest.mark.parametrize("name", list(EXTRA))
def test_more_router_settings(render, name):
    check_router_args(render, EXTRA[name])


def test_https_api_mounts_its_secret_and_probes_over_https(render):
    """router.httpTls: the Secret is mounted where --tls-cert-file points, and the kubelet probes over HTTPS."""
    objs = render(EXTRA["https-api"])
    pod = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == f"{FULLNAME}-router")
    spec = pod["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "http-tls")
    assert volume["secret"]["secretName"] == "router-https"
    container = spec["containers"][0]
    assert {"name": "http-tls", "mountPath": "/etc/ragserve/http-tls", "readOnly": True} in container["volumeMounts"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
