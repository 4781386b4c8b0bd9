"""values.schema.json describes and constrains every value; bad values fail with a message naming them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import helm_python as helm
import pytest
import yaml

BAD_VALUES = [
    # (values, where, what the message says)
    ({"router": {"replicas": "2"}}, "/router/replicas", "got string, want integer"),
    ({"router": {"replicas": -1}}, "/router/replicas", "minimum: got -1, want 0"),
    ({"engineDefaults": {"replicas": -2}}, "/engineDefaults/replicas", "minimum: got -2, want 0"),
    ({"engines": [{"name": "a", "model": "m", "replicas": -1}]}, "/engines/0/replicas", "minimum"),
    (
        {"engines": [{"name": "a", "model": "m", "engine": {"kvCacheDtype": "fp4"}}]},
        "/engines/0/engine/kvCacheDtype",
        "must be one of 'auto', 'fp8'",
    ),
    ({"engines": [{"name": "a"}]}, "/engines/0", "missing property 'model'"),
    ({"engines": [{"model": "m"}]}, "/engines/0", "missing property 'name'"),
    ({"engines": [{"name": "a", "model": ""}]}, "/engines/0/model", "minLength"),
    ({"engines": [{"name": "Big_Pool", "model": "m"}]}, "/engines/0/name", "does not match pattern"),
    ({"engines": [{"name": "a", "model": "m", "gpu": 1}]}, "/engines/0", "additional properties 'gpu'"),
    (
        {"engines": [{"name": "d", "model": "m", "prefiller": {"timeout": 0}}]},
        "/engines/0/prefiller/timeout",
        "exclusive",
    ),
    (
        {"engines": [{"name": "d", "model": "m", "prefiller": {"allow": "10.0.0.0/8"}}]},
        "/engines/0/prefiller/allow",
        "array",
    ),
    ({"engines": [{"name": "d", "model": "m", "prefiller": {"cidrs": []}}]}, "/engines/0/prefiller", "'cidrs'"),
    (
        {"engines": [{"name": "a", "model": "m", "engine": {"blockSize": 24}}]},
        "/engines/0/engine/blockSize",
        "must be one of 8, 16, 32, 64, 128",
    ),
    (
        {"engines": [{"name": "a", "model": "m", "engine": {"gpuMemoryUtilization": 1.5}}]},
        "/engines/0/engine/gpuMemoryUtilization",
        "maximum: got 1.5, want 1",
    ),
    (
        {"engineDefaults": {"engine": {"kvCacheMemory": "lots"}}},
        "/engineDefaults/engine/kvCacheMemory",
        "'lots' does not match",
    ),
    ({"engineDefaults": {"model": "m"}}, "/engineDefaults/model", "false schema"),
    ({"engineDefaults": {"autoscaling": {"mode": "vpa"}}}, "/engineDefaults/autoscaling/mode", "one of"),
    ({"engineDefaults": {"autoscaling": {"minReplicas": 0}}}, "/engineDefaults/autoscaling/minReplicas", "minimum"),
    (
        {"engineDefaults": {"autoscaling": {"targetKVCacheUsage": 85}}},
        "/engineDefaults/autoscaling/targetKVCacheUsage",
        "maximum",
    ),
    ({"router": {"policy": "random"}}, "/router/policy", "value must be one of"),
    ({"router": {"port": 70000}}, "/router/port", "maximum"),
    ({"router": {"staticEngines": ["engine:8000"]}}, "/router/staticEngines/0", "does not match pattern"),
    ({"cachestore": {"memory": "4 gigs"}}, "/cachestore/memory", "does not match pattern"),
    ({"cachestore": {"disk": {"persistence": {"size": "-1Gi"}}}}, "/cachestore/disk/persistence/size", "pattern"),
    ({"redis": {"external": {"url": "http://redis:6379"}}}, "/redis/external/url", "does not match pattern"),
    (
        {"monitoring": {"prometheusRule": {"kvCacheUsageFor": "five minutes"}}},
        "/monitoring/prometheusRule/kvCacheUsageFor",
        "pattern",
    ),
    ({"routers": {}}, "", "additional properties 'routers' not allowed"),
]


@pytest.mark.parametrize(("bad", "where", "message"), BAD_VALUES)
def test_schema_rejects_bad_values_clearly(chart, bad, where, message):
    with pytest.raises(helm.HelmValuesError) as exc:
        chart.validate_schema(bad)
    assert f"at '{where}" in str(exc.value) and message in str(exc.value), str(exc.value)


def test_lint_reports_schema_errors(chart_dir):
    report = helm.lint(chart_dir, {"engines": [{"name": "a", "model": "m", "replicas": -1}]}, strict=True)
    assert any("minimum: got -1, want 0" in e for e in report["errors"]), report


CONFLICTS = [
    ({"router": {"replicas": 2}}, "more than one router replica needs shared state"),
    ({"router": {"autoscaling": {"enabled": True}}}, "more than one router replica needs shared state"),
    ({"cachestore": {"redisTier": True}}, "cachestore.redisTier needs a Redis"),
    ({"redis": {"enabled": True, "external": {"url": "redis://r:6379"}}}, "either redis.enabled"),
    ({"router": {"tls": {"enabled": True}}}, "router.tls.enabled needs router.tls.secretName"),
    ({"cachestore": {"tls": {"enabled": True}}}, "cachestore.tls.enabled needs cachestore.tls.secretName"),
    (
        {"router": {"tls": {"enabled": True, "secretName": "t", "clientAuth": True}}},
        "router.tls.clientAuth needs router.tls.engineClientSecret",
    ),
    ({"engines": [{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]}, 'pool name "a" is used twice'),
    ({"engines": [{"name": "a", "model": "m", "modelSource": {"type": "pvc"}}]}, "needs modelSource.pvc.claimName"),
    ({"engines": [{"name": "a", "model": "m", "modelSource": {"type": "hostPath"}}]}, "needs modelSource.hostPath"),
    ({"engines": [{"name": "a", "model": "m", "modelSource": {"type": "image"}}]}, "needs modelSource.image"),
    ({"engines": [{"name": "p", "model": "m", "role": "prefill", "useCachestore": False}]}, "role=prefill needs the"),
    ({"cachestore": {"enabled": False}, "engines": [{"name": "d", "model": "m", "role": "decode"}]}, "decode needs"),
    ({"engines": [{"name": "b", "model": "m", "prefiller": {"allow": ["10.0.0.0/8"]}}]}, "engines[b].prefiller is for"),
    ({"engines": [{"name": "p", "model": "m", "role": "prefill", "prefiller": {"timeout": 5}}]}, "role is prefill"),
    (
        {"engines": [{"name": "a", "model": "m", "autoscaling": {"mode": "hpa", "minReplicas": 5, "maxReplicas": 2}}]},
        "engines[a].autoscaling: minReplicas (5) > maxReplicas (2)",
    ),
    (
        {
            "router": {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None}},
            "redis": {"enabled": True},
        },
        "router.autoscaling needs targetCPUUtilizationPercentage or targetRequestsPerSecond",
    ),
    (
        {
            "engineDefaults": {
                "autoscaling": {"mode": "keda", "targetWaitingRequests": None, "targetKVCacheUsage": None},
            }
        },
        "engines[default].autoscaling needs a target",
    ),
]


@pytest.mark.parametrize(("values", "message"), CONFLICTS)
def test_conflicting_values_fail_rendering_clearly(render_fails, values, message):
    render_fails(values, message)


def resolve(schema: dict, node: dict) -> dict:
    if "$ref" in node:
        return resolve(schema, schema["definitions"][node["$ref"].rsplit("/", 1)[1]])
    if "allOf" in node:
        merged = {"properties": {}}
        for part in node["allOf"]:
            merged["properties"].update(resolve(schema, part).get("properties", {}))
        return merged
    return node


def uncovered(schema: dict, node: dict, value: object, path: str) -> list[str]:
    """Paths in value that the schema does not name, or names without a description."""
    node = resolve(schema, node)
    if isinstance(value, dict) and "properties" in node:
        out = []
        for key, child in value.items():
            sub = node["properties"].get(key)
            if not sub or "description" not in sub:
                out.append(f"{path}.{key}")
            else:
                out += uncovered(schema, sub, child, f"{path}.{key}")
        return out
    if isinstance(value, list) and "items" in node:
        return [p for i, item in enumerate(value) for p in uncovered(schema, node["items"], item, f"{path}[{i}]")]
    return []


def test_every_value_is_in_the_schema_with_a_description(chart_dir):
    schema = json.loads((chart_dir / "values.schema.json").read_text())
    values = yaml.safe_load((chart_dir / "values.yaml").read_text())
    assert uncovered(schema, schema, values, "") == []
    assert uncovered(schema, schema, {"router": {"nope": 1}}, "") == [".router.nope"]  # the walk itself works
    objects = [d for d in schema["definitions"].values() if d.get("type") == "object" and "properties" in d]
    assert objects and all(d.get("additionalProperties") is False for d in objects)


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, name, *args], capture_output=True, text=True)


def test_readme_values_table_matches_the_schema(chart_dir, tmp_path):
    out = run_script(str(chart_dir / "scripts" / "gen_readme.py"), "--check")
    assert out.returncode == 0, out.stdout + out.stderr
    readme = (chart_dir / "README.md").read_text()
    assert "| `engines[].model` | string (required) |" in readme
    assert "| `engineDefaults.engine.kvCacheDtype` | string: `auto`, `fp8`" in readme
    # A schema change without regenerating the README is caught.
    copy = tmp_path / "ragserve"
    shutil.copytree(chart_dir, copy)
    schema = json.loads((copy / "values.schema.json").read_text())
    schema["properties"]["clusterDomain"]["description"] = "changed"
    (copy / "values.schema.json").write_text(json.dumps(schema))
    out = run_script(str(chart_dir / "scripts" / "gen_readme.py"), "--check", "--chart", str(copy))
    assert out.returncode == 1 and "README.md is stale" in out.stdout
