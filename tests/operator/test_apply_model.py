"""The operator's apply intents (desired_children, applied as field manager ragserve-operator) on every child
kind and autoscaling mode: the children of a rich spec are applied, another manager adds its own field,
then the children of a spec with map keys, list items and whole sections removed are applied: each child
is then exactly what applying the lean spec to nothing gives, plus the other manager's field. That is, the
operator's intent for the lean spec leaves out every removed field (so server-side apply removes it) and
claims nothing it does not set. The merge is the suite's emulator (server_side_apply.py), the API server's
rules; the operator process doing the same end to end is test_apply_loop.py."""

from __future__ import annotations

import copy

from ragserve_operator.children import OWNED_KINDS, desired_children
from ragserve_operator.kube import FIELD_MANAGER
from ragserve_operator.names import Owner
from ragserve_operator.spec import parse_spec
from tests.operator import server_side_apply as ssa

OWNER = Owner("demo", "ns1", "4b1c2a0e-0000-4000-8000-000000000001")
PART = {
    "nodeSelector": {"zone": "z1", "disk": "ssd"},
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
    "tolerations": [{"key": "gpu", "operator": "Exists"}, {"key": "spot", "operator": "Exists"}],
    "extraArgs": ["--log-level", "debug"],
}
LEAN_PART = {  # zone, memory request, limits, env A, a toleration, extraArgs: gone
    "nodeSelector": {"disk": "ssd"},
    "resources": {"requests": {"cpu": "1"}},
    "env": [{"name": "B", "value": "2"}],
    "tolerations": [{"key": "spot", "operator": "Exists"}],
}
POOL = {"name": "a", "model": "m", "maxReplicas": 3, "modelPVC": {"claimName": "models", "subPath": "x"}}
RICH_INFERENCE_POOL = {
    "enabled": True,
    "annotations": {"a.example/x": "1"},
    "tls": {"mode": "secret", "secretName": "epp"},
    "httpRoute": {
        "enabled": True,
        "annotations": {"a.example/y": "2"},
        "parentRefs": [{"name": "gw", "sectionName": "http"}],
        "hostnames": ["llm.example.com"],
    },
}
LEAN_INFERENCE_POOL = {  # annotations, the certificate Secret, sectionName, hostnames, the timeout: gone
    "enabled": True,
    "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}], "requestTimeout": ""},
}


def rich(mode: str) -> dict:
    return {
        "engines": [{**POOL, **PART, "engine": {"maxNumSeqs": 8}}],
        "router": {**PART, "replicas": 2, "apiKeySecret": {"name": "keys"}},
        "cachestore": {**PART, "disk": "1GiB", "redisTier": True},
        "redis": {"mode": "inCluster", "resources": PART["resources"]},
        "engineApiKeySecret": {"name": "engine-key"},
        "imagePullSecrets": [{"name": "regcred"}],
        "autoscaling": {"mode": mode, "targetRunningRequests": 8},
        "gateway": {"inferencePool": RICH_INFERENCE_POOL},
    }


def lean(mode: str) -> dict:
    return {
        "engines": [{"name": "a", "model": "m", "maxReplicas": 2, **LEAN_PART}],
        "router": {**LEAN_PART, "replicas": 2},
        "cachestore": {**LEAN_PART, "maxMessageBytes": 1000},
        "redis": {"mode": "inCluster"},
        "autoscaling": {"mode": mode},
        "gateway": {"inferencePool": LEAN_INFERENCE_POOL},
    }


def children(raw: dict) -> dict[tuple[str, str], dict]:
    spec = parse_spec(raw, OWNER.name)
    return {(o["kind"], o["metadata"]["name"]): o for o in desired_children(OWNER, spec, {"a": 1})}


def content(obj: dict) -> dict:
    """An object without what the server keeps: managedFields and the like."""
    out = copy.deepcopy(obj)
    for key in ssa.SERVER_METADATA - {"name", "namespace"}:
        out["metadata"].pop(key, None)
    return out


def foreign_edit(obj: dict) -> dict:
    """Another controller annotates the child (an Update by its own manager)."""
    edited = copy.deepcopy(obj)
    edited["metadata"].setdefault("annotations", {})["other.example/checked"] = "yes"
    return ssa.update(obj, edited, "other-controller")


def test_removed_fields_leave_every_child_kind():
    pairs = [(rich("hpa"), lean("hpa")), (rich("keda"), {**lean("keda"), "cachestore": {"enabled": False}})]
    changed_kinds = set()
    for rich_spec, lean_spec in pairs:
        before, after = children(rich_spec), children(lean_spec)
        for key, lean_obj in after.items():
            if key not in before:  # (gone children are pruned, not applied)
                continue
            live = foreign_edit(ssa.apply(None, before[key], FIELD_MANAGER, force=False))
            converged = ssa.apply(live, lean_obj, FIELD_MANAGER, force=False)
            assert converged["metadata"]["annotations"].pop("other.example/checked") == "yes", key  # foreign: kept
            if not converged["metadata"]["annotations"]:
                del converged["metadata"]["annotations"]
            assert content(converged) == content(ssa.apply(None, lean_obj, FIELD_MANAGER, force=False)), key
            if content(before[key]) != content(lean_obj):
                changed_kinds.add(key[0])
    assert changed_kinds == set(OWNED_KINDS) - {"Service"}  # every kind the spec shapes (Services: nothing to drop)


def test_the_removed_fields_are_the_ones_asked_for():
    live = ssa.apply(None, children(rich("hpa"))[("Deployment", "demo-engine-a")], FIELD_MANAGER, force=False)
    live = ssa.apply(live, children(lean("hpa"))[("Deployment", "demo-engine-a")], FIELD_MANAGER, force=False)
    pod = live["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert pod["nodeSelector"] == {"disk": "ssd"}
    assert engine["resources"] == {"requests": {"cpu": "1"}}
    assert "A" not in {e["name"] for e in engine["env"]} and "B" in {e["name"] for e in engine["env"]}
    assert pod["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    assert "model" not in {v["name"] for v in pod["volumes"]} and "debug" not in engine["args"]
    assert "imagePullSecrets" not in pod
