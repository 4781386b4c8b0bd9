"""The chart's engine autoscalers use the load signals the operator uses (ragserve.metric_names.LOAD_METRICS):
the same Prometheus series, prometheus-adapter names and KEDA aggregations for the same target keys."""

from __future__ import annotations

import pytest

from ragserve.metric_names import LOAD_METRICS, adapter_name, load_metrics

KEYS = {"targetWaitingRequests": 3, "targetKVCacheUsage": 0.7}


def pool(mode: str) -> dict:
    return {"name": "p", "model": "m", "autoscaling": {"mode": mode, "maxReplicas": 4, **KEYS}}


def test_hpa_metrics(render):
    (hpa,) = [d for d in render({"engines": [pool("hpa")]}) if d["kind"] == "HorizontalPodAutoscaler"]
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names == [adapter_name(m.name) for m in LOAD_METRICS if m.target_key in KEYS]


def test_keda_triggers(render):
    (scaled,) = [d for d in render({"engines": [pool("keda")]}) if d["kind"] == "ScaledObject"]
    triggers = scaled["spec"]["triggers"]
    expected = [m for m in LOAD_METRICS if m.target_key in KEYS]
    assert len(triggers) == len(expected)
    for trigger, metric in zip(triggers, expected, strict=True):
        assert trigger["metadata"]["query"].startswith(f"{metric.over_pool}({metric.name}{{")
        assert trigger["metricType"] == ("AverageValue" if metric.over_pool == "sum" else "Value")
        assert float(trigger["metadata"]["threshold"]) == KEYS[metric.target_key]


ROLE_KEYS = KEYS | {"targetQueuedPrefillTokens": 2048}


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_a_pools_role_picks_its_signals(render, role):
    """A prefill pool scales on waiting requests and queued prefill tokens, a decode pool on waiting requests and
    KV usage, a `both` pool on all: the operator's choice (load_metrics), in the HPA and in KEDA's triggers."""
    pools = [{**pool(mode), "name": mode, "role": role} for mode in ("hpa", "keda")]
    for p in pools:
        p["autoscaling"] |= ROLE_KEYS
    docs = render({"engines": pools})
    expected = [m for m in load_metrics(role) if m.target_key in ROLE_KEYS]
    assert len(expected) == (3 if role == "both" else 2)
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [adapter_name(m.name) for m in expected]
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert [q.split("{")[0] for q in queries] == [f"{m.over_pool}({m.name}" for m in expected]


def test_a_prefill_pool_with_only_decode_targets_is_refused(render_fails):
    only_kv = {"mode": "hpa", "targetWaitingRequests": None, "targetKVCacheUsage": 0.7}
    render_fails(
        {"engines": [{"name": "p", "model": "m", "role": "prefill", "autoscaling": only_kv}]},
        "engines[p].autoscaling needs a target for a prefill pool",
    )
