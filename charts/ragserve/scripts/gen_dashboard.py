"""Generate files/dashboard.json, the chart's Grafana dashboard, from the panel list below.

python charts/ragserve/scripts/gen_dashboard.py          # rewrite the file
python charts/ragserve/scripts/gen_dashboard.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from generated import write_or_check  # this folder's (scripts run by path)

from ragserve import metric_names as m
from ragserve.metric_names import total

OUT = Path(__file__).resolve().parent.parent / "files" / "dashboard.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
ENGINE = f'namespace="$namespace", {m.MODEL_NAME_LABEL}=~"$model"'
NS = 'namespace="$namespace"'
RATE = "[$__rate_interval]"


def rate(metric: str, sel: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{sel}}}{RATE}))"


def quantile(q: float, histogram: str, sel: str = ENGINE) -> str:
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', sel, 'le')})"


def ratio(hits: str, queries: str, sel: str = ENGINE) -> str:
    return f"{rate(hits, sel)} / clamp_min({rate(queries, sel)}, 1)"


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (legend, PromQL)
    unit: str = "short"
    description: str = ""
    thresholds: list[float] = field(default_factory=list)


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Latency",
        [
            Panel(
                "Time to first token (engine)",
                [(f"p{int(q * 100)}", quantile(q, m.TIME_TO_FIRST_TOKEN)) for q in (0.5, 0.9, 0.99)],
                "s",
            ),
            Panel(
                "Inter-token latency",
                [(f"p{int(q * 100)}", quantile(q, m.INTER_TOKEN_LATENCY)) for q in (0.5, 0.9, 0.99)],
                "s",
            ),
            Panel(
                "Time to first token through the router",
                [
                    (f"p{int(q * 100)}", quantile(q, "ragserve_router_time_to_first_token_seconds", NS))
                    for q in (0.5, 0.99)
                ],
                "s",
                "Includes routing (tokenize, hash, index lookup) and proxying.",
            ),
            Panel(
                "End-to-end request latency",
                [(f"p{int(q * 100)}", quantile(q, m.E2E_REQUEST_LATENCY)) for q in (0.5, 0.99)],
                "s",
            ),
        ],
    ),
    (
        "Load",
        [
            Panel(
                "Requests running / waiting",
                [
                    ("running {{pod}}", f"sum by (pod) ({m.NUM_REQUESTS_RUNNING}{{{ENGINE}}})"),
                    ("waiting {{pod}}", f"sum by (pod) ({m.NUM_REQUESTS_WAITING}{{{ENGINE}}})"),
                ],
            ),
            Panel(
                "KV cache usage",
                # a pod's KV usage is its highest series (ragserve.prom_text), as the operator and router read it
                [("{{pod}}", f"max by (pod) ({m.KV_CACHE_USAGE}{{{ENGINE}}})")],
                "percentunit",
                "Above 85 % for 5 minutes raises RagserveKVCacheUsageHigh.",
                [0.85],
            ),
            Panel("Preemptions", [("{{pod}}", rate(total(m.NUM_PREEMPTIONS), ENGINE, "pod"))], "ops"),
            Panel(
                "Token throughput",
                [
                    ("prompt", rate(total(m.PROMPT_TOKENS), ENGINE)),
                    ("generation", rate(total(m.GENERATION_TOKENS), ENGINE)),
                ],
                "short",
                "Tokens per second, all engines.",
            ),
        ],
    ),
    (
        "Prefix cache and routing",
        [
            Panel(
                "Prefix cache hit rate (tokens)",
                [
                    ("local", ratio(total(m.PREFIX_CACHE_HITS), total(m.PREFIX_CACHE_QUERIES))),
                    (
                        "external (cachestore)",
                        ratio(total(m.EXTERNAL_PREFIX_CACHE_HITS), total(m.EXTERNAL_PREFIX_CACHE_QUERIES)),
                    ),
                ],
                "percentunit",
            ),
            Panel(
                "Routing accuracy",
                [
                    (
                        "actual / predicted",
                        ratio(*(f"ragserve_router_{k}_cached_tokens_total" for k in ("actual", "predicted")), NS),
                    ),
                    (
                        "cached / prompt tokens",
                        ratio("ragserve_router_actual_cached_tokens_total", "ragserve_router_prompt_tokens_total", NS),
                    ),
                ],
                "percentunit",
                "Cached tokens engines reported vs. what the router predicted when it picked them.",
            ),
            Panel(
                "Router requests",
                [
                    ("{{code}}", rate("ragserve_router_requests_total", NS, "code")),
                    ("retries", rate("ragserve_router_retries_total", NS)),
                ],
                "reqps",
            ),
            Panel("Healthy engines", [("healthy", f"max (ragserve_router_engines_healthy{{{NS}}})")]),
        ],
    ),
    (
        "Cachestore",
        [
            Panel(
                "Tier usage",
                [
                    (
                        "{{tier}}",
                        f"sum by (tier) (ragserve_cachestore_used_bytes{{{NS}}})"
                        f" / sum by (tier) (ragserve_cachestore_capacity_bytes{{{NS}}})",
                    )
                ],
                "percentunit",
            ),
            Panel(
                "Hits and misses by tier",
                [
                    ("hits {{tier}}", rate("ragserve_cachestore_hits_total", NS, "tier")),
                    ("misses {{tier}}", rate("ragserve_cachestore_misses_total", NS, "tier")),
                    ("corrupt {{tier}}", rate("ragserve_cachestore_corrupt_total", NS, "tier")),
                ],
                "ops",
            ),
        ],
    ),
]


def render_panel(panel: Panel, pid: int, x: int, y: int) -> dict:
    steps = [{"color": "green", "value": None}] + [{"color": "red", "value": t} for t in panel.thresholds]
    return {
        "id": pid,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                "thresholds": {"mode": "absolute", "steps": steps},
                "custom": {"thresholdsStyle": {"mode": "line" if panel.thresholds else "off"}},
            },
            "overrides": [],
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(panel.targets)
        ],
    }


def variable(name: str, query: str) -> dict:
    return {
        "name": name,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": name == "model",
        "allValue": ".*" if name == "model" else None,
        "multi": name == "model",
    }


def dashboard() -> dict:
    panels, pid, y = [], 1, 0
    for title, row in ROWS:
        panels.append(
            {"id": pid, "type": "row", "title": title, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
        )
        pid, y = pid + 1, y + 1
        for i, panel in enumerate(row):
            panels.append(render_panel(panel, pid, 12 * (i % 2), y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(row) + 1) // 2)
    datasource = {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}
    return {
        "uid": "ragserve-overview",
        "title": "ragserve",
        "description": "ragserve: latency, load, KV cache, prefix hits, routing accuracy, cachestore tiers.",
        "tags": ["ragserve", "llm", "vllm"],
        "editable": True,
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                datasource,
                variable("namespace", f"label_values({m.NUM_REQUESTS_RUNNING}, namespace)"),
                variable(
                    "model",
                    f'label_values({m.NUM_REQUESTS_RUNNING}{{namespace="$namespace"}}, {m.MODEL_NAME_LABEL})',
                ),
            ]
        },
        "panels": panels,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if files/dashboard.json is stale")
    text = json.dumps(dashboard(), indent=2) + "\n"
    return write_or_check(OUT, text, parser.parse_args().check, f"run python {Path(__file__).name}")


if __name__ == "__main__":
    sys.exit(main())
