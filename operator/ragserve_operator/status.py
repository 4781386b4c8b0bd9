"""RAGServe status: per-workload ready/desired counts, conditions Ready / Progressing / Degraded, phase."""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass

from ragserve_operator.names import COMPONENT_LABEL, POOL_LABEL

WORKLOADS = ("Deployment", "StatefulSet")


@dataclass(frozen=True)
class Component:
    name: str
    kind: str
    component: str
    pool: str
    ready: int
    desired: int
    updated: int
    current: bool  # the workload controller has seen the latest spec

    @property
    def done(self) -> bool:
        return self.current and self.ready >= self.desired and self.updated >= self.desired

    def summary(self) -> str:
        return f"{self.name} {self.ready}/{self.desired} ready" + ("" if self.done else f", {self.updated} updated")


def component(obj: dict) -> Component:
    meta, spec, st = obj["metadata"], obj.get("spec", {}), obj.get("status") or {}
    labels = meta.get("labels") or {}
    generation, observed = meta.get("generation"), st.get("observedGeneration")
    return Component(
        name=meta["name"],
        kind=obj["kind"],
        component=labels.get(COMPONENT_LABEL, ""),
        pool=labels.get(POOL_LABEL, ""),
        ready=int(st.get("readyReplicas") or 0),
        desired=int(spec.get("replicas", 1)),
        updated=int(st.get("updatedReplicas") or 0),
        current=generation is None or observed is None or observed >= generation,
    )


def now() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def condition(previous: list[dict], type_: str, ok: bool, reason: str, message: str, generation: int | None) -> dict:
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == type_), None)
    unchanged = old and old.get("status") == status and old.get("lastTransitionTime")
    since = old["lastTransitionTime"] if unchanged else now()
    out = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def healthy_status(
    previous: dict, generation: int | None, components: list[Component], conflicts: list[str] | None = None
) -> dict:
    """conflicts: apply conflicts of this pass (fields another manager had changed, taken back); the last
    ones stay in status (a merge patch without the key keeps it) until a pass has new ones."""
    waiting = [c for c in components if not c.done]
    unready = [c for c in components if c.ready < c.desired]
    engines = [c for c in components if c.component in ("engine", "vllm")]
    ready_msg = "all components ready" if not unready else "not ready: " + "; ".join(c.summary() for c in unready)
    progress_msg = "up to date" if not waiting else "rolling out: " + "; ".join(c.summary() for c in waiting)
    old = previous.get("conditions") or []
    conditions = [
        condition(old, "Ready", not unready, "AllReady" if not unready else "Waiting", ready_msg, generation),
        condition(old, "Progressing", bool(waiting), "RollingOut" if waiting else "Complete", progress_msg, generation),
        condition(old, "Degraded", False, "SpecValid", "the spec is valid and applied", generation),
    ]
    out = {
        "observedGeneration": generation,
        "phase": "Ready" if not waiting else "Progressing",
        "message": ready_msg if unready else progress_msg,
        "readyEngines": sum(c.ready for c in engines),
        "desiredEngines": sum(c.desired for c in engines),
        "conditions": conditions,
        "components": [
            {k: v for k, v in asdict(c).items() if k not in ("current", "component") and v != ""} for c in components
        ],
    }
    if conflicts:
        out["lastApplyConflicts"] = {"time": now(), "conflicts": conflicts}
    return out


def degraded_status(previous: dict, generation: int | None, reason: str, message: str) -> dict:
    """Keeps the last Ready / Progressing conditions: the children keep running the last good spec."""
    old = previous.get("conditions") or []
    kept = [c for c in old if c.get("type") in ("Ready", "Progressing")]
    return {
        "observedGeneration": generation,
        "phase": "Degraded",
        "message": message,
        "conditions": kept + [condition(old, "Degraded", True, reason, message, generation)],
    }
