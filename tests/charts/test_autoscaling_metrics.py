"""The chart's engine autoscalers use the load signals the operator uses (ragserve.metric_names.LOAD_METRICS):
the same Prometheus series, prometheus-adapter names and KEDA aggregations for the same target keys."""

from __future__ import annotations

from ragserve.metric_names import LOAD_METRICS, adapter_name

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
