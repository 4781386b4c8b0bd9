"""autoscaling.mode hpa / keda: an HPA (custom metrics from prometheus-adapter) or a KEDA ScaledObject
(Prometheus triggers) per engine pool, with the same targets and stabilization windows."""

from __future__ import annotations

from ragserve.metric_names import adapter_name, load_metrics
from ragserve_operator.names import Owner
from ragserve_operator.spec import GROUP, POOL_KIND, VERSION, Pool, RAGServeSpec

# Per load_metrics(role) entry (the signals that size a pool of its role): HPA Pods metrics by their
# prometheus-adapter name; KEDA triggers aggregate over the pool's pods, request and token counts summed
# (AverageValue: desired = sum / target), KV usage averaged (Value: desired = current x average / target),
# as in the chart.


def quantity(value: float) -> str:
    """4 -> "4", 0.8 -> "800m" (a Kubernetes quantity)."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def behavior(a: dict) -> dict:
    return {
        "scaleUp": {"stabilizationWindowSeconds": a["scaleUpStabilizationSeconds"]},
        "scaleDown": {"stabilizationWindowSeconds": a["scaleDownStabilizationSeconds"]},
    }


def _target_ref(owner: Owner, pool: Pool) -> dict:
    """The pool's RAGServeEnginePool: scaled through its scale subresource, like `kubectl scale` does."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": POOL_KIND, "name": owner.child("engine", pool.name)}


def engine_hpa(owner: Owner, spec: RAGServeSpec, pool: Pool) -> dict:
    a = spec.autoscaling
    metrics = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": adapter_name(m.name)},
                "target": {"type": "AverageValue", "averageValue": quantity(a[m.target_key])},
            },
        }
        for m in load_metrics(pool.raw.get("role", "both"))
        if a.get(m.target_key) is not None
    ]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": owner.metadata(owner.child("engine", pool.name), "engine", pool.name),
        "spec": {
            "scaleTargetRef": _target_ref(owner, pool),
            "minReplicas": pool.raw["minReplicas"],
            "maxReplicas": pool.raw["maxReplicas"],
            "metrics": metrics,
            "behavior": behavior(a),
        },
    }


def engine_scaledobject(owner: Owner, spec: RAGServeSpec, pool: Pool) -> dict:
    a = spec.autoscaling
    deployment = owner.child("engine", pool.name)
    # Deployment pods are <deployment>-<replicaset hash>-<pod hash>; Prometheus regexes are anchored
    selector = f'namespace="{owner.namespace}",pod=~"{deployment}-[a-z0-9]+-[a-z0-9]{{5}}"'
    triggers = [
        {
            "type": "prometheus",
            "name": adapter_name(m.name).replace("_", "-"),
            "metricType": "AverageValue" if m.over_pool == "sum" else "Value",
            "metadata": {
                "serverAddress": a["prometheusAddress"],
                "query": f"{m.over_pool}({m.name}{{{selector}}})",
                "threshold": str(a[m.target_key]),
            },
        }
        for m in load_metrics(pool.raw.get("role", "both"))
        if a.get(m.target_key) is not None
    ]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": owner.metadata(deployment, "engine", pool.name),
        "spec": {
            "scaleTargetRef": _target_ref(owner, pool),
            "pollingInterval": a["intervalSeconds"],
            "minReplicaCount": pool.raw["minReplicas"],
            "maxReplicaCount": pool.raw["maxReplicas"],
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(a)}},
            "triggers": triggers,
        },
    }
