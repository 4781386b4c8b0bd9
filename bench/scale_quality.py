"""Routing quality of bench/router_scale.py's rows, per router over its interleaved repeats: RAG TTFT percentiles
of every request pooled (enough samples that p95 is not the maximum), and the median of each repeat's figures."""

from __future__ import annotations

import statistics
from collections import Counter

from rag_cluster import percentile


def rag_summary(rows: list[dict]) -> list[dict]:
    """One dict per (router, engines), in first-run order, over its rows' RAG requests."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["router"], r["engines"]), []).append(r)
    out = []
    for (router, engines), runs in groups.items():
        reqs = [q for r in runs for q in r["rag"].get("per_request", [])]
        ttfts = [q["ttft_s"] for q in reqs if q["ok"] and q["ttft_s"] is not None]
        later = [q for q in reqs if q["ok"] and not q["first"]]
        out.append({
            "router": router, "engines": engines, "repeats": len(runs), "requests": len(reqs),
            "errors": sum(not q["ok"] for q in reqs),
            "cached_share": sum(q["cached_tokens"] for q in reqs) / max(sum(q["prompt_tokens"] for q in reqs), 1),
            "cached_share_after_first": sum(q["cached_tokens"] for q in later)
            / max(sum(q["prompt_tokens"] for q in later), 1),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95), "ttft_max_s": max(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts),
            "median_of_repeats_p50_s": statistics.median(r["rag"]["ttft_p50_ms"] / 1000 for r in runs),
            "median_of_repeats_p95_s": statistics.median(r["rag"]["ttft_p95_ms"] / 1000 for r in runs),
            "reasons": dict(Counter(q["reason"] for q in reqs if q["reason"])),
        })  # fmt: skip
    return out


def summary_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "RAG routing quality per router, every repeat's requests pooled (TTFT nearest-rank percentiles; the "
        "median of the repeats' own p50 / p95 beside them); reasons: ragserve's X-Ragserve-Route-Reason counts.",
        "",
        "| engines | router | repeats | RAG requests | errors | cached | cached after 1st | TTFT mean s | "
        "p50 s | p95 s | max s | median of repeats p50 / p95 s | reasons |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for s in rag_summary(rows):
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["reasons"].items())) or "-"
        lines.append(
            f"| {s['engines']} | {s['router']} | {s['repeats']} | {s['requests']} | {s['errors']} | "
            f"{s['cached_share']:.1%} | {s['cached_share_after_first']:.1%} | {s['ttft_mean_s']:.2f} | "
            f"{s['ttft_p50_s']:.2f} | {s['ttft_p95_s']:.2f} | {s['ttft_max_s']:.2f} | "
            f"{s['median_of_repeats_p50_s']:.2f} / {s['median_of_repeats_p95_s']:.2f} | {reasons} |"
        )
    return lines
