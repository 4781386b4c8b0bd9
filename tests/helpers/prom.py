"""Reading /metrics as Prometheus does: histogram_quantile over cumulative buckets, "within one bucket", and one
metric summed over the label sets that match (router_metric)."""

from __future__ import annotations

import bisect
import math

import httpx
from prometheus_client.parser import text_string_to_metric_families


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q * count."""
    bounds = sorted(buckets)
    count = buckets[math.inf]
    assert count > 0, "empty histogram"
    rank = q * count
    i = next(i for i, b in enumerate(bounds) if buckets[b] >= rank)
    if bounds[i] == math.inf:
        return bounds[-2]
    lower = bounds[i - 1] if i else 0.0
    below = buckets[bounds[i - 1]] if i else 0.0
    return lower + (bounds[i] - lower) * (rank - below) / max(buckets[bounds[i]] - below, 1e-12)


def within_one_bucket(value: float, lo: float, hi: float, bounds: tuple[float, ...]) -> bool:
    """value lies in the buckets holding [lo, hi], or in the bucket just outside either end."""
    edges = (0.0, *bounds, math.inf)
    first = max(bisect.bisect_left(edges, lo) - 2, 0)
    last = min(bisect.bisect_left(edges, hi) + 1, len(edges) - 1)
    return edges[first] <= value <= edges[last]


def router_metric(url: str, name: str, **labels: str) -> float:
    """Sample `name` of {url}/metrics summed over the label sets that have `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
