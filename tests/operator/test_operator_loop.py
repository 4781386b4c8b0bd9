"""The operator as a subprocess against an in-memory Kubernetes API: children, status, drift, rollouts."""

from __future__ import annotations

import httpx
import kubernetes_validate
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragserve_operator.metrics import OUTCOMES
from ragserve_operator.spec import GROUP, VERSION
from tests.helpers.ragserve_cr import BASE, DEPLOYMENTS, NS, RAGSERVES, ragserve

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]


def status_of(kube, name: str) -> dict:
    return (kube.obj(RAGSERVES, name) or {}).get("status") or {}


def condition(kube, name: str, type_: str) -> dict:
    return next((c for c in status_of(kube, name).get("conditions", []) if c["type"] == type_), {})


async def report_ready(kube, resource: str, name: str) -> None:
    """Play the workload controller: every replica of the latest generation ready."""
    live = kube.obj(resource, name)
    n, gen = live["spec"].get("replicas", 1), live["metadata"]["generation"]
    status = {"replicas": n, "readyReplicas": n, "updatedReplicas": n, "observedGeneration": gen}
    group_version, plural = resource.rsplit("/", 1)
    await kube.call("PATCH", f"/apis/{group_version}/namespaces/{NS}/{plural}/{name}/status", {"status": status})


SPEC = {
    "engines": [
        {"name": "small", "model": "smollm2-135m", "replicas": 2, "engine": {"maxNumSeqs": 8}},
        {"name": "big", "model": "/models/llama", "gpus": 1, "modelPVC": {"claimName": "models"}},
    ],
    "router": {"apiKeySecret": {"name": "keys"}},
    "cachestore": {"replicas": 2, "disk": "10GiB"},
    "redis": {"mode": "inCluster"},
}
EXPECTED = [
    ("apps/v1/deployments", "demo-router"),
    ("apps/v1/deployments", "demo-engine-small"),
    ("apps/v1/deployments", "demo-engine-big"),
    ("apps/v1/deployments", "demo-redis"),
    ("apps/v1/statefulsets", "demo-cachestore"),
    ("v1/services", "demo-router"),
    ("v1/services", "demo-router-registry"),
    ("v1/services", "demo-engine-small"),
    ("v1/services", "demo-engine-big"),
    ("v1/services", "demo-cachestore-headless"),
    ("v1/services", "demo-redis"),
    ("v1/configmaps", "demo-endpoints"),
    ("v1/configmaps", "demo-redis"),
]


async def test_full_loop(kube, operator, eventually):
    created = await kube.call("POST", BASE, ragserve("demo", SPEC))
    uid = created["metadata"]["uid"]
    await eventually(lambda: all(kube.obj(r, n) for r, n in EXPECTED), what="all children", timeout=60)

    for resource, name in EXPECTED:
        child = kube.obj(resource, name)
        kubernetes_validate.validate(child, "1.30.0", strict=True)
        refs = child["metadata"]["ownerReferences"]
        assert refs == [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "RAGServe",
                "name": "demo",
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    small = kube.obj(DEPLOYMENTS, "demo-engine-small")
    assert small["spec"]["replicas"] == 2
    args = small["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8"
    assert args[args.index("--router") + 1] == f"demo-router-registry.{NS}.svc:50051"
    big = kube.obj(DEPLOYMENTS, "demo-engine-big")["spec"]["template"]["spec"]
    assert big["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"

    # Progressing until every workload reports ready, then Ready
    await eventually(lambda: status_of(kube, "demo").get("phase") == "Progressing", what="Progressing")
    assert status_of(kube, "demo")["desiredEngines"] == 3
    for resource, name in EXPECTED:
        if resource.startswith("apps/"):
            await report_ready(kube, resource, name)
    await eventually(lambda: status_of(kube, "demo").get("phase") == "Ready", what="phase Ready")
    status = status_of(kube, "demo")
    assert condition(kube, "demo", "Ready")["status"] == "True"
    assert condition(kube, "demo", "Degraded")["status"] == "False"
    assert (status["readyEngines"], status["desiredEngines"], status["observedGeneration"]) == (3, 3, 1)

    # a deleted child is recreated; an edited one is put back
    await kube.call("DELETE", f"/api/v1/namespaces/{NS}/services/demo-router")
    await eventually(lambda: kube.obj("v1/services", "demo-router"), what="recreated router Service")
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/demo-engine-small"
    await kube.call("PATCH", path, {"spec": {"replicas": 7}})
    await eventually(lambda: kube.obj(DEPLOYMENTS, "demo-engine-small")["spec"]["replicas"] == 2, what="drift repair")

    # a spec change rolls the engines: new pod template, Progressing until the rollout completes
    before = kube.obj(DEPLOYMENTS, "demo-engine-small")["metadata"]["generation"]
    change = {"spec": {"engines": [{**SPEC["engines"][0], "engine": {"maxNumSeqs": 16}}, SPEC["engines"][1]]}}
    await kube.call("PATCH", f"{BASE}/demo", change)

    def rolled() -> bool:
        live = kube.obj(DEPLOYMENTS, "demo-engine-small")
        args = live["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--max-num-seqs") + 1] == "16" and live["metadata"]["generation"] > before

    await eventually(rolled, what="engine template rolled")
    strategy = kube.obj(DEPLOYMENTS, "demo-engine-small")["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    await eventually(lambda: status_of(kube, "demo").get("observedGeneration") == 2, what="observedGeneration 2")
    assert status_of(kube, "demo")["phase"] == "Progressing"
    await report_ready(kube, DEPLOYMENTS, "demo-engine-small")
    await eventually(lambda: status_of(kube, "demo").get("phase") == "Ready", what="Ready after rollout")
    assert kube.obj(DEPLOYMENTS, "demo-engine-big")["metadata"]["generation"] == 1  # untouched pool

    # removing a pool deletes its children
    await kube.call("PATCH", f"{BASE}/demo", {"spec": {"engines": [change["spec"]["engines"][0]]}})
    await eventually(lambda: kube.obj(DEPLOYMENTS, "demo-engine-big") is None, what="pruned pool")
    await eventually(lambda: kube.obj("v1/services", "demo-engine-big") is None, what="pruned pool Service")
    reasons = {"Created", "Updated", "Deleted", "Ready", "Progressing"}
    await eventually(lambda: reasons <= {e["reason"] for e in kube.events()}, what="events")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


async def test_invalid_spec_degrades_and_operator_keeps_running(kube, operator, eventually, metrics_port):
    pool = {"name": "a", "model": "m", "minReplicas": 3, "maxReplicas": 2, "engine": {"kvCacheDtype": "fp4"}}
    bad = {"engines": [pool]}
    await kube.call("POST", BASE, ragserve("bad", bad))
    await eventually(lambda: status_of(kube, "bad").get("phase") == "Degraded", what="Degraded")
    degraded = condition(kube, "bad", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.engines[0].engine.kvCacheDtype: 'fp4' is not one of" in degraded["message"]
    assert kube.obj(DEPLOYMENTS, "bad-engine-a") is None

    # the operator still serves others; fixing the spec clears Degraded
    await kube.call("POST", BASE, ragserve("good", {"engines": [{"name": "a", "model": "m"}]}))
    await eventually(lambda: kube.obj(DEPLOYMENTS, "good-engine-a"), what="children of a valid RAGServe")
    fixed = {"spec": {"engines": [{"name": "a", "model": "m", "minReplicas": 1, "maxReplicas": 2}]}}
    await kube.call("PATCH", f"{BASE}/bad", fixed)
    await eventually(lambda: condition(kube, "bad", "Degraded").get("status") == "False", what="Degraded cleared")
    assert kube.obj(DEPLOYMENTS, "bad-engine-a")
    assert any(e["type"] == "Warning" and e["reason"] == "InvalidSpec" for e in kube.events())
    assert operator.poll() is None

    # and its /metrics says so: invalid passes counted apart from good ones, failures at 0 (present)
    scraped = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    outcomes = {o: scraped[("ragserve_operator_reconciles_total", (("outcome", o),))] for o in OUTCOMES}
    assert outcomes["invalid_spec"] >= 1 and outcomes["ok"] >= 2 and outcomes["apply_failed"] == 0
    assert 0 < scraped[("ragserve_operator_reconcile_duration_seconds_count", ())] <= sum(outcomes.values())


async def test_restart_resumes_and_deletion_is_not_blocked(kube, run_operator, eventually):
    await run_operator()
    await kube.call("POST", BASE, ragserve("again", {"engines": [{"name": "a", "model": "m"}]}))
    await eventually(lambda: kube.obj("v1/services", "again-router"), what="children")
    finalizers = kube.obj(RAGSERVES, "again")["metadata"]["finalizers"]
    assert finalizers == ["ragserve.dev/operator"]  # held for the autoscaler loop only

    await run_operator()  # stops the first one; changes while it was down are picked up on resume
    await kube.call("DELETE", f"/api/v1/namespaces/{NS}/services/again-router")
    await eventually(lambda: kube.obj("v1/services", "again-router"), what="recreated after restart")

    await kube.call("DELETE", f"{BASE}/again")
    await eventually(lambda: kube.obj(RAGSERVES, "again") is None, what="RAGServe deleted (finalizer released)")


async def test_a_foreign_object_in_the_way_degrades(kube, operator, eventually):
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "clash-endpoints"}, "data": {"k": "v"}}
    await kube.call("POST", f"/api/v1/namespaces/{NS}/configmaps", foreign)
    await kube.call("POST", BASE, ragserve("clash", {"engines": [{"name": "a", "model": "m"}]}))
    await eventually(lambda: condition(kube, "clash", "Degraded").get("reason") == "ApplyFailed", what="ApplyFailed")
    message = condition(kube, "clash", "Degraded")["message"]
    assert message == "ConfigMap clash-endpoints exists and is not controlled by RAGServe clash; rename or delete it"
    assert kube.obj("v1/configmaps", "clash-endpoints")["data"] == {"k": "v"}  # left alone
    await kube.call("DELETE", f"/api/v1/namespaces/{NS}/configmaps/clash-endpoints")
    await eventually(
        lambda: condition(kube, "clash", "Degraded").get("status") == "False", what="recovered", timeout=60
    )
    assert operator.poll() is None


def dependents(kube, uid: str) -> set[tuple]:
    """(resource, name) of every live object owned by `uid`, transitively."""
    uids, owned = {uid}, set()
    while True:
        found = {
            (r, n, o.raw["metadata"]["uid"])
            for (r, ns, n), o in kube.objects.items()
            if ns == NS
            and not o.deleted
            and any(ref.get("uid") in uids for ref in o.raw["metadata"].get("ownerReferences") or [])
        }
        if {(r, n) for r, n, _ in found} == owned:
            return owned
        owned = {(r, n) for r, n, _ in found}
        uids |= {u for _, _, u in found}


async def test_deleting_a_ragserve_collects_its_children_and_they_stay_gone(kube, operator, eventually, metrics_port):
    created = await kube.call("POST", BASE, ragserve("gone", SPEC))
    uid = created["metadata"]["uid"]
    await eventually(lambda: len(dependents(kube, uid)) >= 15, what="children (13 + 2 engine pools)", timeout=60)
    children = dependents(kube, uid)
    kinds = {r.plural for r, _ in children}
    assert {"deployments", "statefulsets", "services", "configmaps", "ragserveenginepools"} <= kinds
    await eventually(lambda: status_of(kube, "gone").get("phase") == "Progressing", what="reconciled")

    await kube.call("DELETE", f"{BASE}/gone")
    await eventually(lambda: kube.obj(RAGSERVES, "gone") is None, what="RAGServe deleted (finalizer released)")
    # collected through their ownerReferences (the Deployments through their pools), as the collector does
    await eventually(lambda: not any(kube.obj(r, n) for r, n in children), what="children collected")

    # the children's DELETED events reach the operator before those of a RAGServe created afterwards: once
    # that one is reconciled and the operator stopped, nothing it did can recreate the deleted ones later
    await kube.call("POST", BASE, ragserve("after", {"engines": [{"name": "a", "model": "m"}]}))
    await eventually(lambda: status_of(kube, "after").get("phase") == "Progressing", what="the next RAGServe")
    scraped = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    outcomes = {o: scraped[("ragserve_operator_reconciles_total", (("outcome", o),))] for o in OUTCOMES}
    operator.terminate()  # (not waited on in this thread: the API it talks to runs in this loop)
    await eventually(lambda: operator.poll() is not None, timeout=30, what="operator stopped")
    assert operator.returncode == 0
    assert [(r, n) for r, n in children if kube.obj(r, n)] == []
    assert not {n for _, n in kube.live() if n.startswith("gone-")}
    assert outcomes["apply_failed"] == 0 and outcomes["invalid_spec"] == 0
    assert [e["message"] for e in kube.events() if e["type"] != "Normal"] == []  # no handler failed
