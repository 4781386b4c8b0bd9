"""The router hop for short requests while the router also routes long prompts (RAG-sized), against smg and,
with --baseline-src, another tree's router (e.g. before tokenization left the event loop).

kv_aware tokenizes every prompt it routes. Each repeat starts every router afresh on 2 `ragserve sim-engine`s
(prefilling 2M tokens/s: no queue builds in them) and, for --seconds, sends long completions (a different
~--prompt-chars text each, 1 token) to the router at --long-rate while bench/router_scale.py's added-latency
step runs short requests at --rate (alternating router / direct; added = router p50 - direct p50, and p99).
Routers are interleaved; the table gives medians over --repeats. With --contexts N the long prompts are RAG chats
instead: a system message holding one of N ~--prompt-chars contexts (in turn), a short question of its own each.

    git archive 2c7e61c ragserve router | tar -x -C /tmp/base   # the tree before the change
    flock /tmp/cpu.lock .venv/bin/python bench/router_long_prompts.py --baseline-src /tmp/base:/tmp/base/router
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_procs  # noqa: E402
from report import medians, provenance, rotated, write  # noqa: E402
from router_scale import added_latency, warm_up  # noqa: E402
from scale_procs import MODEL, start_router  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "ragserve-kv_aware@baseline"
# sims that prefill a long prompt in ~1 ms: what is measured is the router, not a queue in the engines
scale_procs.SIM_COST = ("--prefill-tokens-per-s", "2000000", "--decode-base-s", "0.008", "--decode-seq-s", "0.0001")


def long_prompts(n: int, chars: int, seed: int = 0) -> list[str]:
    """n different texts of ~chars characters: windows of this project's docs, each behind its own number."""
    text = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    rng = random.Random(seed)
    return [f"Request {k}. " + text[(i := rng.randrange(len(text) - chars)) : i + chars] for k in range(n)]


def long_requests(n: int, chars: int, contexts: int) -> list[tuple[str, dict]]:
    """(path, body) of n long requests: different completions, or RAG chats over `contexts` contexts in turn."""
    if not contexts:
        return [("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 1}) for p in long_prompts(n, chars)]
    docs = long_prompts(contexts, chars)
    return [
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "system", "content": f"Answer from this context.\n\n{docs[k % contexts]}"},
            {"role": "user", "content": f"Question {k}: what does the context say?"},
        ]})
        for k in range(n)
    ]  # fmt: skip


async def long_load(router: str, requests: list[tuple[str, dict]], rate: float) -> list[float]:
    """The long requests, open loop at `rate`: their latencies through the router (failures left out)."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=500)) as http:

        async def one(k: int, request: tuple[str, dict]) -> float | None:
            await asyncio.sleep(k / rate)
            t0 = time.perf_counter()
            resp = await http.post(router + request[0], json=request[1])
            return time.perf_counter() - t0 if resp.status_code == 200 else None

        done = await asyncio.gather(*(one(k, r) for k, r in enumerate(requests)))
    return [x for x in done if x is not None]


async def step(router: str, engines: list[str], args) -> dict:
    prompts = long_requests(int(args.long_rate * args.seconds), args.prompt_chars, args.contexts)
    longs, short = await asyncio.gather(
        long_load(router, prompts, args.long_rate), added_latency(router, engines, args.rate, args.seconds)
    )
    short["long_ok"] = len(longs)
    short["long_p50_ms"] = 1000 * statistics.median(longs) if longs else None
    return short


def one(name: str, args, logs: Path) -> dict:
    src = args.baseline_src if name == BASELINE else None
    router, fleet, url, urls = start_router(name.split("@")[0], 2, args.model, 4096, logs, router_src=src)
    try:
        asyncio.run(warm_up(url, urls))
        cpu0 = router.cpu_s()
        row = asyncio.run(step(url, urls, args))
        row["router_cpu_s"] = router.cpu_s() - cpu0
        return row
    finally:
        router.stop()
        fleet.stop()


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [
        "# The hop while the router also routes long prompts",
        "",
        f"Command: `{report['command']}` at {report['commit']}, {report['date']}. 2 sims; short requests at "
        f"{a['rate']:g}/s (router and direct, alternating) while ~{a['prompt_chars']}-character prompts go to the "
        f"router at {a['long_rate']:g}/s, {a['seconds']:g} s"
        + (f" (RAG chats over {a['contexts']} contexts in turn)" if a.get("contexts") else " (each different)")
        + f"; median of {a['repeats']} interleaved repeats.",
        "",
        "| router | short: added p50 ms | added p99 ms | long prompts: p50 ms through the router | router CPU s "
        "| added p50 each repeat | errors |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['router']} | {r['added_p50_ms']:.2f} | {r['added_p99_ms']:.2f} | {r['long_p50_ms']:.1f} | "
            f"{r['router_cpu_s']:.2f} | {', '.join(f'{x:.2f}' for x in r['added_p50_each'])} | {r['errors']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=25.0)
    p.add_argument("--long-rate", type=float, default=10.0)
    p.add_argument("--prompt-chars", type=int, default=12000)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--contexts", type=int, default=0, help="long prompts as RAG chats over N contexts (0: all new)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--routers", type=lambda s: s.split(","), default=["ragserve-kv_aware", "smg-cache_aware"])
    p.add_argument("--baseline-src", default=None, help="PYTHONPATH entries of another tree, run as " + BASELINE)
    p.add_argument("--model", default=None, help="default: the tiny test model (its tokenizer)")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from tests.helpers.tiny_models import tiny_model

        args.model = str(tiny_model("llama"))
    names = list(dict.fromkeys([*args.routers, *([BASELINE] if args.baseline_src else [])]))
    logs = Path(tempfile.mkdtemp(prefix="ragserve-long-prompts-"))
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in rotated(names, rep):
            runs[name].append(one(name, args, logs))
            print(name, rep, json.dumps(runs[name][-1]), flush=True)
    rows = []
    for name, rs in runs.items():
        row = {"router": name, "errors": sum(r["errors"] for r in rs)}
        row |= medians(rs, ("added_p50_ms", "added_p99_ms", "long_p50_ms", "router_cpu_s"))
        row["added_p50_each"] = [r["added_p50_ms"] for r in rs]
        rows.append(row)
    keep = ("rate", "long_rate", "prompt_chars", "seconds", "repeats", "baseline_src", "contexts")
    report = {
        **provenance("router_long_prompts.py"),
        "args": {k: getattr(args, k) for k in keep},
        "rows": rows,
        "runs": runs,
    }
    write(args.out, "router_long_prompts" + (f"-{args.tag}" if args.tag else ""), report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
