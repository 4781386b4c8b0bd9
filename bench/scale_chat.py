"""The chat phase of bench/router_scale.py, looked into: where each user's later turns went, and the router's own
account of a phase (ragserve's metrics)."""

from __future__ import annotations

import statistics

import httpx


def follow_ups(turns) -> dict:
    """Where each user's later turns went (the engine that answered, x-ragserve-engine; the peers send none): on
    the engine of the user's previous turn or elsewhere (with the router's reason), and the share of their prompt
    tokens served from cache either way."""
    last: dict[int, str] = {}
    out = {"stayed": 0, "moved": 0, "moved_reasons": {}, "cached": {"stayed": [0, 0], "moved": [0, 0]}}
    ttfts: dict[str, list[float]] = {"stayed": [], "moved": []}
    for turn, res in sorted(turns, key=lambda tr: (tr[0].user, tr[0].round)):
        prev, last[turn.user] = last.get(turn.user), res.engine
        if turn.first or not res.ok or not res.engine or not prev:
            continue
        where = "stayed" if res.engine == prev else "moved"
        out[where] += 1
        if where == "moved":
            reason = turn.route.get("reason", "")
            out["moved_reasons"][reason] = out["moved_reasons"].get(reason, 0) + 1
        out["cached"][where][0] += res.cached_tokens
        out["cached"][where][1] += res.prompt_tokens
        ttfts[where] += [res.ttft_s] if res.ttft_s is not None else []
    out["ttft_p50_ms"] = {w: 1000 * statistics.median(ts) if ts else None for w, ts in ttfts.items()}
    return out


def routing_during(before: dict[str, float], after: dict[str, float]) -> dict:
    """ragserve's own account of a phase (metrics difference): decisions by reason, and the cached tokens it
    predicted against those the engines reported (the index's view against the engines')."""

    def grown(prefix: str, label: str = "") -> dict[str, float]:
        out: dict[str, float] = {}
        for k, v in after.items():
            if k.startswith(prefix) and (d := v - before.get(k, 0.0)):
                name = k.split(f'{label}="')[1].split('"')[0] if label else ""
                out[name] = out.get(name, 0.0) + d
        return out

    return {
        "reasons": grown("ragserve_router_routing_decisions_total", "reason"),
        "predicted_cached_tokens": sum(grown("ragserve_router_predicted_cached_tokens_total").values()),
        "actual_cached_tokens": sum(grown("ragserve_router_actual_cached_tokens_total").values()),
        "prompt_tokens": sum(grown("ragserve_router_prompt_tokens_total").values()),
    }


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out
