"""The CRDs (RAGServe, RAGServeEnginePool): valid apiextensions objects, one source each (the templates +
the engine's settings) with generated copies that are not stale, a description on every field, a schema
that rejects what it can express, CEL rules mirrored by the operator, the pool's scale subresource and
printer columns, and the kubectl install manifests."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ragserve import cachestore_args, router_args
from ragserve.cachestore_args import CACHESTORE_PORT, CacheStoreConfig
from ragserve.cli import build_parser
from ragserve.engine_args import BLOCK_SIZES, EngineConfig, spec_options
from ragserve.flags import SIZE_PATTERN, parse_bytes
from ragserve.router_args import DEFAULT_POLICY, POLICIES, RouterConfig
from ragserve_operator.crd import crd, crd_yaml, crds, crds_yaml, pool_crd
from ragserve_operator.kube import KINDS
from ragserve_operator.spec import CROSS_FIELD_RULES, POOL_RULES, apply_defaults, spec_schema

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "operator/scripts/gen_crd.py"
COPIES = {
    ROOT / "charts/ragserve/crds/ragserve.dev_ragserves.yaml": lambda: crd_yaml(crd()),
    ROOT / "charts/ragserve/crds/ragserve.dev_ragserveenginepools.yaml": lambda: crd_yaml(pool_crd()),
    ROOT / "operator/deploy/01-crd.yaml": crds_yaml,
}
K8S = "1.30.0"


def test_crds_are_valid_custom_resource_definitions():
    for obj in crds():
        assert kubernetes_validate.validate(obj, K8S, strict=True)
    version = crd()["spec"]["versions"][0]
    assert (crd()["metadata"]["name"], version["name"]) == ("ragserves.ragserve.dev", "v1alpha1")
    assert version["subresources"] == {"status": {}}
    assert pool_crd()["metadata"]["name"] == "ragserveenginepools.ragserve.dev"


def test_pool_scale_subresource_points_at_its_fields():
    """What kubectl scale / an HPA read and write: spec.replicas, status.replicas, status.selector (a string)."""
    pool = pool_crd()["spec"]["versions"][0]
    scale = pool["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    schema = pool["schema"]["openAPIV3Schema"]["properties"]
    assert schema["spec"]["properties"]["replicas"]["type"] == "integer"
    assert schema["status"]["properties"]["replicas"]["type"] == "integer"
    assert schema["status"]["properties"]["selector"]["type"] == "string"
    columns = {c["name"]: c["jsonPath"] for c in pool["additionalPrinterColumns"]}
    assert columns["Desired"] == ".spec.replicas" and columns["Ready"] == ".status.readyReplicas"
    for path in columns.values():
        section, _, field = path.removeprefix(".").partition(".")
        assert section == "metadata" or field in schema[section]["properties"], path


@pytest.mark.parametrize("copy_path", COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_copies_are_generated(copy_path: Path):
    assert copy_path.read_text() == COPIES[copy_path](), f"stale: run python {GENERATOR.relative_to(ROOT)}"


def test_generator_check_mode():
    done = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_engine_settings_are_the_engines():
    """Keys, defaults and enums of spec.engines[].engine come from ragserve.engine_args."""
    engine = spec_schema()["properties"]["engines"]["items"]["properties"]["engine"]["properties"]
    assert list(engine) == [key for key, _ in spec_options()]
    assert engine["blockSize"]["enum"] == list(BLOCK_SIZES)
    defaults = apply_defaults(spec_schema(), {"engines": [{"name": "a", "model": "m"}]})["engines"][0]["engine"]
    for key, f in spec_options():
        assert defaults.get(key) == getattr(EngineConfig(), f.name), key
    assert spec_schema()["properties"]["cachestore"]["properties"]["memory"]["pattern"] == SIZE_PATTERN


def test_router_settings_are_the_routers():
    """spec.router's policy (enum and default) and ports come from ragserve.router_args, in the template's places."""
    router = spec_schema()["properties"]["router"]["properties"]
    assert router["policy"]["enum"] == list(POLICIES)
    assert {key for key, _ in router_args.spec_options()} == {"policy", "port", "grpcPort"}
    assert list(router)[1:4] == ["policy", "port", "grpcPort"]  # where the template puts them
    defaults = apply_defaults(spec_schema(), {"engines": [{"name": "a", "model": "m"}]})["router"]
    for key, f in router_args.spec_options():
        assert defaults[key] == getattr(RouterConfig(), f.name), key
    assert defaults["policy"] == DEFAULT_POLICY
    assert router["port"]["description"] == "The HTTP API port."  # the template's text, not the flag's help


def test_cachestore_settings_are_the_cachestores():
    """spec.cachestore's port and memory (type, limits, default) come from ragserve.cachestore_args."""
    store = spec_schema()["properties"]["cachestore"]["properties"]
    assert [key for key, _ in cachestore_args.spec_options()] == ["port", "memory"]
    assert list(store)[2:4] == ["port", "memory"]  # where the template puts them
    assert (store["port"]["minimum"], store["port"]["maximum"]) == (1, 65535)
    assert store["memory"]["pattern"] == SIZE_PATTERN
    defaults = apply_defaults(spec_schema(), {"engines": [{"name": "a", "model": "m"}]})["cachestore"]
    assert defaults["port"] == CacheStoreConfig().port == CACHESTORE_PORT
    assert parse_bytes(defaults["memory"]) == CacheStoreConfig().memory
    assert store["port"]["description"] == "The gRPC port."  # the template's text, not the flag's help


def test_printer_columns_point_at_status_fields():
    version = crd()["spec"]["versions"][0]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == ".status.readyEngines" and columns["Desired"] == ".status.desiredEngines"
    for path in columns.values():
        if path.startswith(".status."):
            assert path.removeprefix(".status.") in status


def _walk(schema: dict, path: str = "spec"):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def _fields(schema: dict, path: str = ""):
    """Every named field (what `kubectl explain` lists), list items' fields included."""
    for key, sub in schema.get("properties", {}).items():
        yield f"{path}.{key}", sub
        yield from _fields(sub, f"{path}.{key}")
        yield from _fields(sub.get("items") or {}, f"{path}.{key}[]")


@pytest.mark.parametrize("obj", crds(), ids=lambda c: c["spec"]["names"]["kind"])
def test_every_field_is_described(obj: dict):
    """`kubectl explain` has something to say about every field."""
    schema = obj["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema.get("description")
    missing = [path for path, node in _fields(schema) if len(node.get("description") or "") < 4]
    assert missing == []


def test_schema_is_structural():
    """Every node has a type (int-or-string and preserve-unknown-fields nodes aside), as the API server requires."""
    for path, node in _walk(spec_schema()):
        assert (
            "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        ), path


def _schema_errors(spec: dict) -> list[str]:
    spec = apply_defaults(spec_schema(), copy.deepcopy(spec))
    return [e.message for e in jsonschema.Draft4Validator(spec_schema()).iter_errors(spec)]


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ({"engines": [{"name": "a", "model": "m", "engine": {"kvCacheDtype": "fp4"}}]}, "'fp4' is not one of"),
        ({"engines": [{"name": "a", "model": "m", "engine": {"blockSize": 12}}]}, "12 is not one of"),
        ({"engines": [{"name": "a", "model": "m", "minReplicas": 0}]}, "0 is less than the minimum of 1"),
        ({"engines": [{"name": "A_b", "model": "m"}]}, "does not match"),
        ({"engines": []}, "should be non-empty"),
        ({"engines": [{"name": "a", "model": "m"}], "router": {"policy": "random"}}, "'random' is not one of"),
        ({"engines": [{"name": "a", "model": "m"}], "cachestore": {"memory": "4 gigs"}}, "does not match"),
        ({"engines": [{"name": "a", "model": "m"}], "autoscaling": {"targetKVCacheUsage": 0}}, "less than or equal"),
        ({"engines": [{"name": "a", "model": "m"}], "autoscaling": {"mode": "vpa"}}, "'vpa' is not one of"),
        ({"engines": [{"name": "a"}]}, "'model' is a required property"),
        ({"engines": [{"name": "a", "model": "m", "compileCachePVC": {}}]}, "'claimName' is a required property"),
    ],
)
def test_schema_rejects(spec: dict, fragment: str):
    errors = _schema_errors(spec)
    assert any(fragment in e for e in errors), errors


def test_example_specs_pass_the_schema():
    assert _schema_errors({"engines": [{"name": "default", "model": "smollm2-135m"}]}) == []
    assert _schema_errors(yaml.safe_load((ROOT / "operator/examples/ragserve.yaml").read_text())["spec"]) == []


def _cel_messages(schema: dict) -> set[str]:
    return {rule["message"] for _, node in _walk(schema) for rule in node.get("x-kubernetes-validations", [])}


def test_every_cel_rule_is_mirrored_by_the_operator():
    """kmock (and clusters older than CEL) do not run CEL: the operator checks the same rules itself."""
    assert _cel_messages(spec_schema()) == {m for m, _ in CROSS_FIELD_RULES} | {m for m, _ in POOL_RULES}
    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert "metadata.name must be a DNS-1035 label of at most 31 characters" in root[0]["message"]


def test_print_crd_cli():
    out = subprocess.run(
        [sys.executable, "-m", "ragserve.cli", "operator", "--print-crd"], capture_output=True, text=True, check=True
    )
    assert list(yaml.safe_load_all(out.stdout)) == crds()


def _deploy_objects() -> list[dict]:
    docs = []
    for path in sorted((ROOT / "operator/deploy").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_kubectl_manifests_validate_and_run_the_operator_cli():
    objs = _deploy_objects()
    assert [o["kind"] for o in objs][:2] == ["Namespace", "CustomResourceDefinition"]
    for obj in objs:
        kubernetes_validate.validate(obj, K8S, strict=True)
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.all_namespaces) == ("operator", True)
    assert args.liveness == "http://0.0.0.0:8080/healthz" and container["ports"][0]["containerPort"] == 8080
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_cluster_role_covers_every_kind_the_operator_touches():
    role = next(o for o in _deploy_objects() if o["kind"] == "ClusterRole")
    granted = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    for kind in KINDS.values():
        group = kind.api_version.rsplit("/", 1)[0] if "/" in kind.api_version else ""
        needed = {"get", "list", "create", "patch", "delete"}
        if kind.plural in ("pods", "ragserves"):  # read only; engine pods are only listed (test_rbac_coverage.py)
            needed = {"list"} if kind.plural == "pods" else {"get", "list", "watch"}
        assert needed <= granted[(group, kind.plural)], kind
    assert {"patch"} <= granted[("ragserve.dev", "ragserves/status")]
    assert {"patch"} <= granted[("ragserve.dev", "ragserveenginepools/status")]
    assert {"get", "patch"} <= granted[("ragserve.dev", "ragserveenginepools/scale")]
    assert {"create"} <= granted[("", "events")]
