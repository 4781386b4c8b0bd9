"""The upstream CRDs of the Gateway API (HTTPRoute) and its Inference Extension (InferencePool), from
tests/fixtures/gateway_api (copied from the upstream repositories; each file's header names the commit), and a
strict check of an object against them, as the API server would make it: the object defaulted from the schema,
then its openAPIV3Schema by a JSON-schema validator with unknown fields refused (kubectl --validate=strict),
then every x-kubernetes-validations rule by cel-python (tests/helpers/cel.py)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import yaml

from ragserve_operator.spec import apply_defaults
from tests.helpers.cel import holds, rules_of, values_at

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gateway_api"
CRD_FILES = {
    "InferencePool": "inference.networking.k8s.io_inferencepools.yaml",
    "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml",
}


@functools.cache
def crd(kind: str) -> dict:
    return yaml.safe_load((FIXTURES / CRD_FILES[kind]).read_text())


def schema(api_version: str, kind: str) -> dict:
    """The openAPIV3Schema of `kind` at `api_version` (group/version), as the upstream CRD states it."""
    spec = crd(kind)["spec"]
    group, version = api_version.split("/")
    assert spec["group"] == group and spec["names"]["kind"] == kind, (api_version, kind)
    (served,) = [v for v in spec["versions"] if v["name"] == version and v["served"]]
    return served["schema"]["openAPIV3Schema"]


def closed(node: dict) -> dict:
    """The schema with every object that lists its properties closed to others (unknown fields refused)."""
    out = {
        k: closed(v) if isinstance(v, dict) and k in ("items", "additionalProperties") else v for k, v in node.items()
    }
    if "properties" in node:
        out["properties"] = {k: closed(v) for k, v in node["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


@functools.cache
def validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(closed(schema(api_version, kind)))


def problems(obj: dict) -> list[str]:
    """What the API server would refuse in `obj` (an InferencePool or HTTPRoute); [] when it is valid."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    defaulted = apply_defaults(schema(api_version, kind), copy.deepcopy(obj))
    out = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator(api_version, kind).iter_errors(defaulted)
    ]
    for path, rule in rules_of(schema(api_version, kind)):
        for value in values_at(defaulted, path):
            if not holds(rule["rule"], value):
                out.append(f"{path}: {rule.get('message', rule['rule'])}")
    return out
