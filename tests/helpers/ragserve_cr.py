"""RAGServe custom resources for the operator tests: where they live in the in-memory API, and bodies."""

from __future__ import annotations

from ragserve_operator.spec import GROUP, PLURAL, POOL_PLURAL, VERSION

NS = "rs-test"  # the namespace tests/operator/conftest.py declares
RAGSERVES = f"{GROUP}/{VERSION}/{PLURAL}"
POOLS = f"{GROUP}/{VERSION}/{POOL_PLURAL}"
BASE = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"
POOLS_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{POOL_PLURAL}"
DEPLOYMENTS = "apps/v1/deployments"


def ragserve(name: str, spec: dict) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RAGServe", "metadata": {"name": name}, "spec": spec}


def operator_autoscaled(model: str, scale_down_stabilization_s: int) -> dict:
    """One pool `a` (1..3 replicas) that the operator scales on 2 waiting requests per replica, every second."""
    return {
        "engines": [{"name": "a", "model": model, "minReplicas": 1, "maxReplicas": 3}],
        "autoscaling": {
            "mode": "operator",
            "intervalSeconds": 1,
            "targetWaitingRequests": 2,
            "scaleDownStabilizationSeconds": scale_down_stabilization_s,
        },
    }
