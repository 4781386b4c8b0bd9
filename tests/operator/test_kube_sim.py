"""The in-memory API server itself (kube_sim.py): the API server behaviours the operator tests rely on
(status subresource, resourceVersion conflicts, garbage collection) hold as on a cluster; the apply merge's
conflicts are test_apply_model.py's."""

from __future__ import annotations

import copy

import pytest

from tests.helpers.ragserve_cr import BASE, DEPLOYMENTS, NS, RAGSERVES, ragserve

pytestmark = pytest.mark.asyncio
DEPLOYMENTS_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
PODS_PATH = f"/api/v1/namespaces/{NS}/pods"


async def request(kube, method: str, path: str, body: dict | list | None = None, **headers: str) -> tuple[int, dict]:
    async with kube.request(method, path, json=body, headers=headers) as response:
        return response.status, await response.json()


def deployment(name: str, owners: list[dict] | None = None) -> dict:
    meta = {"name": name, **({"ownerReferences": owners} if owners else {})}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {"replicas": 1}}


def ref(owner: dict) -> dict:
    meta = owner["metadata"]
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"]}


async def test_status_is_a_subresource(kube):
    await kube.call("POST", DEPLOYMENTS_PATH, {**deployment("d"), "status": {"readyReplicas": 0}})
    path = f"{DEPLOYMENTS_PATH}/d"
    await kube.call("PATCH", path, {"spec": {"replicas": 3}, "status": {"readyReplicas": 3}})
    live = kube.obj(DEPLOYMENTS, "d")
    assert (live["spec"]["replicas"], live["status"]["readyReplicas"]) == (3, 0)  # status through the main: ignored

    await kube.call("PATCH", f"{path}/status", {"spec": {"replicas": 9}, "status": {"readyReplicas": 2}})
    live = kube.obj(DEPLOYMENTS, "d")
    assert (live["spec"]["replicas"], live["status"]["readyReplicas"]) == (3, 2)  # /status: only status

    put = {**copy.deepcopy(live), "spec": {"replicas": 4}, "status": {"readyReplicas": 7}}
    await kube.call("PUT", path, put)
    live = kube.obj(DEPLOYMENTS, "d")
    assert (live["spec"]["replicas"], live["status"]["readyReplicas"]) == (4, 2)
    put = {**copy.deepcopy(live), "spec": {"replicas": 5}, "status": {"readyReplicas": 4}}
    await kube.call("PUT", f"{path}/status", put)
    live = kube.obj(DEPLOYMENTS, "d")
    assert (live["spec"]["replicas"], live["status"]["readyReplicas"]) == (4, 4)

    # a JSON patch (kopf's) is split the same way, and so is an apply
    await kube.call("POST", BASE, ragserve("r", {"engines": []}))
    ops = [
        {"op": "add", "path": "/status", "value": {"phase": "X"}},
        {"op": "add", "path": "/metadata/labels", "value": {"a": "b"}},
    ]
    async with kube.request("PATCH", f"{BASE}/r", json=ops, headers={"Content-Type": "application/json-patch+json"}):
        pass
    live = kube.obj(RAGSERVES, "r")
    assert live["metadata"]["labels"] == {"a": "b"} and "status" not in live
    applied = {**deployment("d"), "status": {"readyReplicas": 99}}
    headers = {"Content-Type": "application/apply-patch+yaml"}
    async with kube.request("PATCH", f"{path}?fieldManager=x&force=true", json=applied, headers=headers):
        pass
    assert kube.obj(DEPLOYMENTS, "d")["status"]["readyReplicas"] == 4


async def test_a_stale_resource_version_is_a_conflict(kube):
    created = await kube.call("POST", DEPLOYMENTS_PATH, deployment("d"))
    path, old = f"{DEPLOYMENTS_PATH}/d", created["metadata"]["resourceVersion"]
    fresh = await kube.call("PATCH", path, {"metadata": {"resourceVersion": old, "labels": {"a": "1"}}})
    assert fresh["metadata"]["resourceVersion"] != old

    for method, body in [("PATCH", {"metadata": {"resourceVersion": old, "labels": {"a": "2"}}}), ("PUT", created)]:
        status, answer = await request(kube, method, path, body)
        assert (status, answer["reason"], answer["code"]) == (409, "Conflict", 409), method
        assert (
            'Operation cannot be fulfilled on deployments.apps "d": the object has been modified' in answer["message"]
        )
    assert kube.obj(DEPLOYMENTS, "d")["metadata"]["labels"] == {"a": "1"}

    status, _ = await request(kube, "PUT", path, {**fresh, "spec": {"replicas": 2}})
    assert status == 200 and kube.obj(DEPLOYMENTS, "d")["spec"]["replicas"] == 2
    test = [{"op": "test", "path": "/metadata/resourceVersion", "value": old}]
    status, _ = await request(kube, "PATCH", path, test, **{"Content-Type": "application/json-patch+json"})
    assert status == 422


async def test_garbage_collection_follows_owner_references(kube):
    owner = await kube.call("POST", BASE, ragserve("r", {"engines": []}))
    other = await kube.call("POST", BASE, ragserve("other", {"engines": []}))
    child = await kube.call("POST", DEPLOYMENTS_PATH, deployment("child", [ref(owner)]))
    grandchild = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "grandchild", "ownerReferences": [ref(child)]},
    }
    await kube.call("POST", PODS_PATH, grandchild)
    await kube.call("POST", DEPLOYMENTS_PATH, deployment("shared", [ref(owner), ref(other)]))
    held = deployment("held", [ref(owner)])
    held["metadata"]["finalizers"] = ["example.com/hold"]
    await kube.call("POST", DEPLOYMENTS_PATH, held)
    await kube.call("POST", DEPLOYMENTS_PATH, deployment("unrelated"))

    await kube.call("DELETE", f"{BASE}/r")
    assert kube.obj(RAGSERVES, "r") is None
    assert kube.obj(DEPLOYMENTS, "child") is None and kube.obj("v1/pods", "grandchild") is None  # transitively
    assert kube.obj(DEPLOYMENTS, "shared")["metadata"]["ownerReferences"] == [ref(other)]  # another owner left
    assert kube.obj(DEPLOYMENTS, "held")["metadata"]["deletionTimestamp"]  # deleting, held by its finalizer
    assert kube.obj(DEPLOYMENTS, "unrelated")

    await kube.call("PATCH", f"{DEPLOYMENTS_PATH}/held", {"metadata": {"finalizers": None}})
    assert kube.obj(DEPLOYMENTS, "held") is None
    orphan = await kube.call("POST", DEPLOYMENTS_PATH, deployment("orphan", [ref(other)]))
    await kube.call("DELETE", f"{BASE}/other", {"propagationPolicy": "Orphan"})
    assert kube.obj(DEPLOYMENTS, "orphan")["metadata"]["uid"] == orphan["metadata"]["uid"]
