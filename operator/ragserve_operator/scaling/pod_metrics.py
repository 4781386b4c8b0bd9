"""Read engine pods' load from their Prometheus /metrics (ragserve.prom_text.engine_load: vLLM names)."""

from __future__ import annotations

import asyncio

import httpx

from ragserve.engine_args import ENGINE_PORT
from ragserve.prom_text import EngineLoad, engine_load

MAX_BYTES = 4 * 1024 * 1024


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


async def scrape(client: httpx.AsyncClient, url: str | None) -> EngineLoad | None:
    if url is None:
        return None
    try:
        response = await client.get(url)
        response.raise_for_status()
        if len(response.content) > MAX_BYTES:
            return None
        return engine_load(response.text)
    except (httpx.HTTPError, ValueError):
        return None


async def scrape_pods(pods: list[dict], timeout_s: float = 3.0) -> list[EngineLoad | None]:
    """One entry per pod that counts toward the pool (not terminating or failed): None = no metrics."""
    counted = [p for p in pods if _counts(p)]
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        return list(await asyncio.gather(*(scrape(client, pod_metrics_url(p)) for p in counted)))


def _counts(pod: dict) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return not pod["metadata"].get("deletionTimestamp") and phase not in ("Failed", "Succeeded")
