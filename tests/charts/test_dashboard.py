"""The Grafana dashboard, the alerts and the autoscalers' queries only use metrics the components export:
checked against live /metrics scrapes of real `ragserve cachestore`, `ragserve router` and `ragserve engine`
processes on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from ragserve.prom_text import metric_types, samples
from tests.helpers import process

OWNERS = {"vllm:": "engine", "ragserve:": "engine", "ragserve_engine_": "engine"}
OWNERS |= {"ragserve_router_": "router", "ragserve_cachestore_": "cachestore"}
NOT_OURS = {"up", "DCGM_FI_DEV_GPU_UTIL"}  # Prometheus' own series; the NVIDIA DCGM exporter's
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint", "le"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"} | {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
}
NAME = r"(?<![\w:])([a-zA-Z_:][\w:]*)(?![\w:])"
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "summary": ["", "_sum", "_count"]}


def promql_metrics(expr: str) -> dict[str, set[str]]:
    """Metric names an expression selects, with the label names it matches or groups them by."""
    expr = re.sub(r"\[[^\]]*\]", "", re.sub(r'"[^"]*"', '""', expr))  # no strings, no range selectors
    grouping = {g for c in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for g in re.split(r"\s*,\s*", c) if g}
    out: dict[str, set[str]] = {}
    for name, matchers in re.findall(rf"{NAME}\s*(\{{[^}}]*\}})?(?!\s*\()", expr):
        if name in KEYWORDS or name in grouping or re.fullmatch(r"[0-9.e+-]+", name):
            continue
        out.setdefault(name, set()).update(re.findall(r"([a-zA-Z_]\w*)\s*!?=~?", matchers))
    return {name: labels | grouping for name, labels in out.items()}


def test_promql_parser_finds_metrics_and_labels():
    expr = 'histogram_quantile(0.9, sum by (le) (rate(vllm:x_bucket{namespace="$ns", model_name=~"$m"}[5m]))) > 0.5'
    assert promql_metrics(expr) == {"vllm:x_bucket": {"le", "namespace", "model_name"}}
    assert promql_metrics('max(a_b) == 0 or absent(c{job="j"})') == {"a_b": set(), "c": {"job"}}
    expr = "sum by (tier) (rate(s_total[$__rate_interval])) / clamp_min(sum(t), 1)"
    assert promql_metrics(expr) == {"s_total": {"tier"}, "t": {"tier"}}


def dashboard_queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"]["query"]).group(1))
    return exprs


def test_dashboard_is_generated_parseable_and_shipped(chart_dir, render):
    out = subprocess.run(
        [sys.executable, str(chart_dir / "scripts" / "gen_dashboard.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    dashboard = json.loads((chart_dir / "files" / "dashboard.json").read_text())
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("first token", "inter-token", "running", "kv cache", "prefix", "routing accuracy", "preemption"):
        assert topic in titles
    assert "tier usage" in titles and all(p.get("targets") or p["type"] == "row" for p in dashboard["panels"])
    (cm,) = [d for d in render({"monitoring": {"grafanaDashboard": {"enabled": True}}}) if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["ragserve.json"]) == dashboard


def chart_queries(render, scenarios, chart_dir) -> list[str]:
    """PromQL of the dashboard, the PrometheusRule, the KEDA triggers; HPA custom metrics as adapter series."""
    exprs = dashboard_queries(json.loads((chart_dir / "files" / "dashboard.json").read_text()))
    docs = render(scenarios["monitoring"]) + render(scenarios["keda"]) + render(scenarios["hpa"])
    for doc in docs:
        if doc["kind"] == "PrometheusRule":
            exprs += [r["expr"] for g in doc["spec"]["groups"] for r in g["rules"]]
        elif doc["kind"] == "ScaledObject":
            exprs += [t["metadata"]["query"] for t in doc["spec"]["triggers"]]
        elif doc["kind"] == "HorizontalPodAutoscaler":
            names = [m["pods"]["metric"]["name"] for m in doc["spec"]["metrics"] if m["type"] == "Pods"]
            # prometheus-adapter rules in the chart README: vllm:X -> vllm_X, requests_total -> requests_per_second
            exprs += [re.sub(r"^vllm_", "vllm:", n).replace("_requests_per_second", "_requests_total") for n in names]
    assert len(exprs) > 30
    return exprs


def exported(text: str) -> dict[str, set[str] | None]:
    """Sample names a /metrics page exports -> label names seen (None: declared, no sample yet)."""
    out: dict[str, set[str] | None] = {}
    for family, kind in metric_types(text).items():
        for suffix in SUFFIXES.get(kind, [""]):
            out.setdefault(family + suffix, None)
    for sample in samples(text):
        out[sample.name] = (out.get(sample.name) or set()) | set(sample.labels)
    return out


def owner(metric: str) -> str:
    found = [o for prefix, o in OWNERS.items() if metric.startswith(prefix)]
    assert found, f"{metric} is no ragserve component's metric"
    return found[0]


@pytest.fixture(scope="module")
def scrapes(stack, tmp_path_factory) -> dict[str, str]:
    """Cachestore, router and an engine registered with both (tiny model); one request through the router."""
    cs_port, cs_metrics, r_port, r_grpc = (stack.port() for _ in range(4))
    cachestore = stack.start(
        "cachestore",
        ["cachestore", "--host", "127.0.0.1", "--port", str(cs_port), "--metrics-port", str(cs_metrics)]
        + ["--memory", "64MiB", "--disk-dir", str(tmp_path_factory.mktemp("disk")), "--disk", "64MiB"],
        f"http://127.0.0.1:{cs_metrics}",
    )
    router = stack.start(
        "router",
        ["router", "--host", "127.0.0.1", "--port", str(r_port), "--grpc-port", str(r_grpc)]
        + ["--registry-allow-unauthenticated"],
        f"http://127.0.0.1:{r_port}",
    )
    cachestore.wait_http("/metrics", 60)
    router.wait_http("/health", 60)
    from tests.helpers.tiny_models import tiny_model

    e_port = stack.port()
    engine = stack.start(
        "engine",
        ["engine", "--host", "127.0.0.1", "--port", str(e_port), "--model", str(tiny_model("llama"))]
        + ["--served-model-name", "tiny", "--num-gpu-blocks", "64", "--router", f"127.0.0.1:{r_grpc}"]
        + ["--advertise-url", f"http://127.0.0.1:{e_port}", "--cachestore", f"127.0.0.1:{cs_port}"],
        f"http://127.0.0.1:{e_port}",
    )
    engine.wait_http("/ready", 300)

    def registered() -> bool:  # the engine's registration reached the router
        return "tiny" in {m["id"] for m in httpx.get(router.url + "/v1/models", timeout=5).json()["data"]}

    process.until(registered, timeout=60, interval=0.2, fail=False)
    assert registered(), f"engine never registered:\n{engine.output()}\n{router.output()}"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 4}
    reply = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    pages = {"cachestore": cachestore, "router": router, "engine": engine}
    return {name: httpx.get(p.url + "/metrics", timeout=10).text for name, p in pages.items()}


def test_every_queried_metric_is_exported(render, scenarios, chart_dir, scrapes):
    pages = {name: exported(text) for name, text in scrapes.items()}
    checked = set()
    for expr in chart_queries(render, scenarios, chart_dir):
        for metric, labels in promql_metrics(expr).items():
            if metric in NOT_OURS:
                continue
            component = owner(metric)
            assert metric in pages[component], f"{metric} (in {expr!r}) is not exported by the {component}"
            seen = pages[component][metric]
            if seen is not None:
                missing = labels - seen - TARGET_LABELS
                assert not missing, f"{metric} has no label {missing} (has {sorted(seen)}): {expr!r}"
            checked.add(component)
    assert checked == {"engine", "router", "cachestore"}
