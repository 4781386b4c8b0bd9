"""The operator's own Prometheus metrics (`--metrics-address`): reconcile outcomes and time, apply
conflicts, autoscaler scale changes and failed passes. Outcome series exist from start-up, at 0."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

from ragserve.metric_names import LATENCY_BUCKETS

OUTCOMES = ("ok", "invalid_spec", "apply_failed")
P = "ragserve_operator_"

reconciles = Counter(P + "reconciles", "Reconcile passes of a RAGServe, by outcome", ["outcome"])
reconcile_seconds = Histogram(P + "reconcile_duration_seconds", "Time of one reconcile pass", buckets=LATENCY_BUCKETS)
apply_conflicts = Counter(P + "apply_conflicts", "Fields another field manager had changed, taken back by apply")
scale_changes = Counter(P + "scale_changes", "Engine pool replica changes made by the built-in autoscaler", ["pool"])
autoscaler_failures = Counter(P + "autoscaler_failures", "Autoscaler passes that failed (retried next interval)")
for _outcome in OUTCOMES:
    reconciles.labels(_outcome)


def serve(address: str) -> None:
    """Serve /metrics on HOST:PORT (a background thread of this process)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--metrics-address must be HOST:PORT, got {address!r}")
    start_http_server(int(port), addr=host.strip("[]"))
