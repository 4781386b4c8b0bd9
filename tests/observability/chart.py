"""The chart rendered with the release and namespace `ragserve up --monitoring` labels its targets with."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import yaml

from ragserve.stack import monitoring

CHART = Path(__file__).resolve().parents[2] / "charts" / "ragserve"


def render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=monitoring.RELEASE, namespace=monitoring.NAMESPACE)
    return [d for path, text in sorted(out.items()) if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]


def monitoring_values() -> dict:
    return {"monitoring": {"monitors": {"enabled": True}, "prometheusRule": {"enabled": True}}}


def keda_values() -> dict:
    autoscaling = {"mode": "keda", "maxReplicas": 4, "targetWaitingRequests": 2, "targetKVCacheUsage": 0.7}
    autoscaling["targetQueuedPrefillTokens"] = 2048
    return {"engines": [{"name": monitoring.POOL, "model": "tiny", "autoscaling": autoscaling}]}
