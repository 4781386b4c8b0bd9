"""Autoscaling decisions, the HorizontalPodAutoscaler's algorithm on engine metrics (pure; clock passed in).

Per metric: desired = ceil(pods × average / target), skipped within the tolerance; pods without
metrics count as 0 when scaling up and as on target when scaling down (the HPA's conservative rule).
The largest recommendation over metrics wins, then stabilization windows (scale up to the lowest
recommendation of the up-window, down to the highest of the down-window), the scale-down delay
after a scale-up, and min/max."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ragserve.metric_names import load_metrics
from ragserve.prom_text import EngineLoad


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    targets: dict[str, float]  # EngineLoad field -> per-pod target
    tolerance: float = 0.1
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    scale_down_delay_s: float = 0.0

    @classmethod
    def from_spec(cls, autoscaling: dict, pool: dict) -> Policy:
        """The RAGServe's targets for the signals that size a pool of the pool's role."""
        return cls(
            min_replicas=pool["minReplicas"],
            max_replicas=pool["maxReplicas"],
            targets={
                m.field: float(autoscaling[m.target_key])
                for m in load_metrics(pool.get("role", "both"))
                if autoscaling.get(m.target_key) is not None
            },
            tolerance=autoscaling["tolerance"],
            scale_up_window_s=autoscaling["scaleUpStabilizationSeconds"],
            scale_down_window_s=autoscaling["scaleDownStabilizationSeconds"],
            scale_down_delay_s=autoscaling["scaleDownDelaySeconds"],
        )


@dataclass(frozen=True)
class Decision:
    current: int
    recommended: int  # from metrics alone
    desired: int  # after windows, delay and min/max
    reason: str
    averages: dict[str, float]


def metric_replicas(current: int, values: list[float | None], target: float, tolerance: float) -> int:
    """One metric's recommendation; None marks a pod whose metrics could not be read."""
    known = [v for v in values if v is not None]
    missing = len(values) - len(known)
    if not known:
        return current
    ratio = sum(known) / len(known) / target
    if missing == 0:
        return current if abs(ratio - 1) <= tolerance else math.ceil(ratio * len(known))
    if abs(ratio - 1) <= tolerance:
        return current
    filled = known + [0.0 if ratio > 1 else target] * missing
    new_ratio = sum(filled) / len(filled) / target
    if abs(new_ratio - 1) <= tolerance or (ratio > 1) != (new_ratio > 1):
        return current
    desired = math.ceil(new_ratio * len(filled))
    return current if (new_ratio > 1 and desired < current) or (new_ratio < 1 and desired > current) else desired


def recommend(current: int, pods: list[EngineLoad | None], policy: Policy) -> tuple[int, str, dict[str, float]]:
    averages, best, why = {}, None, "no engine metrics"
    for metric, target in policy.targets.items():
        values = [None if p is None else getattr(p, metric) for p in pods]
        known = [v for v in values if v is not None]
        if not known:
            continue
        averages[metric] = round(sum(known) / len(known), 4)
        n = metric_replicas(current, values, target, policy.tolerance)
        if best is None or n > best:
            best, why = n, f"{metric} {averages[metric]:g}/pod vs target {target:g}"
    return (current if best is None else best), why, averages


@dataclass
class Stabilizer:
    """Recommendation history of one pool (kept in memory, like the HPA controller's)."""

    history: list[tuple[float, int]] = field(default_factory=list)
    last_scale_up: float | None = None

    def decide(self, now: float, current: int, pods: list[EngineLoad | None], policy: Policy) -> Decision:
        recommended, why, averages = recommend(current, pods, policy)
        horizon = max(policy.scale_up_window_s, policy.scale_down_window_s)
        self.history = [(t, r) for t, r in self.history if now - t < horizon]
        up = [r for t, r in self.history if now - t < policy.scale_up_window_s] + [recommended]
        down = [r for t, r in self.history if now - t < policy.scale_down_window_s] + [recommended]
        self.history.append((now, recommended))
        desired = min(max(current, min(up)), max(down))
        if desired != recommended:
            why += f"; stabilization window keeps {desired} (recommended {recommended})"
        recently_up = self.last_scale_up is not None and now - self.last_scale_up < policy.scale_down_delay_s
        if desired < current and recently_up:
            desired, why = current, why + f"; scale-down delay {policy.scale_down_delay_s:g}s after the last scale-up"
        bounded = min(max(desired, policy.min_replicas), policy.max_replicas)
        if bounded != desired:
            why += f"; {'min' if bounded > desired else 'max'}Replicas {bounded}"
        if bounded > current:
            self.last_scale_up = now
        return Decision(current, recommended, bounded, why, averages)
