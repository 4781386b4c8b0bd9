"""Read an engine pod's load from its Prometheus /metrics (vLLM metric names)."""

from __future__ import annotations

import asyncio
import re

import httpx

from ragserve_operator.autoscaler import PodMetrics
from ragserve_operator.names import ENGINE_PORT

NAMES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
MAX_BYTES = 4 * 1024 * 1024


def parse_metrics(text: str) -> PodMetrics:
    """Requests summed over label sets (one per served model), KV usage the highest. ValueError if absent."""
    found: dict[str, list[float]] = {field: [] for field in NAMES.values()}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in NAMES:
            found[NAMES[match.group(1)]].append(float(match.group(3)))
    missing = [name for name, field in NAMES.items() if not found[field]]
    if missing:
        raise ValueError(f"metrics missing: {', '.join(missing)}")
    return PodMetrics(waiting=sum(found["waiting"]), running=sum(found["running"]), kv_usage=max(found["kv_usage"]))


def pod_metrics_url(pod: dict) -> str | None:
    """http://<pod IP>:<container port named http>/metrics, or None for a pod not ready to serve."""
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    ip = status.get("podIP")
    if not ready or not ip or status.get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
        return None
    ports = [p for c in pod["spec"].get("containers", []) for p in c.get("ports") or [] if p.get("name") == "http"]
    port = ports[0]["containerPort"] if ports else ENGINE_PORT
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


async def scrape(client: httpx.AsyncClient, url: str | None) -> PodMetrics | None:
    if url is None:
        return None
    try:
        response = await client.get(url)
        response.raise_for_status()
        if len(response.content) > MAX_BYTES:
            return None
        return parse_metrics(response.text)
    except (httpx.HTTPError, ValueError):
        return None


async def scrape_pods(pods: list[dict], timeout_s: float = 3.0) -> list[PodMetrics | None]:
    """One entry per pod that counts toward the pool (not terminating or failed): None = no metrics."""
    counted = [p for p in pods if _counts(p)]
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        return list(await asyncio.gather(*(scrape(client, pod_metrics_url(p)) for p in counted)))


def _counts(pod: dict) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return not pod["metadata"].get("deletionTimestamp") and phase not in ("Failed", "Succeeded")
