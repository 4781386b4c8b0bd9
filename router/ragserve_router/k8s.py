"""Kubernetes pod discovery: watch pods matching a label selector; ready pods become engines.

The engine URL is http://<pod IP>:<port>, the port from the pod annotation `ragserve.io/port`
or --k8s-port. The selector is also applied here, so the result is right even where the API
server ignores it. The watch runs in a daemon thread (the official client is synchronous).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path

from ragserve.router_args import RouterConfig
from ragserve_router.engines import K8S, EngineRecord
from ragserve_router.pool import EnginePool, Health

log = logging.getLogger(__name__)
PORT_ANNOTATION = "ragserve.io/port"
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def parse_selector(selector: str) -> list[tuple[str, str, str | None]]:
    """'app=x,tier!=y,canary' -> [(key, op, value)] with op in '=', '!=', 'exists', '!exists'."""
    terms = []
    for part in filter(None, (p.strip() for p in selector.split(","))):
        if "!=" in part:
            key, value = part.split("!=", 1)
            terms.append((key.strip(), "!=", value.strip()))
        elif "=" in part:
            key, value = part.replace("==", "=").split("=", 1)
            terms.append((key.strip(), "=", value.strip()))
        elif part.startswith("!"):
            terms.append((part[1:].strip(), "!exists", None))
        else:
            terms.append((part, "exists", None))
    if not terms or any(not key for key, _, _ in terms):
        raise ValueError(f"invalid --k8s-selector {selector!r}: use e.g. app=ragserve-engine")
    return terms


def matches(labels: dict[str, str], terms: list[tuple[str, str, str | None]]) -> bool:
    checks = {
        "=": lambda k, v: labels.get(k) == v,
        "!=": lambda k, v: labels.get(k) != v,
        "exists": lambda k, v: k in labels,
        "!exists": lambda k, v: k not in labels,
    }
    return all(checks[op](key, value) for key, op, value in terms)


def pod_engine(pod: dict, default_port: int) -> EngineRecord | None:
    """The engine a pod stands for, or None unless it is running, ready and not terminating."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    ip = status.get("podIP")
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or conditions.get("Ready") != "True" or not ip:
        return None
    port = int((meta.get("annotations") or {}).get(PORT_ANNOTATION, default_port))
    host = f"[{ip}]" if ":" in ip else ip
    return EngineRecord(f"{meta.get('name')}", f"http://{host}:{port}", [], source=K8S)


class PodWatcher:
    def __init__(self, cfg: RouterConfig, pool: EnginePool) -> None:
        self.cfg = cfg
        self.pool = pool
        self.terms = parse_selector(cfg.k8s_selector or "")
        self.namespace = cfg.k8s_namespace or (SA_NAMESPACE.read_text().strip() if SA_NAMESPACE.exists() else "default")
        self._stop = threading.Event()

    def apply(self, event_type: str, pod: dict) -> None:
        """Runs on the event loop: add, update or remove the pod's engine."""
        name = (pod.get("metadata") or {}).get("name")
        labels = (pod.get("metadata") or {}).get("labels") or {}
        record = pod_engine(pod, self.cfg.k8s_port) if event_type != "DELETED" and matches(labels, self.terms) else None
        current = self.pool.discovered.get(name)
        if record is None:
            if current is not None and current.source == K8S:
                del self.pool.discovered[name]
                log.info("pod %s left the engine pool", name)
            return
        if current is not None and current.url == record.url:
            return
        self.pool.discovered[name] = record
        self.pool.health[name] = Health(healthy=False)  # routable once its first probe succeeds
        log.info("pod %s joined the engine pool at %s", name, record.url)
        asyncio.ensure_future(self.pool.probe(record))

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import client, config, watch

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CoreV1Api()
        while not self._stop.is_set():
            try:
                selector = self.cfg.k8s_selector
                listing = api.list_namespaced_pod(self.namespace, label_selector=selector, _preload_content=False)
                items = json.loads(listing.data).get("items", [])
                names = {(p.get("metadata") or {}).get("name") for p in items}
                loop.call_soon_threadsafe(self._resync, items, names)
                stream = watch.Watch().stream(
                    api.list_namespaced_pod, self.namespace, label_selector=selector, timeout_seconds=300
                )
                for event in stream:
                    if self._stop.is_set():
                        return
                    loop.call_soon_threadsafe(self.apply, event["type"], event["raw_object"])
            except Exception as exc:  # API server gone, RBAC, network: retry
                log.warning("pod watch failed: %s; retrying", exc)
                self._stop.wait(2.0)

    def _resync(self, items: list[dict], names: set[str]) -> None:
        for name in [n for n, r in self.pool.discovered.items() if r.source == K8S and n not in names]:
            self.apply("DELETED", {"metadata": {"name": name}})
        for pod in items:
            self.apply("MODIFIED", pod)

    async def run(self) -> None:
        thread = threading.Thread(target=self._watch, args=(asyncio.get_running_loop(),), daemon=True, name="k8s-watch")
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            self._stop.set()
