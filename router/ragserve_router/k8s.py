"""Kubernetes pod discovery: watch pods matching a label selector; ready pods become engines.

--k8s-selector: ragserve engine pods. The engine URL is http://<pod IP>:<port> (https:// with the pod annotation
`ragserve.io/scheme: https`), the port from the pod annotation `ragserve.io/port` or --k8s-port.

--external-k8s-selector: external (vLLM) engine pods, followed from their KV events as --external-engine
ones are (`pod_external_spec` for the ports). The engine id is `external-<pod name>`; a pod whose IP or ports
change is a new engine (its index cleared, followed from cold).

The selector is also applied here, so the result is right even where the API server ignores it. The
watch (list, then watch, pods of one namespace: all the router's Role grants) runs in a daemon thread
(the official client is synchronous).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path

from ragserve.external_engine import ExternalEngineSpec
from ragserve.router_args import RouterConfig
from ragserve_router.engines import K8S, EngineRecord
from ragserve_router.external import ExternalEngines
from ragserve_router.pool import EnginePool
from ragserve_router.slots import Health

log = logging.getLogger(__name__)
PORT_ANNOTATION = "ragserve.io/port"
SCHEME_ANNOTATION = "ragserve.io/scheme"  # "https": the engine serves TLS (--tls-cert-file)
EVENTS_PORT_ANNOTATION = "ragserve.io/kv-events-port"
REPLAY_PORT_ANNOTATION = "ragserve.io/kv-replay-port"
DP_ANNOTATION = "ragserve.io/data-parallel-size"
EXTERNAL_HTTP_PORT, EXTERNAL_EVENTS_PORT = 8000, 5557  # vLLM's defaults (vllm serve --port, KVEventsConfig)
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


def ready_host(pod: dict) -> str | None:
    """The pod's IP as a URL host, or None unless it is running, ready and not terminating."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    ip = status.get("podIP")
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or conditions.get("Ready") != "True" or not ip:
        return None
    return f"[{ip}]" if ":" in ip else ip


def pod_engine(pod: dict, default_port: int) -> EngineRecord | None:
    """The engine a pod stands for, or None unless it is running, ready and not terminating."""
    meta = pod.get("metadata") or {}
    host = ready_host(pod)
    if host is None:
        return None
    annotations = meta.get("annotations") or {}
    port = int(annotations.get(PORT_ANNOTATION, default_port))
    scheme = "https" if annotations.get(SCHEME_ANNOTATION) == "https" else "http"  # an engine serving TLS
    return EngineRecord(f"{meta.get('name')}", f"{scheme}://{host}:{port}", [], source=K8S)


def named_ports(pod: dict) -> dict[str, int]:
    """The pod's container ports by name (the first container naming one wins)."""
    out: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") and port.get("containerPort"):
                out.setdefault(port["name"], int(port["containerPort"]))
    return out


def pod_external_spec(pod: dict) -> ExternalEngineSpec | None:
    """The external (vLLM) engine a pod stands for, or None unless it is running, ready and not terminating.

    Each port from its annotation, else the container port of that name, else vLLM's default:
    HTTP `ragserve.io/port` / `http` / 8000; KV events `ragserve.io/kv-events-port` / `kv-events` / 5557;
    replay `ragserve.io/kv-replay-port` / `kv-replay` / none (only a pod that declares it is asked for a
    replay). Data parallelism from `ragserve.io/data-parallel-size` (default 1; rank r publishes on port + r).
    Raises ValueError on an annotation that is not a valid number.
    """
    host = ready_host(pod)
    if host is None:
        return None
    meta = pod.get("metadata") or {}
    annotations, ports = meta.get("annotations") or {}, named_ports(pod)

    def port(annotation: str, name: str, default: int | None) -> int | None:
        value = annotations.get(annotation, ports.get(name, default))
        if value is None:
            return None
        if not str(value).isdigit() or not 0 < int(value) < 65536:
            raise ValueError(f"pod {meta.get('name')}: {annotation} {value!r} is not a port")
        return int(value)

    dp = str(annotations.get(DP_ANNOTATION, "1"))
    if not dp.isdigit() or int(dp) < 1:
        raise ValueError(f"pod {meta.get('name')}: {DP_ANNOTATION} {dp!r} is not a positive integer")
    replay = port(REPLAY_PORT_ANNOTATION, "kv-replay", None)
    return ExternalEngineSpec(
        f"http://{host}:{port(PORT_ANNOTATION, 'http', EXTERNAL_HTTP_PORT)}",
        f"tcp://{host}:{port(EVENTS_PORT_ANNOTATION, 'kv-events', EXTERNAL_EVENTS_PORT)}",
        f"tcp://{host}:{replay}" if replay is not None else None,
        int(dp),
    )


class PodWatcher:
    """--k8s-selector: ragserve engine pods into the pool's discovered engines."""

    name = "k8s-watch"

    def __init__(self, cfg: RouterConfig, pool: EnginePool) -> None:
        self.cfg = cfg
        self.pool = pool
        self.selector = self.selector_of(cfg)
        self.terms = parse_selector(self.selector)
        self.namespace = cfg.k8s_namespace or (SA_NAMESPACE.read_text().strip() if SA_NAMESPACE.exists() else "default")
        self._stop = threading.Event()

    @staticmethod
    def selector_of(cfg: RouterConfig) -> str:
        return cfg.k8s_selector or ""

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
                selector = self.selector
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

    def known(self) -> list[str]:
        """Names of the pods this watcher put in the pool."""
        return [n for n, r in self.pool.discovered.items() if r.source == K8S]

    def _resync(self, items: list[dict], names: set[str]) -> None:
        for name in [n for n in self.known() if n not in names]:
            self.apply("DELETED", {"metadata": {"name": name}})
        for pod in items:
            self.apply("MODIFIED", pod)

    async def run(self) -> None:
        thread = threading.Thread(target=self._watch, args=(asyncio.get_running_loop(),), daemon=True, name=self.name)
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            self._stop.set()


class ExternalPodWatcher(PodWatcher):
    """--external-k8s-selector: external (vLLM) engine pods into the pool, followed by `ExternalEngines`."""

    name = "k8s-external-watch"

    def __init__(self, cfg: RouterConfig, pool: EnginePool, external: ExternalEngines) -> None:
        super().__init__(cfg, pool)
        self.external = external
        self.pods: dict[str, ExternalEngineSpec] = {}  # pod name -> the engine it stands for

    @staticmethod
    def selector_of(cfg: RouterConfig) -> str:
        return cfg.external_k8s_selector or ""

    def known(self) -> list[str]:
        return list(self.pods)

    def apply(self, event_type: str, pod: dict) -> None:
        """Runs on the event loop: start following the pod's engine, or stop and clear it."""
        meta = pod.get("metadata") or {}
        name = meta.get("name")
        spec = None
        if event_type != "DELETED" and matches(meta.get("labels") or {}, self.terms):
            try:
                spec = pod_external_spec(pod)
            except ValueError as exc:
                log.warning("external pod ignored: %s", exc)
        current = self.pods.get(name)
        if spec == current:
            return
        engine_id = f"external-{name}"
        if current is not None:  # gone, not ready, or a new IP or ports: a new engine, the old one's index cleared
            del self.pods[name]
            self.pool.discovered.pop(engine_id, None)
            self.pool.health.pop(engine_id, None)
            self.external.remove(engine_id)
            log.info("external pod %s left the engine pool", name)
        if spec is None:
            return
        self.pods[name] = spec
        record = self.external.add(engine_id, spec)
        self.pool.discovered[engine_id] = record
        self.pool.health[engine_id] = Health(healthy=False)  # routable once its first probe succeeds
        log.info(
            "external pod %s joined the engine pool as %s at %s, events %s", name, engine_id, spec.url, spec.events
        )
        asyncio.ensure_future(self.pool.probe(record))
