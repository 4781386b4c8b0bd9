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


def per_request(counter: str) -> list[tuple[str, str]]:
    """A KV-transfer counter per request (ragserve:kv_transfer_requests), by direction; 0 without transfers."""
    out = []
    for d in m.KV_TRANSFER_DIRECTIONS:
        sel = f'{ENGINE}, {m.KV_TRANSFER_DIRECTION_LABEL}="{d}"'
        out.append((d, f"{rate(total(counter), sel)} / ({rate(total(m.KV_TRANSFER_REQUESTS), sel)} > 0) or vector(0)"))
    return out


def mean(histogram: str, sel: str = NS) -> str:
    """A histogram's mean over the rate window; 0 without observations."""
    return f"{rate(histogram + '_sum', sel)} / ({rate(histogram + '_count', sel)} > 0) or vector(0)"


def per_pod(metric: str, agg: str = "max") -> list[tuple[str, str]]:
    return [("{{pod}}", f"{agg} by (pod) ({metric}{{{ENGINE}}})")]


def quantiles(histogram: str, sel: str = ENGINE, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    return [(f"p{int(q * 100)}", quantile(q, histogram, sel)) for q in qs]


ROUTER = "ragserve_router_"
STORE = "ragserve_cachestore_"

# One row per concern; add a Panel to a row (or a row) and run this script. tests/observability/test_prometheus.py
# evaluates every query against a live stack and fails on one that returns nothing.
ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Latency",
        [
            Panel("Time to first token (engine)", quantiles(m.TIME_TO_FIRST_TOKEN), "s"),
            Panel("Inter-token latency", quantiles(m.INTER_TOKEN_LATENCY), "s"),
            Panel(
                "Time to first token through the router",
                quantiles(ROUTER + "time_to_first_token_seconds", NS, (0.5, 0.99)),
                "s",
                "Includes routing (tokenize, hash, index lookup) and proxying.",
            ),
            Panel("End-to-end request latency", quantiles(m.E2E_REQUEST_LATENCY, qs=(0.5, 0.99)), "s"),
            Panel("Queue time", quantiles(m.REQUEST_QUEUE_TIME, qs=(0.5, 0.99)), "s", "Arrival to first scheduling."),
            Panel("Routing time", quantiles(ROUTER + "routing_seconds", NS, (0.5, 0.99)), "s"),
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
                per_pod(m.KV_CACHE_USAGE),
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
            Panel(
                "Measured prefill speed",
                per_pod(m.PREFILL_TOKENS_PER_SECOND),
                "short",
                "Prompt tokens per second each engine measured (0 until it has prefilled); the router's cost model.",
            ),
            Panel("Measured decode step time", per_pod(m.DECODE_STEP_SECONDS), "s"),
            Panel("Queued prefill tokens", per_pod(m.QUEUED_PREFILL_TOKENS, "sum")),
            Panel("Cachestore fetch cost per block", per_pod(m.CACHESTORE_FETCH_SECONDS_PER_BLOCK), "s"),
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
                "Routing decisions",
                [("{{policy}} {{reason}}", rate(ROUTER + "routing_decisions_total", NS, "policy, reason"))],
                "ops",
                "Why the router picked an engine (prefix_hit, cost, imbalance_guard, ...).",
            ),
            Panel(
                "Predicted vs actual cached tokens",
                [
                    ("predicted", rate(ROUTER + "predicted_cached_tokens_total", NS)),
                    ("actual", rate(ROUTER + "actual_cached_tokens_total", NS)),
                    ("prompt", rate(ROUTER + "prompt_tokens_total", NS)),
                ],
                "short",
                "Tokens per second: what the router expected engines to find cached, what they reported.",
            ),
            Panel(
                "Predicted vs actual TTFT (kv_aware)",
                [
                    ("predicted p50", quantile(0.5, ROUTER + "predicted_ttft_seconds", NS)),
                    ("actual p50", quantile(0.5, ROUTER + "engine_ttft_seconds", NS)),
                ],
                "s",
                "The cost model's TTFT for the engine it chose, and the TTFT that engine then delivered.",
            ),
            Panel(
                "Prompt tokens: predicted split",
                [("{{source}}", rate(ROUTER + "predicted_prompt_tokens_total", NS, "source"))],
                "short",
                "Tokens per second kv_aware expected to be local hits, fetched from the cachestore, or computed.",
            ),
            Panel(
                "Prompt tokens engines fetched or computed",
                [("{{source}}", f"sum by (source) ({ROUTER}engine_prompt_tokens{{{NS}}})")],
                "short",
                "Cumulative, from the engines' heartbeats: compare with the predicted split.",
            ),
            Panel(
                "Blended prompt tokens by source",
                [
                    ("reused (KV stored before the request)", rate(total(m.BLEND_REUSED_TOKENS), ENGINE)),
                    ("chunks first computed now", rate(total(m.BLEND_COMPUTED_CHUNK_TOKENS), ENGINE)),
                    ("recomputed", rate(total(m.BLEND_RECOMPUTED_TOKENS), ENGINE)),
                ],
                "short",
                "Tokens per second of chats with chunks (docs/blend.md), each in one series: chunk tokens kept from KV"
                " that existed before the request (chunk store or cachestore), chunk tokens kept from chunks the"
                " request computed itself (not reuse), tokens the blended prefill computed.",
            ),
            Panel(
                "Routing accuracy",
                [
                    (
                        "cached / prompt tokens",
                        ratio(ROUTER + "actual_cached_tokens_total", ROUTER + "prompt_tokens_total", NS),
                    ),
                ],
                "percentunit",
                "Share of prompt tokens engines found cached (locally or fetched) on the engine the router picked.",
            ),
            Panel("Router answers by status", [("{{code}}", rate(ROUTER + "requests_total", NS, "code"))], "reqps"),
            Panel(
                "Engine answers by status",
                [("{{code}}", rate(total(m.ENGINE_REQUESTS), ENGINE, "code"))],
                "reqps",
                "499: the client (router) left first.",
            ),
            Panel(
                "Retries and migrations",
                [
                    ("retry {{reason}}", rate(ROUTER + "retries_total", NS, "reason")),
                    ("migration {{outcome}}", rate(ROUTER + "migrations_total", NS, "outcome")),
                ],
                "ops",
                "Retries before the first byte; broken answers resumed or resent on another engine.",
            ),
            Panel("Healthy engines", [("healthy", f"max (ragserve_router_engines_healthy{{{NS}}})")]),
            Panel(
                "Router queue depth by class",
                [("{{class}}", f"sum by (class) ({ROUTER}queue_depth{{{NS}}})")],
                "short",
                "Requests waiting for a place (--max-inflight-per-engine), critical first, fair between tenants.",
            ),
            Panel(
                "Shed and quota-limited requests",
                [
                    ("shed {{class}} {{reason}}", rate(ROUTER + "shed_total", NS, "class, reason")),
                    ("quota {{reason}}", rate(ROUTER + "quota_limited_total", NS, "reason")),
                ],
                "reqps",
                "429/503 of flow control: saturated, queue full or timed out; tenant token or concurrency quota.",
            ),
            Panel(
                "Circuit breakers",
                [("{{engine}}", f"max by (engine) ({ROUTER}breaker_state{{{NS}}})")],
                "short",
                "0 closed, 1 half-open (probing), 2 open (no traffic).",
            ),
        ],
    ),
    (
        "Disaggregated prefill/decode",
        [
            Panel(
                "KV transfer bytes per request",
                per_request(m.KV_TRANSFER_BYTES),
                "bytes",
                "KV block bytes a prefill engine put in the cachestore per prompt it computed for a decode engine"
                " (stored; offloads of `both` engines on the same model count too), and an engine fetched per request"
                " whose fetch brought blocks (fetched). 0: no transfer. docs/disaggregation.md.",
            ),
            Panel(
                "KV transfer time per request",
                per_request(m.KV_TRANSFER_SECONDS),
                "s",
                "Seconds in cachestore puts (the prefill engine's offload thread) and fetches (the decode engine's"
                " fetch thread) per request.",
            ),
            Panel(
                "Prefill queue / decode running",
                [
                    ("queued prefill tokens {{pod}}", f"sum by (pod) ({m.QUEUED_PREFILL_TOKENS}{{{ENGINE}}})"),
                    ("running {{pod}}", f"sum by (pod) ({m.NUM_REQUESTS_RUNNING}{{{ENGINE}}})"),
                ],
                "short",
                "Each side's autoscaling signal: prefill engines' queued prompt tokens, decode engines' running"
                " sequences.",
            ),
            Panel(
                "Prefill leg and decode-leg TTFT (mean)",
                [
                    ("prefill leg", mean(ROUTER + "disagg_prefill_seconds")),
                    ("decode-leg TTFT", mean(ROUTER + "disagg_decode_ttft_seconds")),
                    ("prefill leg (decode engine)", mean(m.DISAGG_PREFILL_SECONDS, ENGINE)),
                ],
                "s",
                "The router's split of a disaggregated request's TTFT: the prefill leg (until the KV is in the"
                " cachestore) and the rest (decode engine's fetch, last-token step, first byte); and the legs decode"
                " engines ran themselves behind the endpoint picker (those that worked). 0: no leg.",
            ),
            Panel(
                "Prefill legs run by decode engines",
                [("{{outcome}}", rate(total(m.DISAGG_PREFILL_LEGS), ENGINE, m.DISAGG_OUTCOME_LABEL))],
                "ops",
                "Behind the endpoint picker (x-prefiller-host-port, docs/gateway.md), by outcome: ok (the KV is in the"
                " cachestore), refused (4xx), failed (refused connection, 5xx, --prefiller-timeout: the decode"
                " engine computed the prompt), ignored (not in --prefiller-allow).",
            ),
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
                        f"sum by (tier) ({STORE}used_bytes{{{NS}}})"
                        f" / clamp_min(sum by (tier) ({STORE}capacity_bytes{{{NS}}}), 1)",
                    )
                ],
                "percentunit",
            ),
            Panel("Stored bytes by tier", [("{{tier}}", f"sum by (tier) ({STORE}used_bytes{{{NS}}})")], "bytes"),
            Panel(
                "Hits and misses by tier",
                [
                    ("hits {{tier}}", rate(STORE + "hits_total", NS, "tier")),
                    ("misses {{tier}}", rate(STORE + "misses_total", NS, "tier")),
                ],
                "ops",
            ),
            Panel(
                "Corruption and evictions",
                [
                    ("corrupt {{tier}}", rate(STORE + "corrupt_total", NS, "tier")),
                    ("evicted {{tier}}", rate(STORE + "evictions_total", NS, "tier")),
                    ("dropped", rate(STORE + "dropped_total", NS)),
                ],
                "ops",
                "Blocks that failed verification (deleted), demoted or dropped.",
            ),
            Panel(
                "Puts and lookups",
                [
                    ("puts", rate(STORE + "puts_total", NS)),
                    ("puts skipped", rate(STORE + "puts_skipped_total", NS)),
                    ("lookups", rate(STORE + "lookups_total", NS)),
                    ("blocks found", rate(STORE + "block_hits_total", NS)),
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
        "description": "ragserve: latency, load, KV cache, prefix hits, routing, answers, cachestore.",
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
