"""Make the cluster match desired manifests: create what is missing, merge-patch what drifted,
delete what is no longer desired. Only objects this RAGServe controls are touched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ragserve_operator.kube import Kube, KubeError
from ragserve_operator.names import INSTANCE_LABEL, MANAGED_BY, MANAGED_BY_LABEL, Owner

# fields the API server refuses to change after creation
IMMUTABLE = {"StatefulSet": ("volumeClaimTemplates",)}

Emit = Callable[[str, str, str], None]  # (type, reason, message) -> an Event on the RAGServe


class NotOwnedError(RuntimeError):
    pass


def contains(live: Any, desired: Any) -> bool:
    """True when every field of `desired` has the same value in `live` (server-side defaults are extra)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    return live == desired


@dataclass
class Applied:
    live: dict[tuple[str, str], dict] = field(default_factory=dict)  # (kind, name) -> object after apply
    changes: list[str] = field(default_factory=list)


def _patch_body(obj: dict) -> dict:
    body = {"metadata": {k: obj["metadata"][k] for k in ("labels", "ownerReferences")}}
    body.update({k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")})
    if "spec" in body and obj["kind"] in IMMUTABLE:
        body["spec"] = {k: v for k, v in body["spec"].items() if k not in IMMUTABLE[obj["kind"]]}
    return body


def apply_one(kube: Kube, owner: Owner, obj: dict, live: dict | None, emit: Emit) -> tuple[dict, str | None]:
    kind, name = obj["kind"], obj["metadata"]["name"]
    if live is None:
        try:
            created = kube.create(obj)
        except KubeError as exc:
            if exc.status == 404:
                message = f"cannot create {kind} {name}: is its API ({obj['apiVersion']}) installed?"
                raise KubeError(404, message) from exc
            raise
        emit("Normal", "Created", f"created {kind} {name}")
        return created, f"created {kind} {name}"
    if not owner.owns(live):
        raise NotOwnedError(f"{kind} {name} exists and is not controlled by RAGServe {owner.name}; rename or delete it")
    if contains(live, _patch_body(obj)):
        return live, None
    patched = kube.patch(kind, owner.namespace, name, _patch_body(obj))
    emit("Normal", "Updated", f"updated {kind} {name} to match the spec")
    return patched, f"updated {kind} {name}"


def apply_all(kube: Kube, owner: Owner, desired: list[dict], emit: Emit, fetched: dict | None = None) -> Applied:
    """fetched: (kind, name) -> live object (or None) already read in this pass."""
    out, fetched = Applied(), fetched or {}
    for obj in desired:
        kind, name = obj["kind"], obj["metadata"]["name"]
        live = fetched[(kind, name)] if (kind, name) in fetched else kube.get(kind, owner.namespace, name)
        out.live[(kind, name)], change = apply_one(kube, owner, obj, live, emit)
        if change:
            out.changes.append(change)
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
