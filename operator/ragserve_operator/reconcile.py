"""One reconcile pass for a RAGServe: validate, size the pools, apply the children, prune, write the status."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from ragserve_operator import metrics
from ragserve_operator.apply import Applied, Emit, NotOwnedError, apply_all, contains, prune
from ragserve_operator.children import OWNED_KINDS, desired_children
from ragserve_operator.kube import Kube, KubeError
from ragserve_operator.names import Owner
from ragserve_operator.pools import settle_pools, size_pools
from ragserve_operator.spec import RAGServeSpec, SpecError, parse_spec
from ragserve_operator.status import WORKLOADS, component, degraded_status, healthy_status

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    lock: threading.Lock = field(default_factory=threading.Lock)
    queued: bool = False  # a reconcile waits for the lock: it will read the latest state anyway


_slots: defaultdict[tuple[str, str], _Slot] = defaultdict(_Slot)
_slots_guard = threading.Lock()


def lock_for(owner: Owner) -> threading.Lock:
    """Child events and RAGServe events reconcile the same object from different threads: one at a time."""
    with _slots_guard:
        return _slots[(owner.namespace, owner.name)].lock


def _clean(value):
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    return value


def write_status(kube: Kube, owner: Owner, previous: dict, status: dict) -> None:
    status = _clean(status)
    if not contains(previous, status):
        kube.patch("RAGServe", owner.namespace, owner.name, {"status": status}, sub="status")


def apply_spec(kube: Kube, owner: Owner, spec: RAGServeSpec, emit: Emit) -> Applied:
    fetched, replicas = size_pools(kube, owner, spec)
    desired = desired_children(owner, spec, replicas)
    applied = apply_all(kube, owner, desired, emit, fetched)
    settle_pools(kube, owner, spec, applied.live)
    prune(kube, owner, desired, OWNED_KINDS, emit)
    return applied


def reconcile(kube: Kube, namespace: str, name: str, emitter: Callable[[dict], Emit]) -> dict | None:
    """Reconcile the RAGServe as stored now (read under its lock). Returns the status written, or None
    when it is gone or a reconcile already waiting will cover this call. Invalid specs and API refusals
    end as a Degraded status, not an exception."""
    with _slots_guard:
        slot = _slots[(namespace, name)]
        if slot.queued:  # coalesce a burst of child events into one pass
            return None
        slot.queued = True
    with slot.lock:
        with _slots_guard:
            slot.queued = False
        body = kube.get("RAGServe", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        with metrics.reconcile_seconds.time():
            try:
                return _reconcile(kube, body, emitter)
            except _Gone:
                return None


class _Gone(Exception):
    """The RAGServe was deleted while its pass ran: the pass's writes are moot, not a failure."""


def _gone(kube: Kube, owner: Owner) -> bool:
    live = kube.get("RAGServe", owner.namespace, owner.name)
    return live is None or live["metadata"].get("uid") != owner.uid or bool(live["metadata"].get("deletionTimestamp"))


def _reconcile(kube: Kube, body: dict, emitter: Callable[[dict], Emit]) -> dict:
    owner, emit = Owner.of(body), emitter(body)
    generation = body["metadata"].get("generation")
    previous = body.get("status") or {}
    outcome = "ok"
    try:
        spec = parse_spec(body.get("spec"), owner.name)
        applied = apply_spec(kube, owner, spec, emit)
        components = [component(obj) for (kind, _), obj in applied.live.items() if kind in WORKLOADS]
        status = healthy_status(previous, generation, components, applied.conflicts)
        metrics.apply_conflicts.inc(len(applied.conflicts))
    except SpecError as exc:
        outcome, status = "invalid_spec", degraded_status(previous, generation, "InvalidSpec", f"invalid spec: {exc}")
    except (KubeError, NotOwnedError) as exc:
        if _gone(kube, owner):
            raise _Gone from exc
        log.warning("reconcile %s/%s failed: %s", owner.namespace, owner.name, exc)
        outcome, status = "apply_failed", degraded_status(previous, generation, "ApplyFailed", str(exc))
    metrics.reconciles.labels(outcome).inc()
    _announce(previous, status, emit)
    try:
        write_status(kube, owner, previous, status)
    except KubeError as exc:
        if _gone(kube, owner):
            raise _Gone from exc
        raise
    return status


def _announce(previous: dict, status: dict, emit: Emit) -> None:
    """An Event when the phase changes, or when the reason for being Degraded does."""
    if status["phase"] == "Degraded":
        if status["message"] != previous.get("message") or previous.get("phase") != "Degraded":
            reason = next(c["reason"] for c in status["conditions"] if c["type"] == "Degraded")
            emit("Warning", reason, status["message"])
    elif status["phase"] != previous.get("phase"):
        emit("Normal", status["phase"], status["message"])
