"""Scaling a pool the Kubernetes way: every engine pool is a RAGServeEnginePool with a `scale` subresource.
A kubectl-scale request, an HPA (`kubectl autoscale`, or the one autoscaling.mode hpa makes) and the
operator's own autoscaler (test_autoscale_loop.py) all write its one replicas field; the pool's Deployment
follows, and the operator never writes it back."""

from __future__ import annotations

import kubernetes_validate
import pytest

from ragserve_operator.spec import GROUP, POOL_KIND, POOL_PLURAL, VERSION
from tests.helpers.ragserve_cr import BASE, DEPLOYMENTS, NS, POOLS, POOLS_PATH, RAGSERVES, ragserve

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]
HPAS = "autoscaling/v2/horizontalpodautoscalers"
SELECTOR = (
    "app.kubernetes.io/component=engine,app.kubernetes.io/instance={name},app.kubernetes.io/name=ragserve,"
    "ragserve.dev/pool=a"
)


def replicas(kube, resource: str, name: str) -> int | None:
    return ((kube.obj(resource, name) or {}).get("spec") or {}).get("replicas")


def generation_done(kube, name: str, generation: int):
    return lambda: ((kube.obj(RAGSERVES, name) or {}).get("status") or {}).get("observedGeneration") == generation


def operator_scale_writes(kube) -> int:
    return sum(
        1
        for r in kube._requests
        if str(r.url.path).endswith("/scale") and r.params.get("fieldManager") == "ragserve-operator"
    )


async def hpa_controller(kube, hpa_name: str, to: int) -> dict:
    """Play the HPA controller: resolve the HPA's scaleTargetRef, read the target's Scale (its selector finds
    the pods whose metrics it averages), write the replicas it decided on."""
    target = kube.obj(HPAS, hpa_name)["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == (f"{GROUP}/{VERSION}", POOL_KIND)
    path = f"/apis/{target['apiVersion']}/namespaces/{NS}/{POOL_PLURAL}/{target['name']}/scale"
    scale = await kube.call("GET", path)
    scale["spec"]["replicas"] = to
    await kube.call("PUT", f"{path}?fieldManager=horizontal-pod-autoscaler", scale)
    return scale


async def test_kubectl_scale_and_autoscale_drive_the_pool(kube, operator, eventually):
    await kube.call("POST", BASE, ragserve("sc", {"engines": [{"name": "a", "model": "m", "replicas": 2}]}))
    await eventually(lambda: replicas(kube, DEPLOYMENTS, "sc-engine-a") == 2, what="pool Deployment")
    pool = kube.obj(POOLS, "sc-engine-a")
    assert pool["spec"]["replicas"] == 2 and pool["spec"]["model"] == "m"
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "RAGServe"
    await eventually(lambda: (kube.obj(POOLS, "sc-engine-a").get("status") or {}).get("selector"), what="status")
    scale = await kube.call("GET", f"{POOLS_PATH}/sc-engine-a/scale")
    assert (scale["kind"], scale["spec"]["replicas"]) == ("Scale", 2)
    assert scale["status"]["selector"] == SELECTOR.format(name="sc")

    # kubectl scale ragserveenginepool sc-engine-a --replicas 4
    await kube.call("PATCH", f"{POOLS_PATH}/sc-engine-a/scale?fieldManager=kubectl", {"spec": {"replicas": 4}})
    await eventually(lambda: replicas(kube, DEPLOYMENTS, "sc-engine-a") == 4, what="the Deployment follows")
    writes = operator_scale_writes(kube)
    change = {"spec": {"engines": [{"name": "a", "model": "m", "replicas": 2, "engine": {"maxNumSeqs": 8}}]}}
    await kube.call("PATCH", f"{BASE}/sc", change)  # another reconcile, same declared replicas
    await eventually(generation_done(kube, "sc", 2), what="reconciled")
    assert replicas(kube, POOLS, "sc-engine-a") == 4 and replicas(kube, DEPLOYMENTS, "sc-engine-a") == 4  # kept

    # kubectl autoscale ragserveenginepool sc-engine-a --min 1 --max 6: an HPA targeting the pool
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "sc-engine-a", "namespace": NS},
        "spec": {
            "scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": POOL_KIND, "name": "sc-engine-a"},
            "minReplicas": 1,
            "maxReplicas": 6,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization"}}}],
        },
    }
    hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] = 80
    kubernetes_validate.validate(hpa, "1.30.0", strict=True)
    await kube.call("POST", f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers", hpa)
    await hpa_controller(kube, "sc-engine-a", to=5)
    await eventually(lambda: replicas(kube, DEPLOYMENTS, "sc-engine-a") == 5, what="the HPA's replicas")
    change["spec"]["engines"][0]["engine"]["maxNumSeqs"] = 16
    await kube.call("PATCH", f"{BASE}/sc", change)
    await eventually(generation_done(kube, "sc", 3), what="reconciled")
    assert replicas(kube, POOLS, "sc-engine-a") == 5
    assert operator_scale_writes(kube) == writes  # the operator never wrote replicas back
    owners = {m["manager"] for m in kube.obj(POOLS, "sc-engine-a")["metadata"]["managedFields"]}
    assert {"ragserve-operator", "horizontal-pod-autoscaler"} <= owners

    # a new declared count in the RAGServe is applied through the same field
    change["spec"]["engines"][0]["replicas"] = 1
    await kube.call("PATCH", f"{BASE}/sc", change)
    await eventually(lambda: replicas(kube, DEPLOYMENTS, "sc-engine-a") == 1, what="the spec's new replicas")
    assert replicas(kube, POOLS, "sc-engine-a") == 1


async def test_hpa_mode_targets_the_pool_and_owns_its_replicas(kube, operator, eventually):
    spec = {"engines": [{"name": "a", "model": "m", "maxReplicas": 4}], "autoscaling": {"mode": "hpa"}}
    await kube.call("POST", BASE, ragserve("auto", spec))
    await eventually(lambda: kube.obj(HPAS, "auto-engine-a"), what="the operator's HPA")
    await eventually(lambda: replicas(kube, DEPLOYMENTS, "auto-engine-a") == 1, what="minReplicas to start")
    await eventually(lambda: (kube.obj(POOLS, "auto-engine-a").get("status") or {}).get("selector"), what="status")
    writes = operator_scale_writes(kube)
    scale = await hpa_controller(kube, "auto-engine-a", to=3)
    assert scale["status"]["selector"] == SELECTOR.format(name="auto")
    await eventually(lambda: replicas(kube, DEPLOYMENTS, "auto-engine-a") == 3, what="the HPA's replicas")

    spec["engines"][0]["maxReplicas"] = 5
    await kube.call("PATCH", f"{BASE}/auto", {"spec": spec})
    await eventually(lambda: kube.obj(HPAS, "auto-engine-a")["spec"]["maxReplicas"] == 5, what="HPA updated")
    await eventually(generation_done(kube, "auto", 2), what="reconciled")
    assert replicas(kube, POOLS, "auto-engine-a") == 3 and replicas(kube, DEPLOYMENTS, "auto-engine-a") == 3
    assert operator_scale_writes(kube) == writes

    # removing the pool removes its RAGServeEnginePool and HPA with it
    spec["engines"] = [{"name": "b", "model": "m"}]
    await kube.call("PATCH", f"{BASE}/auto", {"spec": spec})
    await eventually(lambda: kube.obj(POOLS, "auto-engine-a") is None, what="pool pruned")
    await eventually(lambda: kube.obj(HPAS, "auto-engine-a") is None, what="HPA pruned")
    await eventually(lambda: replicas(kube, POOLS, "auto-engine-b") == 1, what="the new pool")
