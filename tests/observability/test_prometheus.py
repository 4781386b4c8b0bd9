"""Every monitoring query evaluated by a real Prometheus scraping a live local stack.

`ragserve up --monitoring` (router, 2 engines, cachestore, Prometheus at a 1 s scrape interval, targets labelled
as the chart's monitors label them) with the chart's PrometheusRule loaded; a short load with prefix-cache hits,
a fetch from the cachestore, preemptions and errors; then every dashboard panel query (template variables
substituted), every alert's signal, every prometheus-adapter rule and every KEDA trigger query must return
data with plausible values, and every rule must evaluate without error.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ragserve.metric_names import LATENCY_BUCKETS
from ragserve.stack import monitoring
from ragserve_engine.server.prefiller import OUTCOMES as LEG_OUTCOMES
from tests.helpers.process import until
from tests.helpers.prom import histogram_quantile, within_one_bucket
from tests.helpers.stack import Up, tiny
from tests.observability.chart import CHART, keda_values, monitoring_values, render

NS = monitoring.NAMESPACE
GPU_ONLY = ("DCGM_FI_DEV_GPU_UTIL",)
ENGINE_TTFT = "vllm:time_to_first_token_seconds"
ROUTER_TTFT = "ragserve_router_time_to_first_token_seconds"  # the NVIDIA DCGM exporter's series: no GPU here
DOC = "Retrieved passage {i}: the paged KV cache splits every sequence into fixed-size blocks of tokens. " * 4


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        resp = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        assert resp.status_code == 200, f"{expr}: {resp.text}"
        return resp.json()["data"]["result"]

    def values(self, expr: str) -> list[float]:
        return [float(r["value"][1]) for r in self.query(expr)]


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory) -> Path:
    (rule,) = [d for d in render(monitoring_values()) if d["kind"] == "PrometheusRule"]
    path = tmp_path_factory.mktemp("rules") / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, rules_file):
    tmp = tmp_path_factory.mktemp("up")
    flags = [
        "--model",
        tiny(),
        "--served-model-name",
        "tiny",
        "--engines",
        "2",
        "--redis",
        "off",
        "--no-logs",
        "--num-gpu-blocks",
        "24",
        "--embedding-engines",
        "0",
    ]
    flags += ["--max-model-len", "384", "--monitoring", "--monitoring-interval", "1s"]
    up = Up(tmp, *flags, "--monitoring-rules", str(rules_file))
    try:
        state = up.wait_ready(300)
        assert state.get("prometheus"), up.output()
        assert f"prometheus:           {state['prometheus']}" in up.output()  # printed next to the gateway
        yield up, state
    finally:
        up.cleanup()


@pytest.fixture(scope="module")
def loaded(stack):
    """The load: repeated documents (local hits), one fetched by the other engine, preemptions, errors."""
    up, state = stack
    url, engines = state["url"], state["engines"]
    seen = {"ttft": [], "e2e": []}
    prom = Prometheus(state["prometheus"])
    counts = {name: f'{name}_count{{namespace="{NS}"}}' for name in (ENGINE_TTFT, ROUTER_TTFT)}
    # every engine and the router scraped once before any request: rate() then counts all of them (a first sample
    # that already held the cold first requests left them out of the TTFT panels but not of the processes' buckets)
    until(
        lambda: len(prom.values(counts[ENGINE_TTFT])) == len(engines) and prom.values(counts[ROUTER_TTFT]),
        timeout=60,
        interval=0.5,
        what="a scrape of each engine and the router",
    )

    def stream(base: str, prompt: str, max_tokens: int = 8, **extra) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, **extra}
        body["stream_options"] = {"include_usage": True}  # the router reads cached tokens from usage
        started, first = time.monotonic(), None
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if first is None and line.startswith("data:"):
                    first = time.monotonic() - started
        seen["ttft"].append(first)
        seen["e2e"].append(time.monotonic() - started)
        return resp.headers.get("x-ragserve-engine", "")

    for i in range(3):
        for _ in range(2):  # the second time from the prefix cache
            stream(url, DOC.format(i=i))
    served = stream(url, DOC.format(i=9))
    cachestore = state["cachestore_metrics"]
    until(lambda: "ragserve_cachestore_puts_total 0.0" not in httpx.get(cachestore + "/metrics").text, timeout=30)
    other = engines[1] if served.endswith("0") else engines[0]
    stream(other, DOC.format(i=9))  # the other engine fetches the blocks from the cachestore
    threads = [
        threading.Thread(target=stream, args=(url, DOC.format(i=20 + j), 120), kwargs={"ignore_eos": True})
        for j in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    bad = {"model": "tiny", "prompt": "x", "temperature": -1}
    assert httpx.post(url + "/v1/completions", json=bad).status_code == 400
    tally = {"200": len(seen["e2e"]) - 1, "404": 1, "400": 1}  # what the router answered (one stream went direct)
    by_code = f'sum by (code) (ragserve_router_requests_total{{namespace="{NS}"}})'

    def scraped() -> dict[str, float]:
        return {r["metric"]["code"]: float(r["value"][1]) for r in prom.query(by_code)}

    until(lambda: scraped() == tally, timeout=30, interval=0.5, fail=False)
    assert scraped() == tally  # through PromQL, the router's counts equal the client's
    for name, urls in ((ENGINE_TTFT, engines), (ROUTER_TTFT, [url])):
        own = histogram_buckets(urls, name)[math.inf]  # the processes' own request count
        until(lambda: sum(prom.values(counts[name])) == own, timeout=30, interval=0.5, what=f"{name} scraped")  # noqa: B023
    return prom, seen


def substitute(expr: str) -> str:
    return expr.replace("$namespace", NS).replace("$model", ".*").replace("$__rate_interval", "5m")


def dashboard() -> dict:
    return json.loads((CHART / "files" / "dashboard.json").read_text())


def test_targets_are_labelled_as_the_charts_monitors(loaded):
    """The local config's job, pod and pool labels are those the rendered monitors give in a cluster."""
    prom, _ = loaded
    docs = render(monitoring_values())
    jobs = set()
    for mon in (d for d in docs if d["kind"] == "ServiceMonitor"):
        (svc,) = [
            d
            for d in docs
            if d["kind"] == "Service"
            and all(d["metadata"]["labels"].get(k) == v for k, v in mon["spec"]["selector"]["matchLabels"].items())
        ]
        jobs.add(svc["metadata"]["name"])  # the Prometheus operator's job label: the Service's name
    for mon in (d for d in docs if d["kind"] == "PodMonitor"):
        jobs.add(f"{NS}/{mon['metadata']['name']}")
        (relabel,) = mon["spec"]["podMetricsEndpoints"][0]["relabelings"]
        assert relabel["targetLabel"] == "pool"
    up = {r["metric"]["job"]: float(r["value"][1]) for r in prom.query(f'max by (job) (up{{namespace="{NS}"}})')}
    assert up == {job: 1.0 for job in jobs}
    pools = {r["metric"].get("pool") for r in prom.query(f'up{{job="{NS}/{monitoring.RELEASE}-engine"}}')}
    assert pools == {monitoring.POOL}


def test_every_dashboard_query_returns_plausible_data(loaded, stack):
    prom, seen = loaded
    board = dashboard()
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"]["query"]).group(1)
            assert prom.query(substitute(inner)), var["name"]
    checked = 0
    for panel in (p for p in board["panels"] if p["type"] != "row"):
        unit = panel["fieldConfig"]["defaults"]["unit"]
        for target in panel["targets"]:
            values = prom.values(substitute(target["expr"]))
            where = f"{panel['title']} / {target['legendFormat']}: {target['expr']}"
            assert values, f"no data: {where}"
            assert all(math.isfinite(v) and v >= 0 for v in values), f"{values}: {where}"
            if unit == "percentunit":
                assert all(v <= 1.0 for v in values), f"{values}: {where}"
            checked += 1
    assert checked >= 30

    def panel(title: str) -> dict[str, list[float]]:
        (p,) = [p for p in board["panels"] if p["title"] == title]
        return {t["legendFormat"]: prom.values(substitute(t["expr"])) for t in p["targets"]}

    hits = panel("Prefix cache hit rate (tokens)")
    assert hits["local"][0] > 0 and hits["external (cachestore)"][0] > 0, hits
    assert sum(panel("Preemptions")["{{pod}}"]) > 0, panel("Preemptions")
    hi = max(seen["ttft"])
    # each panel against the quantile of the histogram its process counted (the router's clock starts after the
    # client's connect and stops at the engine's first byte: on a busy machine it runs tens of ms short of the
    # client's, so the client's fastest request bounds nothing), and no process' TTFT beyond the client's slowest
    state = stack[1]
    for title, urls, name in (
        ("Time to first token through the router", [state["url"]], ROUTER_TTFT),
        ("Time to first token (engine)", state["engines"], ENGINE_TTFT),
    ):
        buckets = histogram_buckets(urls, name)
        for legend, (value,) in panel(title).items():
            expected = histogram_quantile(float(f"0.{legend[1:]}"), buckets)
            assert within_one_bucket(value, expected, expected, LATENCY_BUCKETS), (title, legend, value, expected)
            assert within_one_bucket(value, 0, hi, LATENCY_BUCKETS), (title, legend, value, hi)
    codes = {c: v for c, v in zip(*_labelled(prom, panel_expr(board, "Router answers by status")), strict=True)}
    assert {"200", "400", "404"} <= set(codes)
    # the engines' own prefill legs (behind the endpoint picker): every outcome from the start, none here (both engines)
    legs = prom.query(panel_expr(board, "Prefill legs run by decode engines"))
    assert {r["metric"].get("outcome") for r in legs} == set(LEG_OUTCOMES), legs
    assert all(float(r["value"][1]) == 0 for r in legs), legs


def histogram_buckets(urls: list[str], name: str) -> dict[float, float]:
    """One histogram summed by bucket over processes, read from their own /metrics."""
    total: dict[float, float] = {}
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name == name + "_bucket":
                    le = float(sample.labels["le"])
                    total[le] = total.get(le, 0.0) + sample.value
    return total


def panel_expr(board: dict, title: str) -> str:
    (p,) = [p for p in board["panels"] if p["title"] == title]
    return substitute(p["targets"][0]["expr"])


def _labelled(prom: Prometheus, expr: str) -> tuple[list[str], list[float]]:
    result = prom.query(expr)
    return [r["metric"].get("code", "") for r in result], [float(r["value"][1]) for r in result]


def signal(expr: str) -> str:
    """An alert's measured quantity: its expression before `or absent(...)` and the comparison."""
    left = expr.split(" or absent(")[0]
    return re.split(r"\s*(?:>|<|==|!=|>=|<=)\s*[0-9.]+\s*$", left)[0]


def test_every_alert_signal_returns_data_and_rules_evaluate(loaded, rules_file):
    prom, _ = loaded
    groups = yaml.safe_load(rules_file.read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        values = prom.values(signal(rule["expr"]))
        assert values and all(math.isfinite(v) for v in values), rule["alert"]
    assert prom.values(signal(_rule(groups, "RagserveNoHealthyEngines")["expr"])) == [2.0]
    assert prom.values(signal(_rule(groups, "RagserveCachestoreDown")["expr"])) == [1.0]
    assert all(0 <= v <= 1 for v in prom.values(signal(_rule(groups, "RagserveKVCacheUsageHigh")["expr"])))

    def evaluated() -> list[dict]:
        rules = httpx.get(prom.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [r for g in rules for r in g["rules"] if r.get("lastEvaluation", "").startswith("20")]

    until(lambda: len(evaluated()) == sum(len(g["rules"]) for g in groups), timeout=20, what="rules evaluated")
    for rule in evaluated():
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
        assert rule["state"] == "inactive", rule  # a healthy stack fires nothing


def _rule(groups: list[dict], name: str) -> dict:
    return next(r for g in groups for r in g["rules"] if r["alert"] == name)


def adapter_rules() -> list[dict]:
    text = (CHART / "README.md").read_text()
    block = re.search(r"```yaml\n(rules:\n.*?)```", text, re.S).group(1)
    return yaml.safe_load(block)["rules"]["custom"]


def test_adapter_rules_and_keda_queries_return_data(loaded):
    prom, _ = loaded
    rules = [r for r in adapter_rules() if not r["seriesQuery"].startswith(GPU_ONLY)]
    assert len(rules) >= 3
    for rule in rules:
        series = httpx.get(prom.url + "/api/v1/series", params={"match[]": rule["seriesQuery"]}, timeout=10)
        assert series.json()["data"], rule["seriesQuery"]
        name = rule["seriesQuery"].split("{")[0]
        expr = rule["metricsQuery"].replace("<<.Series>>", name)
        expr = expr.replace("<<.LabelMatchers>>", f'namespace="{NS}",pod=~".+"').replace("<<.GroupBy>>", "pod")
        values = prom.values(expr)
        assert values and all(math.isfinite(v) and v >= 0 for v in values), expr
    (scaled,) = [d for d in render(keda_values()) if d["kind"] == "ScaledObject"]
    triggers = scaled["spec"]["triggers"]
    assert len(triggers) == 3  # waiting requests, KV usage, queued prefill tokens
    for trigger in triggers:
        values = prom.values(trigger["metadata"]["query"])
        assert len(values) == 1 and math.isfinite(values[0]) and values[0] >= 0, trigger


def test_promtool_checks_the_generated_config(stack, tmp_path):
    up, state = stack
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps(monitoring.prometheus_config(monitoring.stack_targets(state))))
    out = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_without_prometheus_installed_up_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus binary here
    with pytest.raises(FileNotFoundError, match="prometheus is not installed .*apt-get install prometheus"):
        monitoring.prometheus_spec(tmp_path, 9090, [])
