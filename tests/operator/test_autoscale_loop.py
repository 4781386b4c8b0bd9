"""The operator's autoscaler end to end: engine pods (in the in-memory API) whose /metrics are real
Prometheus endpoints on loopback; the operator scrapes them, scales the pool's Deployment, records the
decision in status and events, and hands scaling over to an HPA / KEDA when the mode says so."""

from __future__ import annotations

import contextlib

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from ragserve_operator.spec import GROUP, PLURAL, VERSION
from tests.helpers.ragserve_cr import BASE, DEPLOYMENTS, NS, POOLS, POOLS_PATH, operator_autoscaled, ragserve

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]


class Engine:
    """An engine's load gauges served over HTTP (what the operator reads from every engine pod)."""

    def __init__(self, port: int) -> None:
        self.registry = CollectorRegistry()
        self.waiting = Gauge("vllm:num_requests_waiting", "", ["model_name"], registry=self.registry).labels("m")
        Gauge("vllm:num_requests_running", "", ["model_name"], registry=self.registry).labels("m").set(1)
        Gauge("vllm:kv_cache_usage_perc", "", ["model_name"], registry=self.registry).labels("m").set(0.1)
        self.port = port
        self.server, self.thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join()


@contextlib.contextmanager
def engines(ports: list[int]):
    started = [Engine(p) for p in ports]
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


def replicas(kube, name: str) -> int | None:
    live = kube.obj(DEPLOYMENTS, name)
    return None if live is None else live["spec"].get("replicas")


def decision(kube, name: str) -> dict:
    records = ((kube.obj(f"{GROUP}/{VERSION}/{PLURAL}", name) or {}).get("status") or {}).get("autoscaling") or []
    return records[0] if records else {}


AUTOSCALED = operator_autoscaled("m", scale_down_stabilization_s=4)
# an hour-long scale-down window: while it lasts no scale-down can happen, however slow the machine
HOLDING = operator_autoscaled("m", scale_down_stabilization_s=3600)


async def test_scales_up_under_queueing_and_down_after_the_window(kube, operator, eventually, free_ports, engine_pod):
    await kube.call("POST", BASE, ragserve("auto", HOLDING))
    await eventually(lambda: replicas(kube, "auto-engine-a") == 1, what="pool created at minReplicas")
    with engines(free_ports(2)) as running:
        for i, engine in enumerate(running):
            await kube.call(
                "POST", f"/api/v1/namespaces/{NS}/pods", engine_pod(f"auto-a-{i}", "a", "auto", engine.port)
            )
        await eventually(lambda: decision(kube, "auto").get("podsWithMetrics") == 2, what="both pods scraped")
        assert replicas(kube, "auto-engine-a") == 1

        for engine in running:
            engine.waiting.set(10)  # ceil(2 pods x 10 / 2) = 10 -> maxReplicas 3
        await eventually(lambda: replicas(kube, "auto-engine-a") == 3, what="scale up to maxReplicas")
        # through the pool's scale subresource: the field kubectl scale and an HPA write
        pool = kube.obj(POOLS, "auto-engine-a")
        assert pool["spec"]["replicas"] == 3
        replicas_owner = [
            m["manager"] for m in pool["metadata"]["managedFields"] if "f:replicas" in m["fieldsV1"].get("f:spec", {})
        ]
        assert replicas_owner == ["ragserve-autoscaler"]
        # the decision reaches status in a patch of its own, after the Deployment's
        await eventually(lambda: decision(kube, "auto").get("lastScaleTime"), what="the scale-up recorded")
        record = decision(kube, "auto")
        assert record["metrics"]["waiting"] == 10 and record["recommendedReplicas"] == 10
        assert "maxReplicas 3" in record["reason"] and record["lastScaleTime"]
        scaled_up_at = record["lastScaleTime"]

        for engine in running:
            engine.waiting.set(0)

        def held() -> bool:
            r = decision(kube, "auto")
            return r.get("recommendedReplicas", 3) < 3 and "stabilization window keeps 3" in r["reason"]

        # the operator's own record: metrics say fewer, the window keeps 3 and nothing was scaled since
        await eventually(held, what="the lower recommendation held at 3 by the window")
        record = decision(kube, "auto")
        assert record["currentReplicas"] == record["desiredReplicas"] == 3
        assert record["lastScaleTime"] == scaled_up_at
        assert replicas(kube, "auto-engine-a") == 3
        assert kube.obj(POOLS, "auto-engine-a")["spec"]["replicas"] == 3

        await kube.call("PATCH", f"{BASE}/auto", {"spec": {"autoscaling": {"scaleDownStabilizationSeconds": 0}}})
        await eventually(lambda: replicas(kube, "auto-engine-a") == 1, what="scale down once the window is 0")
        await eventually(
            lambda: decision(kube, "auto").get("lastScaleTime", scaled_up_at) != scaled_up_at,
            what="the scale-down recorded",
        )
        record = decision(kube, "auto")
        assert record["recommendedReplicas"] < 3 and record["desiredReplicas"] == 1
        assert "stabilization window" not in record["reason"]

    history = [v["spec"]["replicas"] for v in kube.objects[DEPLOYMENTS, NS, "auto-engine-a"].history if v]
    # straight to max, never beyond, and held at 3 until the window was shortened
    assert [r for i, r in enumerate(history) if i == 0 or history[i - 1] != r] == [1, 3, 1]

    def scaled(prefix: str) -> bool:
        return any(e["reason"] == "Scaled" and e["message"].startswith(prefix) for e in kube.events())

    assert scaled("engine pool a: 1 -> 3 replicas (waiting 10/pod")
    await eventually(lambda: scaled("engine pool a: 3 -> 1 replicas"), what="the scale-down Event")
    assert len([e for e in kube.events() if e["reason"] == "Scaled"]) == 2


async def test_hpa_and_keda_modes_take_over_and_hand_back(kube, operator, eventually):
    body = ragserve("ext", AUTOSCALED)
    await kube.call("POST", BASE, body)
    await eventually(lambda: replicas(kube, "ext-engine-a") == 1, what="pool")
    await kube.call("PATCH", f"{POOLS_PATH}/ext-engine-a/scale?fieldManager=kubectl", {"spec": {"replicas": 2}})
    await eventually(lambda: replicas(kube, "ext-engine-a") == 2, what="kubectl scale")

    hpas = "autoscaling/v2/horizontalpodautoscalers"
    await kube.call("PATCH", f"{BASE}/ext", {"spec": {"autoscaling": {"mode": "hpa"}}})
    await eventually(lambda: kube.obj(hpas, "ext-engine-a"), what="HPA")
    hpa = kube.obj(hpas, "ext-engine-a")["spec"]
    assert hpa["maxReplicas"] == 3 and hpa["scaleTargetRef"]["kind"] == "RAGServeEnginePool"
    assert replicas(kube, "ext-engine-a") == 2  # the HPA's to change now: left as they are

    await kube.call("PATCH", f"{BASE}/ext", {"spec": {"autoscaling": {"mode": "keda"}}})
    await eventually(lambda: kube.obj("keda.sh/v1alpha1/scaledobjects", "ext-engine-a"), what="ScaledObject")
    await eventually(lambda: kube.obj(hpas, "ext-engine-a") is None, what="HPA removed")

    await kube.call("PATCH", f"{BASE}/ext", {"spec": {"autoscaling": {"mode": "none"}}})
    await eventually(lambda: kube.obj("keda.sh/v1alpha1/scaledobjects", "ext-engine-a") is None, what="KEDA removed")
    await eventually(lambda: replicas(kube, "ext-engine-a") == 1, what="the spec's replicas again")
