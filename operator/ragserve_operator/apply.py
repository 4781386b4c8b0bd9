"""Make the cluster match desired manifests with server-side apply under one field manager
(kube.FIELD_MANAGER): every child is applied whole on every pass, so a field the operator no longer sets
is removed by the API server, while fields other managers own (annotations others add, a pool's replicas)
are left alone. A field another manager changed is reported as a conflict, then taken back (force).
Children no longer desired are deleted. Only objects this RAGServe controls are touched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ragserve_operator.kube import Kube, KubeError
from ragserve_operator.names import INSTANCE_LABEL, MANAGED_BY, MANAGED_BY_LABEL, Owner

# fields the API server refuses to change after creation: applied as they are live
IMMUTABLE = {"StatefulSet": ("volumeClaimTemplates",)}

Emit = Callable[[str, str, str], None]  # (type, reason, message) -> an Event on the RAGServe


class NotOwnedError(RuntimeError):
    pass


def contains(live: Any, desired: Any) -> bool:
    """True when every field of `desired` has the same value in `live` (for status patches)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    return live == desired


@dataclass
class Applied:
    live: dict[tuple[str, str], dict] = field(default_factory=dict)  # (kind, name) -> object after apply
    changes: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)  # "<Kind> <name>: <field> (conflict with "<manager>" ...)"


def with_immutable(obj: dict, live: dict | None) -> dict:
    """`obj` with its immutable fields as they are live (left out when live has none)."""
    if live is None or obj["kind"] not in IMMUTABLE:
        return obj
    spec = {k: v for k, v in obj["spec"].items() if k not in IMMUTABLE[obj["kind"]]}
    spec.update({k: live["spec"][k] for k in IMMUTABLE[obj["kind"]] if k in live.get("spec", {})})
    return {**obj, "spec": spec}


def conflict_text(obj: dict, exc: KubeError) -> str:
    causes = "; ".join(f"{c.get('field', '?')} ({c.get('message', 'conflict')})" for c in exc.causes)
    return f"{obj['kind']} {obj['metadata']['name']}: {causes or exc}"


def apply_one(kube: Kube, owner: Owner, obj: dict, live: dict | None, emit: Emit, out: Applied) -> dict:
    kind, name = obj["kind"], obj["metadata"]["name"]
    if live is not None and not owner.owns(live):
        raise NotOwnedError(f"{kind} {name} exists and is not controlled by RAGServe {owner.name}; rename or delete it")
    obj = with_immutable(obj, live)
    try:
        applied = kube.apply(obj, force=False)
    except KubeError as exc:
        if exc.status == 404:
            raise KubeError(404, f"cannot apply {kind} {name}: is its API ({obj['apiVersion']}) installed?") from exc
        if exc.status != 409:
            raise
        text = conflict_text(obj, exc)
        out.conflicts.append(text)
        emit("Warning", "ApplyConflict", f"{text}: taken back (the RAGServe's spec decides these fields)")
        applied = kube.apply(obj, force=True)
    if live is None:
        emit("Normal", "Created", f"created {kind} {name}")
        out.changes.append(f"created {kind} {name}")
    elif applied["metadata"].get("resourceVersion") != live["metadata"].get("resourceVersion"):
        emit("Normal", "Updated", f"updated {kind} {name} to match the spec")
        out.changes.append(f"updated {kind} {name}")
    return applied


def apply_all(kube: Kube, owner: Owner, desired: list[dict], emit: Emit, fetched: dict | None = None) -> Applied:
    """fetched: (kind, name) -> live object (or None) already read in this pass."""
    out, fetched = Applied(), fetched or {}
    for obj in desired:
        kind, name = obj["kind"], obj["metadata"]["name"]
        live = fetched[(kind, name)] if (kind, name) in fetched else kube.get(kind, owner.namespace, name)
        out.live[(kind, name)] = apply_one(kube, owner, obj, live, emit, out)
    return out


def prune(kube: Kube, owner: Owner, desired: list[dict], kinds: tuple[str, ...], emit: Emit) -> list[str]:
    """Delete children of `kinds` that this RAGServe controls but no longer wants (a removed pool, ...)."""
    wanted = {(o["kind"], o["metadata"]["name"]) for o in desired}
    labels = {INSTANCE_LABEL: owner.name, MANAGED_BY_LABEL: MANAGED_BY}
    deleted = []
    for kind in kinds:
        try:
            found = kube.list(kind, owner.namespace, labels)
        except KubeError as exc:
            if exc.status == 404:  # e.g. KEDA is not installed: nothing of that kind to prune
                continue
            raise
        for obj in found:
            name = obj["metadata"]["name"]
            if (kind, name) not in wanted and owner.owns(obj):
                kube.delete(kind, owner.namespace, name)
                emit("Normal", "Deleted", f"deleted {kind} {name}: no longer in the spec")
                deleted.append(f"deleted {kind} {name}")
    return deleted
