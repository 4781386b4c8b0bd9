"""CacheBlend through the router: TTFT of reordered documents on 2 engines and a cachestore (docs/blend.md).

One `ragserve up`-style stack (kv_aware router, 2 engines, cachestore). Each timed request is a new combination
and order of 3-6 demo-corpus passages of 200-500 tokens, sent three ways through the router: full prefill (a
fresh cache_salt: no prefix hits), prefix caching alone (plain chat), and blended (the passages marked as
chunks). Warm-up requests first send every passage through the router, in threes, both ways.

Phase "router": both engines up; the router keys chunked chats by their chunk set, so they go to the engine
holding most of the chunks (warm-up spread them over both engines: the others come from the cachestore).
Phase "fetch": engine A (which served most blended requests) is stopped, so the router sends everything to
engine B, which fetches the chunks A computed from the cachestore.
TTFT is the time to a one-token answer (max_tokens 1) as the client sees it; the cachestore's served
records are counted around each request (all means are per request).

    .venv/bin/python bench/blend_cluster.py [--requests 8] [--out bench/results/blend-cluster]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

from ragserve.model_source import load_tokenizer, resolve_model
from ragserve.stack.config import StackConfig
from ragserve.stack.process import LogSink
from ragserve.stack.supervisor import Stack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blend import corpus_docs, rag_messages  # noqa: E402  (bench/ is not a package)
from rag_cluster import scrape  # noqa: E402

MODES = ("full_prefill", "prefix_caching", "blend")
QUESTION = "Summarize what the documents say, in one sentence."


def store_hits(store: str) -> float:
    return scrape(store).get("ragserve_cachestore_hits_total", 0.0) if store else 0.0


def ask(url: str, model: str, texts: list[str], mode: str, store: str = "") -> dict:
    body = {"model": model, "messages": rag_messages(texts, QUESTION, chunks=mode == "blend"), "max_tokens": 1}
    if mode == "full_prefill":
        body["cache_salt"] = uuid.uuid4().hex
    hits, t0 = store_hits(store), time.perf_counter()
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    resp.raise_for_status()
    hits = store_hits(store) - hits  # cachestore records served during the request (chunks or prefix blocks)
    details = resp.json()["usage"].get("prompt_tokens_details") or {}
    return {
        "mode": mode, "ttft_s": seconds, "engine": resp.headers.get("x-ragserve-engine", ""),
        "prompt_tokens": resp.json()["usage"]["prompt_tokens"], "cached_tokens": details.get("cached_tokens", 0),
        "blend_reused_tokens": details.get("blend_reused_tokens", 0), "store_records": hits,
    }  # fmt: skip


def timed(url: str, model: str, pool: list[str], requests: int, rng: random.Random, store: str) -> list[dict]:
    rows = []
    for _ in range(requests):
        texts = rng.sample(pool, rng.randint(3, 6))
        rows += [ask(url, model, texts, mode, store) for mode in MODES]
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        ttft = [r["ttft_s"] for r in mine]
        out[mode] = {
            "median_s": statistics.median(ttft), "mean_s": statistics.fmean(ttft),
            "engines": {e: sum(r["engine"] == e for r in mine) for e in sorted({r["engine"] for r in mine})},
            "blend_reused_tokens_mean": statistics.fmean(r["blend_reused_tokens"] for r in mine),
            "cached_tokens_mean": statistics.fmean(r["cached_tokens"] for r in mine),
            "store_records_mean": statistics.fmean(r["store_records"] for r in mine),
        }  # fmt: skip
    out["prompt_tokens_mean"] = statistics.fmean(r["prompt_tokens"] for r in rows)
    return out


def run(args) -> dict:
    flags = ["--num-gpu-blocks", "2048", "--max-num-batched-tokens", "4096", "--enforce-eager"]
    cfg = StackConfig(engines=2, model=args.model, port=0, policy="kv_aware", redis="off", cachestore=True,
                      engine_flags=flags, log_level="warning", embedding_engines=0)  # fmt: skip
    tok = load_tokenizer(resolve_model(args.model))
    pool = [t for texts in corpus_docs(tok).values() for t in texts[:1]][:9]
    rng, result = random.Random(7), {"model": args.model, "requests": args.requests, "pool": len(pool)}
    with Stack(cfg, LogSink(show=args.verbose)) as stack:
        model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for i in range(0, len(pool), 3):  # warm-up: every passage stored as a chunk and prefix-cached
            for mode in ("blend", "prefix_caching"):
                ask(stack.url, model, pool[i : i + 3], mode)
        store = f"http://127.0.0.1:{stack.ports.cachestore_metrics}/metrics"
        rows = timed(stack.url, model, pool, args.requests, rng, store)
        result["router"] = summary(rows) | {"rows": rows}
        print(json.dumps({k: v for k, v in result["router"].items() if k != "rows"}, indent=1), flush=True)
        blends = [r["engine"] for r in rows if r["mode"] == "blend"]
        a_name = max(set(blends), key=blends.count)  # the engine that served most blended requests
        a = stack.child(a_name)  # engine ids are the stack's child names
        a.proc.terminate()
        a.proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while httpx.get(stack.url + "/ready", timeout=5).json().get("engines") != 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        rows = timed(stack.url, model, pool, args.requests, random.Random(8), store)
        result["fetch"] = summary(rows) | {"rows": rows, "stopped": a_name}
        print(json.dumps({k: v for k, v in result["fetch"].items() if k != "rows"}, indent=1), flush=True)
    return result


def render(result: dict) -> str:
    lines = [f"# CacheBlend through the router: 2 engines + cachestore, {result['model']} (bench/blend_cluster.py)"]
    for phase, title in (("router", "both engines up"), ("fetch", "engine A stopped: B fetches A's chunks")):
        r = result.get(phase)
        if not r:
            continue
        lines += ["", f"## {title} ({result['requests']} requests per mode, {r['prompt_tokens_mean']:.0f} prompt "
                  "tokens on average)", "",
                  "| mode | median TTFT (s) | mean TTFT (s) | speed-up vs prefix caching | engines "
                  "| blend-reused / prefix-cached tokens | cachestore records fetched |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        base = r["prefix_caching"]["median_s"]
        for mode in MODES:
            m = r[mode]
            reuse = f"{m['blend_reused_tokens_mean']:.0f} / {m['cached_tokens_mean']:.0f}"
            lines.append(f"| {mode} | {m['median_s']:.3f} | {m['mean_s']:.3f} | {base / m['median_s']:.2f}x | "
                         f"{m['engines']} | {reuse} | {m['store_records_mean']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=8, help="timed requests per mode and phase")
    parser.add_argument("--out", default="bench/results/blend-cluster")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    result = run(args)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out + ".md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
