"""Autoscaling decisions (the HPA's algorithm) with a controllable clock: formula, tolerance, missing
pods, max over metrics, stabilization windows, scale-down delay, min/max."""

from __future__ import annotations

from ragserve.prom_text import EngineLoad as PodMetrics
from ragserve_operator.scaling.decision import Policy, Stabilizer, metric_replicas, recommend


def pods(*waiting: float, kv: float = 0.0, running: float = 0.0, queued: float = 0.0) -> list[PodMetrics]:
    return [PodMetrics(waiting=w, running=running, kv_usage=kv, queued_prefill_tokens=queued) for w in waiting]


def policy(**kw) -> Policy:
    base = dict(min_replicas=1, max_replicas=10, targets={"waiting": 2.0, "kv_usage": 0.8}, scale_down_window_s=0.0)
    return Policy(**{**base, **kw})


def test_hpa_formula():
    # 2 pods averaging 6 waiting, target 2 per pod: ceil(2 * 6 / 2) = 6
    assert metric_replicas(2, [4.0, 8.0], 2.0, 0.1) == 6
    # 4 pods averaging 0.5 waiting, target 2: ceil(4 * 0.25) = 1
    assert metric_replicas(4, [0.0, 1.0, 0.5, 0.5], 2.0, 0.1) == 1
    # within the tolerance: keep
    assert metric_replicas(3, [2.1, 2.1, 2.1], 2.0, 0.1) == 3


def test_missing_pods_are_conservative():
    # scaling up: a pod without metrics counts as idle (0): avg (6 + 0) / 2 = 3 -> ceil(2 * 1.5) = 3, not 3 * 3 / ...
    assert metric_replicas(2, [6.0, None], 2.0, 0.1) == 3
    # scaling down: a pod without metrics counts as on target: avg (0 + 2) / 2 = 1 -> ceil(2 * 0.5) = 1
    assert metric_replicas(2, [0.0, None], 2.0, 0.1) == 1
    # the fill-in flips the direction: keep the current count
    assert metric_replicas(4, [2.6, None, None, None], 2.0, 0.1) == 4
    # no metrics at all: no decision
    assert metric_replicas(3, [None, None], 2.0, 0.1) == 3


def test_largest_recommendation_over_metrics_wins():
    n, why, averages = recommend(2, pods(0, 0, kv=0.96)[:2], policy())
    assert n == 3 and why.startswith("kv_usage 0.96/pod")  # ceil(2 * 0.96 / 0.8) = 3; waiting says 0
    assert averages == {"waiting": 0.0, "kv_usage": 0.96}
    n, why, _ = recommend(2, pods(10, 10, kv=0.96), policy())
    assert n == 10 and why.startswith("waiting 10/pod")


def test_running_requests_target_is_optional():
    p = policy(targets={"running": 4.0})
    assert recommend(1, pods(0, running=16), p)[0] == 4
    assert recommend(1, pods(50, running=4), p)[0] == 1  # waiting is not a target here


def test_min_and_max():
    s = Stabilizer()
    assert s.decide(0, 2, pods(100, 100), policy(max_replicas=5)).desired == 5
    assert "maxReplicas 5" in s.decide(1, 5, pods(100, 100), policy(max_replicas=5)).reason
    low = Stabilizer().decide(0, 4, pods(0, 0, 0, 0), policy(min_replicas=2))
    assert (low.recommended, low.desired) == (0, 2) and "minReplicas 2" in low.reason


def test_scale_down_window_keeps_the_highest_recent_recommendation():
    p = policy(scale_down_window_s=60.0)
    s = Stabilizer()
    assert s.decide(0, 1, pods(8), p).desired == 4  # scale up at once (no up-window)
    # load gone at t=10: recommendation 0, but the last 60 s recommended 4
    d = s.decide(10, 4, pods(0, 0, 0, 0), p)
    assert (d.recommended, d.desired) == (0, 4) and "stabilization window keeps 4" in d.reason
    assert s.decide(59, 4, pods(0, 0, 0, 0), p).desired == 4
    assert s.decide(61, 4, pods(0, 0, 0, 0), p).desired == 1  # the t=0 recommendation left the window


def test_scale_up_window_keeps_the_lowest_recent_recommendation():
    p = policy(scale_up_window_s=30.0)
    s = Stabilizer()
    assert s.decide(0, 2, pods(2, 2), p).desired == 2
    assert s.decide(10, 2, pods(10, 10), p).desired == 2  # a spike: the window still holds 2
    assert s.decide(20, 2, pods(10, 10), p).desired == 2
    assert s.decide(31, 2, pods(10, 10), p).desired == 10  # sustained for the whole window


def test_scale_down_delay_after_a_scale_up():
    p = policy(scale_down_delay_s=100.0)
    s = Stabilizer()
    assert s.decide(0, 1, pods(6), p).desired == 3
    d = s.decide(50, 3, pods(0, 0, 0), p)
    assert d.desired == 3 and "scale-down delay" in d.reason
    assert s.decide(101, 3, pods(0, 0, 0), p).desired == 1


def test_steady_load_changes_nothing():
    s = Stabilizer()
    for t in range(10):
        d = s.decide(t, 3, pods(2, 2, 2, kv=0.8), policy(scale_down_window_s=300.0))
        assert (d.recommended, d.desired) == (3, 3)


def test_policy_from_spec():
    from ragserve_operator.spec import parse_spec

    spec = parse_spec({"engines": [{"name": "a", "model": "m", "maxReplicas": 7}], "autoscaling": {"mode": "operator"}})
    p = Policy.from_spec(spec.autoscaling, spec.pools[0].raw)
    assert (p.min_replicas, p.max_replicas, p.scale_down_window_s, p.tolerance) == (1, 7, 300, 0.1)
    assert p.targets == {"waiting": 4.0, "kv_usage": 0.8}


def test_a_pools_role_picks_its_signals():
    """Prefill pools scale on waiting requests and queued prefill tokens; decode pools on waiting requests, running
    requests and KV usage (a prefill engine's KV holds finished prompts kept as prefix cache: no pressure)."""
    from ragserve_operator.spec import parse_spec

    autoscaling = {"mode": "operator", "targetQueuedPrefillTokens": 2048, "targetRunningRequests": 8}
    engines = [{"name": r, "model": "m", "role": r, "maxReplicas": 9} for r in ("prefill", "decode", "both")]
    spec = parse_spec({"engines": engines, "autoscaling": autoscaling})
    targets = {p.name: Policy.from_spec(spec.autoscaling, p.raw).targets for p in spec.pools}
    assert targets == {
        "prefill": {"waiting": 4.0, "queued_prefill_tokens": 2048.0},
        "decode": {"waiting": 4.0, "running": 8.0, "kv_usage": 0.8},
        "both": {"waiting": 4.0, "running": 8.0, "kv_usage": 0.8, "queued_prefill_tokens": 2048.0},
    }
    prefill = Policy.from_spec(spec.autoscaling, spec.pools[0].raw)
    busy = pods(1, 1, kv=0.99, queued=8000)  # 2 pods, 8,000 prompt tokens queued on each: ceil(2 x 8000 / 2048) = 8
    n, why, _ = recommend(2, busy, prefill)
    assert n == 8 and why.startswith("queued_prefill_tokens 8000/pod")
