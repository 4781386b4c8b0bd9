"""One autoscaling pass over a RAGServe (autoscaling.mode: operator): read every engine pod's
/metrics, decide per pool, scale the pool through its RAGServeEnginePool's scale subresource (the field
`kubectl scale` and an HPA write; the reconcile then sizes the Deployment), record the decision in status
and events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ragserve_operator import metrics
from ragserve_operator.apply import Emit, contains
from ragserve_operator.kube import Kube
from ragserve_operator.names import Owner
from ragserve_operator.pools import AUTOSCALER, replicas_of, scale
from ragserve_operator.reconcile import lock_for
from ragserve_operator.scaling.decision import Decision, Policy, Stabilizer
from ragserve_operator.scaling.pod_metrics import scrape_pods
from ragserve_operator.spec import POOL_KIND, Pool, RAGServeSpec, SpecError, parse_spec
from ragserve_operator.status import now as utc_now


def interval_of(body: dict) -> float:
    try:
        return float(parse_spec(body.get("spec")).autoscaling["intervalSeconds"])
    except SpecError:
        return 15.0


def _scale(kube: Kube, owner: Owner, pool: Pool, stabilizer: Stabilizer, samples: list, policy: Policy, clock) -> tuple:
    """Under the RAGServe's lock, so reconcile never writes back a replica count read before this change."""
    name = owner.child("engine", pool.name)
    with lock_for(owner):
        pool_object = kube.get(POOL_KIND, owner.namespace, name)
        if pool_object is None or not owner.owns(pool_object) or replicas_of(pool_object) is None:
            return None, None
        current = replicas_of(pool_object)
        decision = stabilizer.decide(clock(), current, samples, policy)
        if decision.desired != current:
            scale(kube, owner, name, decision.desired, manager=AUTOSCALER)
        return decision, len(samples)


def record(pool: str, decision: Decision, pods: int, samples: list, previous: dict | None) -> dict:
    scaled = decision.desired != decision.current
    last = utc_now() if scaled else (previous or {}).get("lastScaleTime")
    out = {
        "pool": pool,
        "currentReplicas": decision.current,
        "recommendedReplicas": decision.recommended,
        "desiredReplicas": decision.desired,
        "reason": decision.reason,
        "metrics": decision.averages,
        "pods": pods,
        "podsWithMetrics": sum(s is not None for s in samples),
    }
    return {**out, "lastScaleTime": last} if last else out


async def autoscale_once(
    kube: Kube,
    body: dict,
    stabilizers: dict[str, Stabilizer],
    emit: Emit,
    clock: Callable[[], float] = time.monotonic,
) -> list[dict]:
    owner = Owner.of(body)
    try:
        spec: RAGServeSpec = parse_spec(body.get("spec"), owner.name)
    except SpecError:
        return []  # reconcile reports it
    if spec.autoscaling["mode"] != "operator":
        return []
    previous = {r.get("pool"): r for r in (body.get("status") or {}).get("autoscaling") or []}
    records = []
    for pool in spec.pools:
        pods = await asyncio.to_thread(kube.list, "Pod", owner.namespace, owner.selector("engine", pool.name))
        samples = await scrape_pods(pods)
        policy = Policy.from_spec(spec.autoscaling, pool.raw)
        stabilizer = stabilizers.setdefault(pool.name, Stabilizer())
        decision, n = await asyncio.to_thread(_scale, kube, owner, pool, stabilizer, samples, policy, clock)
        if decision is None:
            continue
        if decision.desired != decision.current:
            metrics.scale_changes.labels(pool.name).inc()
            emit(
                "Normal",
                "Scaled",
                f"engine pool {pool.name}: {decision.current} -> {decision.desired} replicas ({decision.reason})",
            )
        records.append(record(pool.name, decision, n, samples, previous.get(pool.name)))
    status = {"autoscaling": records}
    if not contains(body.get("status") or {}, status):
        await asyncio.to_thread(kube.patch, "RAGServe", owner.namespace, owner.name, {"status": status}, "status")
    return records
