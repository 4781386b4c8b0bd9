"""RAGServeEnginePool: one per engine pool, owned by its RAGServe. Its spec.replicas is the pool's one
replicas field, and every writer goes through its `scale` subresource: kubectl scale, an HPA or KEDA
ScaledObject (autoscaling.mode hpa / keda, or `kubectl autoscale`), the built-in autoscaler (mode
operator), and the reconcile itself only when the RAGServe's declared count is new or changed (mode none)
or, in mode operator, to keep it within min/max. So a /scale write from outside is not reverted. The
operator never applies spec.replicas (an applied field it later left out would be removed); the pool's
Deployment follows spec.replicas, and its status comes back as the pool's status."""

from __future__ import annotations

from ragserve_operator.kube import FIELD_MANAGER, Kube
from ragserve_operator.names import Owner
from ragserve_operator.spec import GROUP, POOL_KIND, VERSION, Pool, RAGServeSpec

DECLARED = "ragserve.dev/declared-replicas"  # the RAGServe's engines[].replicas last applied ("autoscaled")
AUTOSCALER = "ragserve-autoscaler"  # field manager of the built-in autoscaler's /scale writes


def declared(spec: RAGServeSpec, pool: Pool) -> str:
    return str(pool.raw["replicas"]) if spec.autoscaling["mode"] == "none" else "autoscaled"


def pool_object(owner: Owner, spec: RAGServeSpec, pool: Pool) -> dict:
    name = owner.child("engine", pool.name)
    metadata = owner.metadata(name, "engine", pool.name)
    metadata["annotations"] = {DECLARED: declared(spec, pool)}
    raw = pool.raw
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": POOL_KIND,
        "metadata": metadata,
        "spec": {
            "model": pool.model,
            "minReplicas": raw["minReplicas"],
            "maxReplicas": raw["maxReplicas"],
            "deployment": name,
        },
    }


def replicas_of(live: dict | None) -> int | None:
    return ((live or {}).get("spec") or {}).get("replicas")


def scale_to(spec: RAGServeSpec, pool: Pool, live: dict | None) -> int | None:
    """The /scale write this reconcile owes the pool, or None to leave its replicas to whoever set them."""
    raw, mode, current = pool.raw, spec.autoscaling["mode"], replicas_of(live)
    if mode == "none":
        noted = (((live or {}).get("metadata") or {}).get("annotations") or {}).get(DECLARED)
        changed = current is None or noted != declared(spec, pool)
        return raw["replicas"] if changed and current != raw["replicas"] else None
    if current is None:
        return raw["minReplicas"]
    if mode == "operator":
        bounded = min(max(current, raw["minReplicas"]), raw["maxReplicas"])
        return bounded if bounded != current else None
    return None  # hpa / keda: theirs


def scale(kube: Kube, owner: Owner, name: str, replicas: int, manager: str = FIELD_MANAGER) -> dict:
    """Write spec.replicas through the scale subresource (what `kubectl scale` does)."""
    return kube.patch(POOL_KIND, owner.namespace, name, {"spec": {"replicas": replicas}}, sub="scale", manager=manager)


def pool_status(owner: Owner, pool: Pool, deployment: dict) -> dict:
    """Counts from the pool's Deployment, and the selector an HPA finds the pool's pods with."""
    st = deployment.get("status") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(owner.selector("engine", pool.name).items()))
    ready = int(st.get("readyReplicas") or 0)
    return {"replicas": int(st.get("replicas") or 0), "readyReplicas": ready, "selector": selector}
