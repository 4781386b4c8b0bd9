"""RAGServeEnginePool: one per engine pool, owned by its RAGServe. Its spec.replicas is the pool's one
replicas field, and every writer goes through its `scale` subresource: kubectl scale, an HPA or KEDA
ScaledObject (autoscaling.mode hpa / keda, or `kubectl autoscale`), the built-in autoscaler (mode
operator), and the reconcile itself only when the RAGServe's declared count changes (mode none) or, in
mode operator, to keep it within min/max. So a /scale write from outside is not reverted. The operator
never applies spec.replicas (an applied field it later left out would be removed): a new pool is created
with its first replicas by a plain create, then applied like every child. The pool's Deployment follows
spec.replicas, and its status comes back as the pool's status."""

from __future__ import annotations

from ragserve_operator.apply import contains
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


def size_pools(kube: Kube, owner: Owner, spec: RAGServeSpec) -> tuple[dict, dict[str, int]]:
    """Before the apply: create missing pools with their first replicas (a create, not an apply: the
    applies that follow leave spec.replicas be), and make the /scale writes this reconcile owes (before the
    apply that records the declared count). Returns the pools as read ((kind, name) -> object or None)
    and each pool's replicas, for its Deployment."""
    fetched, replicas = {}, {}
    for pool in spec.pools:
        name = owner.child("engine", pool.name)
        live = kube.get(POOL_KIND, owner.namespace, name)
        write = scale_to(spec, pool, live)  # never None for a pool without replicas yet
        if live is None:  # (then applied as if new: the apply reports it Created)
            obj = pool_object(owner, spec, pool)
            kube.create({**obj, "spec": {**obj["spec"], "replicas": write}})
        elif write is not None and owner.owns(live):
            scale(kube, owner, name, write)  # answers with a Scale: read the pool again
            live = kube.get(POOL_KIND, owner.namespace, name)
        fetched[(POOL_KIND, name)] = live
        replicas[pool.name] = replicas_of(live) if write is None else write
    return fetched, replicas


def settle_pools(kube: Kube, owner: Owner, spec: RAGServeSpec, applied: dict) -> None:
    """After the apply (applied: (kind, name) -> object): every pool's status from its Deployment."""
    for pool in spec.pools:
        name = owner.child("engine", pool.name)
        live = applied[(POOL_KIND, name)]
        status = pool_status(owner, pool, applied[("Deployment", name)])
        if not contains(live.get("status") or {}, status):
            kube.patch(POOL_KIND, owner.namespace, name, {"status": status}, sub="status")
