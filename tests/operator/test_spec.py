"""Spec parsing: CRD defaults applied like the API server does, every problem reported with its path."""

from __future__ import annotations

import pytest

from ragserve_operator.spec import SpecError, parse_spec

POOL = {"name": "a", "model": "m"}


def test_defaults_come_from_the_crd_schema():
    spec = parse_spec({"engines": [POOL]}, "demo")
    pool = spec.pools[0]
    assert pool.engine_flags["blockSize"] == 16 and pool.engine_flags["kvCacheDtype"] == "auto"
    assert (pool.raw["replicas"], pool.raw["minReplicas"], pool.raw["maxReplicas"]) == (1, 1, 4)
    assert pool.image.repository == "ghcr.io/ragserve/ragserve-engine"
    assert spec.image.repository == "ghcr.io/ragserve/ragserve"
    assert (spec.router["policy"], spec.router["grpcPort"]) == ("kv_aware", 50051)
    assert (spec.cachestore["enabled"], spec.cachestore["memory"], spec.cachestore["disk"]) == (True, "4GiB", "")
    assert spec.redis["mode"] == "off" and spec.autoscaling["mode"] == "none"
    assert spec.autoscaling["scaleDownStabilizationSeconds"] == 300


def test_pool_image_overrides_the_engine_image_field_by_field():
    spec = parse_spec({"engineImage": {"tag": "1.2"}, "engines": [{**POOL, "image": {"repository": "my/engine"}}]})
    assert spec.pools[0].image.ref("x") == "my/engine:1.2"
    assert parse_spec({"engines": [POOL]}).pools[0].image.ref("0.1.0") == "ghcr.io/ragserve/ragserve-engine:0.1.0"


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            {"engines": [{**POOL, "minReplicas": 3, "maxReplicas": 2}]},
            "spec.engines[0]: minReplicas must be <= maxReplicas",
        ),
        (
            {"engines": [{**POOL, "engine": {"kvCacheDtype": "fp4"}}]},
            "spec.engines[0].engine.kvCacheDtype: 'fp4' is not one of",
        ),
        ({"engines": [POOL, POOL]}, "spec.engines: pool name 'a' is used twice"),
        ({"engines": [POOL], "router": {"replicas": 2}}, "router.replicas > 1 needs shared state"),
        ({"engines": [POOL], "cachestore": {"redisTier": True}}, "cachestore.redisTier needs a Redis"),
        ({"engines": [POOL], "redis": {"mode": "external"}}, "redis.mode external needs redis.url or redis.urlSecret"),
        ({"engines": [POOL], "cachestore": {"tls": {"enabled": True}}}, "cachestore.tls.enabled needs cachestore.tls"),
        (
            {"engines": [POOL], "cachestore": {"tls": {"enabled": True, "secretName": "s", "clientAuth": True}}},
            "cachestore.tls.clientAuth needs cachestore.tls.engineClientSecret",
        ),
        ({"engines": [POOL], "router": {"tls": {"enabled": True}}}, "router.tls.enabled needs router.tls.secretName"),
        (
            {"engines": [POOL], "router": {"tls": {"enabled": True, "secretName": "s", "clientAuth": True}}},
            "router.tls.clientAuth needs router.tls.engineClientSecret",
        ),
        ({"engines": [POOL], "redis": {"mode": "external", "url": "http://x"}}, "spec.redis.url: 'http://x' does not"),
        ({"engines": [POOL], "cachestore": {"disk": "5PiB"}}, "spec.cachestore.disk: '5PiB' does not match"),
        ({}, "'engines' is a required property"),
        (None, "'engines' is a required property"),
    ],
)
def test_invalid_specs_say_what_to_fix(spec, message):
    with pytest.raises(SpecError) as exc:
        parse_spec(spec, "demo")
    assert message in str(exc.value)


def test_all_problems_reported_at_once():
    bad = {"engines": [{"name": "a", "model": "m", "engine": {"blockSize": 7, "dtype": "int4"}}]}
    with pytest.raises(SpecError) as exc:
        parse_spec(bad)
    assert "blockSize" in str(exc.value) and "dtype" in str(exc.value)


@pytest.mark.parametrize("name", ["1abc", "a" * 32, "with.dot", "UPPER"])
def test_names_that_cannot_prefix_children(name: str):
    with pytest.raises(SpecError, match="metadata.name .* must be a DNS-1035 label of at most 31 characters"):
        parse_spec({"engines": [POOL]}, name)


def test_redis_modes():
    assert parse_spec({"engines": [POOL], "router": {"replicas": 3}, "redis": {"mode": "inCluster"}})
    ok = parse_spec({"engines": [POOL], "redis": {"mode": "external", "urlSecret": {"name": "s"}}})
    assert ok.redis["urlSecret"] == {"name": "s", "key": "url"}
