"""`ragserve up --monitoring`: a local Prometheus scraping the stack with the labels the chart's monitors give.

Each process is scraped as the chart's ServiceMonitors (router, cachestore) and PodMonitor (engines) would
scrape its pod in namespace NAMESPACE of release RELEASE: `job` is the selected Service's name (the PodMonitor's
`namespace/name` for engines), `pod` follows the Deployment/StatefulSet naming, engines carry `pool`. So the
chart's dashboard, alerts, adapter rules and KEDA queries run unchanged against it
(tests/observability/test_prometheus.py checks these labels against the rendered chart).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ragserve.stack.process import ChildSpec

RELEASE, NAMESPACE, POOL = "ragserve", "ragserve-local", "default"
REPLICA_SET = "local"  # the chart's pods are <deployment>-<replica set hash>-<5 characters>


@dataclass(frozen=True)
class Target:
    address: str  # host:port serving /metrics
    labels: dict[str, str]


def router_target(address: str, index: int = 0) -> Target:
    pod = f"{RELEASE}-router-{REPLICA_SET}-{index:05d}"
    return Target(address, {"namespace": NAMESPACE, "pod": pod, "job": f"{RELEASE}-router", "container": "router"})


def engine_target(address: str, index: int, pool: str = POOL) -> Target:
    pod = f"{RELEASE}-engine-{pool}-{REPLICA_SET}-{index:05d}"
    labels = {"namespace": NAMESPACE, "pod": pod, "job": f"{NAMESPACE}/{RELEASE}-engine", "pool": pool}
    return Target(address, {**labels, "container": "engine"})


def cachestore_target(address: str, index: int = 0) -> Target:
    labels = {"namespace": NAMESPACE, "pod": f"{RELEASE}-cachestore-{index}", "job": f"{RELEASE}-cachestore-headless"}
    return Target(address, {**labels, "container": "cachestore"})


def stack_targets(state: dict) -> list[Target]:
    """Targets of a running stack (its `--state-file` contents: URLs of router, engines, cachestore metrics)."""
    targets = [router_target(_address(state["url"]))]
    targets += [engine_target(_address(url), i) for i, url in enumerate(state["engines"])]
    if state.get("cachestore_metrics"):
        targets.append(cachestore_target(_address(state["cachestore_metrics"])))
    return targets


def prometheus_config(targets: list[Target], interval: str = "5s", rule_files: list[str] = ()) -> dict:
    """prometheus.yml: one scrape job per `job` label, every target with its labels."""
    jobs: dict[str, list[dict]] = {}
    for t in targets:
        jobs.setdefault(t.labels["job"], []).append({"targets": [t.address], "labels": t.labels})
    configs = [{"job_name": job, "metrics_path": "/metrics", "static_configs": sc} for job, sc in jobs.items()]
    config = {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": configs}
    if rule_files:
        config["rule_files"] = list(rule_files)
    return config


def prometheus_spec(workdir: Path, port: int, targets: list[Target], interval: str = "5s", **kw) -> ChildSpec:
    """The `prometheus` child (raises FileNotFoundError when it is not installed)."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise FileNotFoundError("prometheus is not installed (Debian/Ubuntu: apt-get install prometheus)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps(prometheus_config(targets, interval, **kw), indent=2))  # JSON is YAML
    url = f"http://127.0.0.1:{port}"
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}"]
    argv += [f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    return ChildSpec("prometheus", argv, url + "/-/ready", url)


def _address(url: str) -> str:
    return url.split("://", 1)[-1].split("/", 1)[0]


def start_monitoring(stack, interval: str, stop, rule_files: list[str] = ()) -> str | None:
    """Start Prometheus as one more child of a ready stack; its URL, or None (said why) when not installed."""
    import atexit
    import tempfile

    from ragserve.stack.spec import free_port
    from ragserve.stack.supervisor import child_env

    workdir = Path(tempfile.mkdtemp(prefix="ragserve-up-prometheus-"))
    atexit.register(shutil.rmtree, workdir, True)
    try:
        rules = [str(Path(f).resolve()) for f in rule_files]
        spec = prometheus_spec(workdir, free_port(), stack_targets(stack.state()), interval, rule_files=rules)
    except FileNotFoundError as exc:
        stack.say(f"--monitoring: {exc}; serving without it")
        return None
    child = stack._spawn(spec, child_env())
    if not stack._wait([child], stop) or not _scraped_all(spec.url, stop):
        return None
    stack.prometheus_url = spec.url
    return spec.url


def _scraped_all(url: str, stop, timeout: float = 60.0) -> bool:
    """Until every target has been scraped once (Prometheus applies new targets every 5 s): a rate() over
    the first requests then starts from the zeros the components export."""
    import time

    from ragserve.stack.health import http_get

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, body = http_get(url + "/api/v1/targets")
        targets = (body.get("data") or {}).get("activeTargets") or []
        if targets and all(t.get("health") == "up" for t in targets):
            return True
        if stop.wait(0.25):
            return False
    return True  # serve anyway; the targets page says what is wrong
