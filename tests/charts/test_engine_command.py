"""One engine command line: the chart's templates/engine/_args.tpl renders, for every value set, exactly what
ragserve.engine_command.engine_command() (the function the operator calls) builds for the same settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ragserve.cli import build_parser
from ragserve.command_line import ServingTLS, TLSFiles
from ragserve.engine_command import EnginePod, engine_command

DEFAULTS = yaml.safe_load((Path(__file__).resolve().parents[2] / "charts/ragserve/values.yaml").read_text())
NAMESPACE, FULLNAME = "ai", "rs-ragserve"  # conftest's release "rs" in namespace "ai"
EXTRA = {
    "extra-args-and-drain": {
        "logLevel": "debug",
        "engines": [
            {
                "name": "p",
                "model": "m",
                "extraArgs": ["--seed", "7"],
                "terminationGracePeriodSeconds": 300,
                "preStopSleepSeconds": 10,
                "engine": {"swapSpace": 2.5, "maxModelLen": 4096, "enablePrefixCaching": False},
            }
        ],
    },
    "no-router-no-cachestore": {"router": {"enabled": False}, "cachestore": {"enabled": False}},
    "pool-opts-out": {"engines": [{"name": "solo", "model": "m", "registerWithRouter": False, "useCachestore": False}]},
    "prefill-decode-pools": {
        "engines": [
            {"name": "prefill", "model": "m", "role": "prefill"},
            {"name": "decode", "model": "m", "role": "decode"},
        ],
    },
    "decode-pool-behind-the-picker": {
        "engines": [
            {"name": "prefill", "model": "m", "role": "prefill"},
            {"name": "d1", "model": "m", "role": "decode", "prefiller": {"allow": ["10.0.0.0/8", "fd00::/8"]}},
            {"name": "d2", "model": "m", "role": "decode", "prefiller": {"allow": ["10.1.2.3"], "timeout": 7.5}},
            {"name": "d3", "model": "m", "role": "decode", "prefiller": {"timeout": 30}},
        ],
    },
    "embedding-pool": {
        "engines": [{"name": "default", "model": "m"}, {"name": "embed", "model": "e", "task": "embed"}],
    },
    "https-pools": {
        "router": {"engineTls": {"clientSecret": "router-client"}},
        "engineDefaults": {"httpTls": {"enabled": True, "secretName": "engine-https"}},
        "engines": [
            {"name": "https", "model": "m"},
            {"name": "mtls", "model": "m", "httpTls": {"clientAuth": True}},
            {"name": "plain", "model": "m", "httpTls": {"enabled": False}},
        ],
    },
}


def merged(base: dict, override: dict) -> dict:
    """Maps merge, everything else replaces (Helm's values merge and the chart's ragserve.merge)."""
    out = dict(base)
    for key, value in override.items():
        both_maps = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both_maps else value
    return out


def model_path(pool: dict) -> str:
    source = pool["modelSource"]
    if source["type"] != "none" and not pool["model"].startswith("/"):
        return f"{source['mountPath'].rstrip('/')}/{pool['model']}"
    return pool["model"]


def host(name: str, values: dict) -> str:
    return f"{FULLNAME}-{name}.{NAMESPACE}.svc.{values['clusterDomain']}"


def tls(side: dict, client: str) -> TLSFiles:
    if not side["tls"]["enabled"]:
        return TLSFiles()
    if not side["tls"]["clientAuth"]:
        return TLSFiles(ca=f"/etc/ragserve/{client}-ca/ca.crt")
    files = (f"/etc/ragserve/{client}-ca/ca.crt", f"/etc/ragserve/{client}-client/tls.crt")
    return TLSFiles(*files, f"/etc/ragserve/{client}-client/tls.key")


def serving_tls(side: dict) -> ServingTLS:
    """A server's own certificate files (router registry, cachestore) as the chart mounts them."""
    if not side["enabled"]:
        return ServingTLS()
    ca = "/etc/ragserve/tls/ca.crt" if side["clientAuth"] else None
    return ServingTLS("/etc/ragserve/tls/tls.crt", "/etc/ragserve/tls/tls.key", ca)


def redis_url(values: dict, db: int) -> str | None:
    """--redis of router (db 0) and cachestore (db 1): the chart's Redis Service, else the external URL."""
    if values["redis"]["enabled"]:
        return f"redis://{host('redis', values)}:6379/{db}"
    return values["redis"]["external"]["url"] or None


def rendered_args(docs: list[dict], kind: str, name: str, container: str) -> list[str] | None:
    """The args of `container` in the rendered kind/name, None when the chart renders no such object."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    if not found:
        return None
    (c,) = [c for c in found[0]["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    return c["args"]


def http_tls(pool: dict) -> dict:
    """EnginePod's HTTPS files for engines[].httpTls as the chart mounts its Secret (/etc/ragserve/http-tls)."""
    t = pool["httpTls"]
    if not t["enabled"]:
        return {}
    ca = "/etc/ragserve/http-tls/ca.crt" if t["clientAuth"] else None
    return {"tls_cert_file": "/etc/ragserve/http-tls/tls.crt", "tls_key_file": "/etc/ragserve/http-tls/tls.key",
            "tls_client_ca_file": ca}  # fmt: skip


def expected(values: dict, pool: dict) -> list[str]:
    """engine_command() for a chart pool, with the chart's wiring (Service names, mount paths, grace period)."""
    router, store = values["router"], values["cachestore"]
    registers = router["enabled"] and pool["registerWithRouter"]
    stores = store["enabled"] and pool["useCachestore"]
    headless = host("cachestore-headless", values)
    cachestore = [f"{FULLNAME}-cachestore-{i}.{headless}:{store['port']}" for i in range(store["replicas"])]
    token = store["auth"]["existingSecret"] and f"/etc/ragserve/cachestore-token/{store['auth']['key']}"
    pod = EnginePod(
        model=model_path(pool),
        served_model_name=pool["servedModelName"],
        task=pool["task"],
        role=pool["role"],
        prefiller_allow=tuple(pool["prefiller"]["allow"]),
        prefiller_timeout=pool["prefiller"]["timeout"],
        engine=pool["engine"],
        port=pool["port"],
        router=f"{host('router-registry', values)}:{router['grpcPort']}" if registers else None,
        router_tls=tls(router, "router"),
        **http_tls(pool),
        registry_token_file=f"/etc/ragserve/registry-token/{router['registryAuth']['key']}"
        if registers and router["registryAuth"]["enabled"]
        else None,
        cachestore=tuple(cachestore) if stores else (),
        cachestore_tls=tls(store, "cachestore"),
        cachestore_token_file=token or None,
        max_body_bytes=pool["maxBodyBytes"],
        log_level=values["logLevel"],
        drain_timeout=max(0, pool["terminationGracePeriodSeconds"] - pool["preStopSleepSeconds"] - 5),
        extra_args=tuple(pool["extraArgs"]),
    )
    return engine_command(pod)


def check_engine_args(render, user_values: dict) -> None:
    values = merged(DEFAULTS, user_values)
    docs = {d["metadata"]["name"]: d for d in render(user_values) if d["kind"] == "Deployment"}
    for raw in values["engines"]:
        pool = merged(values["engineDefaults"], raw)
        if pool["runtime"] == "vllm":  # a StatefulSet of vLLM pods: tests/charts/test_vllm_pool.py
            assert f"{FULLNAME}-engine-{pool['name']}" not in docs
            continue
        (container,) = [
            c for c in docs[f"{FULLNAME}-engine-{pool['name']}"]["spec"]["template"]["spec"]["containers"]
            if c["name"] == "engine"
        ]  # fmt: skip
        assert container["args"] == expected(values, pool), pool["name"]


def test_chart_engine_args_are_engine_command(render, values):
    check_engine_args(render, values)


@pytest.mark.parametrize("name", list(EXTRA))
def test_more_engine_settings(render, name):
    check_engine_args(render, EXTRA[name])


def test_decode_pool_renders_its_prefiller_flags(render):
    """engines[].prefiller: what `ragserve engine` parses as --prefiller-allow / --prefiller-timeout; a pool that
    sets neither renders neither (the engine's defaults: no prefiller allowed, 120 s)."""
    docs = {
        d["metadata"]["name"]: d for d in render(EXTRA["decode-pool-behind-the-picker"]) if d["kind"] == "Deployment"
    }
    parsed = {}
    for pool in ("prefill", "d1", "d2", "d3"):
        (c,) = docs[f"{FULLNAME}-engine-{pool}"]["spec"]["template"]["spec"]["containers"]
        args = [a.replace("$(POD_IP)", "10.0.0.7") for a in c["args"]]
        parsed[pool] = build_parser().parse_args(args)
    assert (parsed["d1"].prefiller_allow, parsed["d1"].prefiller_timeout) == (["10.0.0.0/8", "fd00::/8"], 120.0)
    assert (parsed["d2"].prefiller_allow, parsed["d2"].prefiller_timeout) == (["10.1.2.3"], 7.5)
    assert (parsed["d3"].prefiller_allow, parsed["d3"].prefiller_timeout) == ([], 30.0)
    assert (parsed["prefill"].prefiller_allow, parsed["prefill"].prefiller_timeout) == ([], 120.0)
