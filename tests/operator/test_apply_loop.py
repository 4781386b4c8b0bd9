"""Exact convergence, end to end: the operator (a subprocess) applies its children to the in-memory API with
server-side apply; keys, list items and whole sections removed from the RAGServe leave the children within
one reconcile, fields other managers set stay, and a field someone else changed is reported as a conflict
and taken back."""

from __future__ import annotations

import pytest

from tests.helpers.ragserve_cr import BASE, DEPLOYMENTS, NS, RAGSERVES, ragserve

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]

PART = {
    "nodeSelector": {"zone": "z1", "disk": "ssd"},
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
    "tolerations": [{"key": "gpu", "operator": "Exists"}, {"key": "spot", "operator": "Exists"}],
}
SPEC = {
    "engines": [{"name": "a", "model": "m", **PART}],
    "router": PART,
    "cachestore": {**PART, "disk": "1GiB"},
}
LEAN_POOL = {  # zone, the memory request, limits, env A and one toleration removed
    "name": "a",
    "model": "m",
    "nodeSelector": {"disk": "ssd"},
    "resources": {"requests": {"cpu": "1"}},
    "env": [{"name": "B", "value": "2"}],
    "tolerations": [{"key": "spot", "operator": "Exists"}],
}
DEPLOYMENTS_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"


def pod_spec(kube, resource: str, name: str) -> dict:
    return ((kube.obj(resource, name) or {}).get("spec") or {}).get("template", {}).get("spec", {})


def status_of(kube, name: str) -> dict:
    return (kube.obj(RAGSERVES, name) or {}).get("status") or {}


async def test_removed_fields_leave_the_children_and_foreign_fields_stay(kube, operator, eventually):
    await kube.call("POST", BASE, ragserve("conv", SPEC))
    await eventually(lambda: pod_spec(kube, DEPLOYMENTS, "conv-engine-a").get("nodeSelector"), what="engines")
    await eventually(lambda: status_of(kube, "conv").get("observedGeneration") == 1, what="first pass done")
    # other managers add their own fields
    annotate = {"metadata": {"annotations": {"team.example/owner": "search"}}}
    await kube.call("PATCH", f"{DEPLOYMENTS_PATH}/conv-engine-a?fieldManager=kubectl-annotate", annotate)
    await kube.call("PATCH", f"{DEPLOYMENTS_PATH}/conv-router?fieldManager=kubectl-annotate", annotate)
    service_label = {"metadata": {"labels": {"mesh.example/injected": "true"}}}
    await kube.call("PATCH", f"/api/v1/namespaces/{NS}/services/conv-router?fieldManager=mesh", service_label)

    # keys, items and sections removed: pool (keys and items), router (whole sections), cachestore (disk)
    gone = {"nodeSelector": None, "tolerations": None, "resources": None}  # (None: a merge patch's removal)
    lean = {"engines": [LEAN_POOL], "router": {**gone, "env": PART["env"][1:]}, "cachestore": {**gone, "disk": None}}
    await kube.call("PATCH", f"{BASE}/conv", {"spec": lean})
    await eventually(lambda: status_of(kube, "conv").get("observedGeneration") == 2, what="the next reconcile")

    engine_pod = pod_spec(kube, DEPLOYMENTS, "conv-engine-a")
    engine = engine_pod["containers"][0]
    assert engine_pod["nodeSelector"] == {"disk": "ssd"}
    assert engine["resources"] == {"requests": {"cpu": "1"}}
    assert [e["name"] for e in engine["env"] if e["name"] in ("A", "B")] == ["B"]
    assert engine_pod["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    router_pod = pod_spec(kube, DEPLOYMENTS, "conv-router")
    assert "nodeSelector" not in router_pod and "tolerations" not in router_pod
    assert router_pod["containers"][0]["resources"] == {}
    assert "A" not in {e["name"] for e in router_pod["containers"][0]["env"]}
    store = kube.obj("apps/v1/statefulsets", "conv-cachestore")["spec"]["template"]["spec"]
    assert "--disk" not in store["containers"][0]["args"] and "data" not in {v["name"] for v in store["volumes"]}
    assert "nodeSelector" not in store

    # what others set is still there
    for name in ("conv-engine-a", "conv-router"):
        assert kube.obj(DEPLOYMENTS, name)["metadata"]["annotations"] == {"team.example/owner": "search"}
    assert kube.obj("v1/services", "conv-router")["metadata"]["labels"]["mesh.example/injected"] == "true"

    # every child write of the operator was an apply patch under its field manager
    writes = [r for r in kube._requests if r.method.upper() in ("PATCH", "POST") and "/deployments" in str(r.url)]
    ours = [r for r in writes if r.params.get("fieldManager") == "ragserve-operator"]
    assert ours and all(r.headers.get("Content-Type") == "application/apply-patch+yaml" for r in ours)
    assert not [r for r in writes if r.method.upper() == "POST"]  # created by apply too


async def test_a_field_changed_by_someone_else_is_reported_and_taken_back(kube, operator, eventually):
    await kube.call("POST", BASE, ragserve("edit", {"engines": [{"name": "a", "model": "m"}]}))
    await eventually(lambda: kube.obj(DEPLOYMENTS, "edit-engine-a"), what="engine Deployment")
    image = pod_spec(kube, DEPLOYMENTS, "edit-engine-a")["containers"][0]["image"]
    container = pod_spec(kube, DEPLOYMENTS, "edit-engine-a")["containers"][0]
    hand_edit = {"spec": {"template": {"spec": {"containers": [{**container, "image": "mine:dev"}]}}}}
    await kube.call("PATCH", f"{DEPLOYMENTS_PATH}/edit-engine-a?fieldManager=kubectl-edit", hand_edit)

    await eventually(lambda: status_of(kube, "edit").get("lastApplyConflicts"), what="the conflict in status")
    (conflict,) = status_of(kube, "edit")["lastApplyConflicts"]["conflicts"]
    assert conflict.startswith("Deployment edit-engine-a: .spec.template.spec.containers[")
    assert '.image (conflict with "kubectl-edit" using apps/v1)' in conflict
    assert pod_spec(kube, DEPLOYMENTS, "edit-engine-a")["containers"][0]["image"] == image  # taken back
    assert any(e["reason"] == "ApplyConflict" and e["type"] == "Warning" for e in kube.events())
