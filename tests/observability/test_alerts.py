"""The chart's alerts unit-tested with `promtool test rules`: for each alert, series that fire it and series that
must not; `promtool check rules` on the rendered PrometheusRule."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from ragserve.stack import monitoring
from tests.observability.chart import monitoring_values, render

NS = monitoring.NAMESPACE
ENGINE = f'namespace="{NS}",pod="{monitoring.RELEASE}-engine-default-local-00000",model_name="tiny"'
ROUTER = f'namespace="{NS}",pod="{monitoring.RELEASE}-router-local-00000"'
CACHESTORE = f'namespace="{NS}",job="{monitoring.RELEASE}-cachestore-headless",pod="{monitoring.RELEASE}-cachestore-0"'


def labels(selector: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in selector.replace('"', "").split(","))


# alert -> (input series that fire it, labels it fires with), [input series that must not fire it]
CASES: dict[str, tuple[tuple[list[dict], dict], list[list[dict]]]] = {
    "RagserveKVCacheUsageHigh": (
        ([{"series": f"vllm:kv_cache_usage_perc{{{ENGINE}}}", "values": "0.95x30"}], {**labels(ENGINE)}),
        [
            [{"series": f"vllm:kv_cache_usage_perc{{{ENGINE}}}", "values": "0.5x30"}],
            [{"series": f"vllm:kv_cache_usage_perc{{{ENGINE}}}", "values": "0.95x2 0.5x28"}],  # a short spike
        ],
    ),
    "RagserveNoHealthyEngines": (
        ([{"series": f"ragserve_router_engines_healthy{{{ROUTER}}}", "values": "0x30"}], {}),
        [[{"series": f"ragserve_router_engines_healthy{{{ROUTER}}}", "values": "2x30"}]],
    ),
    "RagserveCachestoreDown": (
        ([{"series": f"up{{{CACHESTORE}}}", "values": "0x30"}], labels(CACHESTORE)),
        [[{"series": f"up{{{CACHESTORE}}}", "values": "1x30"}]],
    ),
}
# no series at all is an outage too; absent() keeps the selector's equality matchers as labels
ABSENT_FIRES = {
    "RagserveNoHealthyEngines": {"namespace": NS},
    "RagserveCachestoreDown": {"namespace": NS, "job": f"{monitoring.RELEASE}-cachestore-headless"},
}


@pytest.fixture(scope="module")
def rules(tmp_path_factory) -> tuple[Path, list[dict]]:
    (rule,) = [d for d in render(monitoring_values()) if d["kind"] == "PrometheusRule"]
    groups = rule["spec"]["groups"]
    path = tmp_path_factory.mktemp("rules") / "rules.yml"
    # annotations are templates for people; the tests are about when alerts fire and with which labels
    bare = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]} for g in groups]
    path.write_text(yaml.safe_dump({"groups": bare}))
    return path, [r for g in groups for r in g["rules"]]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_rules(rules):
    path, _ = rules
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_cases_both_ways(rules):
    _, rendered = rules
    assert {r["alert"] for r in rendered} == set(CASES)


def test_promtool_unit_tests_fire_and_hold(rules, tmp_path):
    path, rendered = rules
    tests = []
    for rule in rendered:
        name = rule["alert"]
        (fire, fire_labels), quiet = CASES[name]
        expected = [{"exp_labels": {**fire_labels, **rule["labels"]}}]
        at = "20m"  # after every rule's `for`
        tests.append({"interval": "1m", "input_series": fire, "alert_rule_test": [_eval(name, at, expected)]})
        for series in quiet:
            tests.append({"interval": "1m", "input_series": series, "alert_rule_test": [_eval(name, at, [])]})
        absent = [{"exp_labels": {**ABSENT_FIRES[name], **rule["labels"]}}] if name in ABSENT_FIRES else []
        tests.append({"interval": "1m", "input_series": [], "alert_rule_test": [_eval(name, at, absent)]})
    spec = tmp_path / "tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(path)], "evaluation_interval": "1m", "tests": tests}))
    out = promtool("test", "rules", str(spec))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def _eval(alert: str, at: str, expected: list[dict]) -> dict:
    return {"eval_time": at, "alertname": alert, "exp_alerts": expected}
