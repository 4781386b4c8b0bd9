"""Router scale benchmark on simulated engines (`ragserve sim-engine`), the same run for every router:

    ragserve-kv_aware, ragserve-round_robin   `ragserve router` (the sims register and stream KV events)
    smg-cache_aware                           `smg launch --policy cache_aware` (static --worker-urls)
    vllm-router-cache_aware                   `vllm-router --policy cache_aware` (static --worker-urls)

Per fleet size (--fleets, default 8,64,256 sims in one process) and router, a fresh fleet and router, then:
1. added latency at rising request rates (--rates, router requests/s, open loop): short completions (no full
   block, so no cache effect) alternate between the router and a sim directly; added = router - direct,
   p50 and p99. "Sustained" is the highest rate whose p99 added latency stays under 5 ms and whose requests all
   succeeded. The load generator is Python on the same 2 cores: at high rates it, not the router, may saturate.
2. routing quality: the RAG trace of bench/rag_cluster.py (demo corpus, Zipf documents, open loop at
   --rag-rate) and the multi-round chat of bench/multi_round_chat.py: prompt tokens served from cache
   (usage.cached_tokens), TTFT p50/p95, per-engine share of requests (max share x engines: 1.0 is even).
3. router CPU seconds per 1k requests (/proc), ragserve's decision latency (ragserve_router_routing_seconds).
Plus the index figures of bench/scale_index.py (in process).

    pip install smg==1.13.0 vllm-router==0.1.17   # benchmark only, not project dependencies
    flock /tmp/cpu.lock .venv/bin/python bench/router_scale.py [--fleets 8,64,256] [--tag TAG]

--real: the same per router on real `ragserve engine`s (SmolLM2-135M, one torch thread each), e.g.
    flock /tmp/cpu.lock .venv/bin/python bench/router_scale.py --real --fleets 2 --rates 2 --step-s 5 \
        --rag-requests 12 --rag-rate 0.5 --users 2 --rounds 2 --num-blocks 512
--engine-arg adds a flag to every real engine (e.g. --engine-arg=--long-prefill-token-threshold=256).
There a router name may end in +cachestore (e.g. ragserve-round_robin+cachestore): the engines share a
`ragserve cachestore`. --rates "" skips the added-latency steps; --repeats N runs every router N times,
interleaved, and the RAG quality table pools each router's requests (scale_quality.py), one row per request in
the JSON (engine and ragserve's route reason). --append adds a run's repeats to the same --tag's result file: a
run too long for one sitting split into parts (e.g. --repeats 1, then --repeats 1 --append).

--baseline-src DIR with e.g. --routers ragserve-kv_aware@baseline,ragserve-kv_aware: before / after a change,
the baseline's router from another tree (`git archive REV router | tar -x -C /tmp/base`, DIR /tmp/base/router).

Writes bench/results/router_scale[-real][-TAG].{json,md} (with the command line) and _added.png / _quality.png.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_round_chat import bench_client, make_users, routed_chat, run_chat, system_prompt  # noqa: E402
from rag_cluster import make_trace, percentile  # noqa: E402
from scale_chat import follow_ups, routing_during, scrape  # noqa: E402
from scale_index import index_figures  # noqa: E402
from scale_procs import MODEL, ROUTERS, SIM_COST, start_router  # noqa: E402
from scale_quality import summary_markdown  # noqa: E402

from ragserve.demo.client import ChatResult, rag_messages  # noqa: E402
from ragserve.demo.corpus import load_corpus  # noqa: E402
from ragserve.demo.retrieve import document_context  # noqa: E402
from tests.helpers.prom import histogram_quantile  # noqa: E402


async def timed_post(http: httpx.AsyncClient, url: str) -> float | None:
    t0 = time.perf_counter()
    try:
        resp = await http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    except httpx.HTTPError:
        return None
    return time.perf_counter() - t0 if resp.status_code == 200 else None


async def warm_up(router: str, engines: list[str]) -> None:
    """Two short requests per engine through the router and one direct, unmeasured: every connection the
    measured steps use is open (the first run without this had cold-connection p99s of 50-250 ms at 25 req/s)."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=2000)) as http:
        sem = asyncio.Semaphore(16)

        async def one(url: str) -> None:
            async with sem:
                await timed_post(http, url)

        await asyncio.gather(*(one(router) for _ in range(2 * len(engines))), *(one(u) for u in engines))


async def added_latency(router: str, engines: list[str], rate: float, seconds: float) -> dict:
    """Open loop at 2 x rate: arrivals alternate router / direct (engine k mod N)."""
    n = int(rate * seconds)
    lat: dict[str, list[float | None]] = {"router": [], "direct": []}
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=2000)) as http:

        async def one(path: str, url: str, at: float) -> None:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            lat[path].append(await timed_post(http, url))

        start = time.perf_counter() + 0.2
        tasks = []
        for k in range(n):
            at = start + k / rate
            tasks += [one("router", router, at), one("direct", engines[k % len(engines)], at + 0.5 / rate)]
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ok = {p: [v for v in vs if v is not None] for p, vs in lat.items()}
    p50 = {p: 1000 * percentile(v, 50) for p, v in ok.items()}
    p99 = {p: 1000 * percentile(v, 99) for p, v in ok.items()}
    return {
        "rate": rate,
        "requests": n,
        "errors": n - len(ok["router"]),
        "achieved_rps": len(ok["router"]) / wall,
        "added_p50_ms": p50["router"] - p50["direct"],
        "added_p99_ms": p99["router"] - p99["direct"],
        "router_p50_ms": p50["router"],
        "direct_p50_ms": p50["direct"],
    }


def summarize(results: list[ChatResult], first: list[bool]) -> dict:
    ok = [r for r in results if r.ok]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    later = [r for r, f in zip(results, first, strict=True) if r.ok and not f]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "cached_share": cached / max(prompt, 1),
        "cached_share_after_first": sum(r.cached_tokens for r in later) / max(sum(r.prompt_tokens for r in later), 1),
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p95_ms": 1000 * percentile(ttfts, 95),
    }


async def rag_quality(router: str, docs, trace, rate: float) -> dict:
    """The RAG trace, open loop; with one row per request (when sent, document, engine, the router's reason and
    predicted TTFT where it says them: ragserve's routers only)."""
    contexts = {d.id: document_context(d) for d in docs}
    async with bench_client() as http:

        async def one(k: int, r) -> tuple[ChatResult, dict]:
            await asyncio.sleep(k / rate)
            ctx = contexts[r.doc_id]
            body = {"model": MODEL, "messages": rag_messages(ctx.title, ctx.text, r.question), "max_tokens": 8}
            return await routed_chat(http, router, body, {"X-Context-Hash": ctx.hash})

        pairs = await asyncio.gather(*(one(k, r) for k, r in enumerate(trace)))
    results = [res for res, _ in pairs]
    rows = [
        {"sent_s": round(k / rate, 2), "doc": r.doc_id, "first": r.first, "engine": res.engine,
         "reason": route.get("reason", ""), "predicted_ttft_s": route.get("predicted_ttft_s"),
         "ttft_s": None if res.ttft_s is None else round(res.ttft_s, 3), "prompt_tokens": res.prompt_tokens,
         "cached_tokens": res.cached_tokens, "ok": res.ok}
        for k, (r, (res, route)) in enumerate(zip(trace, pairs, strict=True))
    ]  # fmt: skip
    return {**summarize(results, [r.first for r in trace]), "per_request": rows}


async def chat_quality(router: str, system: str, users) -> dict:
    turns = await run_chat(router, MODEL, system, users, 16)
    out = summarize([res for _, res in turns], [t.first for t, _ in turns])
    return {**out, "follow_ups": follow_ups(turns)}


def served(engines: list[str]) -> list[float]:
    return [sum(v for k, v in scrape(u).items() if k.startswith("vllm:request_success_total")) for u in engines]


def decision_latency(router: str) -> dict:
    """p50 / p99 of ragserve_router_routing_seconds (ms), interpolated in its buckets as Prometheus does."""
    buckets = {
        float(k.split('le="')[1].split('"')[0]): v
        for k, v in scrape(router).items()
        if k.startswith("ragserve_router_routing_seconds_bucket")
    }
    return {f"p{q}_ms": 1000 * histogram_quantile(q / 100, buckets) for q in (50, 99)}


def run_config(name: str, fleet_size: int, args, docs, trace, chat) -> dict:
    src = args.baseline_src if name.endswith("@baseline") else None
    router, fleet, url, urls = start_router(
        name.split("@")[0],
        fleet_size,
        args.model,
        args.num_blocks,
        args.logs,
        args.profile,
        args.real,
        src,
        engine_args=args.engine_arg,
    )
    try:
        asyncio.run(warm_up(url, urls))
        cpu0, before = router.cpu_s(), served(urls)
        steps = [asyncio.run(added_latency(url, urls, rate, args.step_s)) for rate in args.rates]
        before_rag = served(urls)
        rag = asyncio.run(rag_quality(url, docs, trace, args.rag_rate))
        rag["engine_requests"] = [b - a for a, b in zip(before_rag, served(urls), strict=True)]
        pre = scrape(url) if name.startswith("ragserve") else {}
        chats = asyncio.run(chat_quality(url, *chat))
        if pre:
            chats["routing"] = routing_during(pre, scrape(url))
        cpu = router.cpu_s() - cpu0
        counts = [b - a for a, b in zip(before, served(urls), strict=True)]
        total = sum(steps[i]["requests"] for i in range(len(steps))) + rag["requests"] + chats["requests"]
        share = max(counts) / max(sum(counts), 1) * len(urls)
        ok = [s["rate"] for s in steps if s["errors"] == 0 and s["added_p99_ms"] < 5.0]
        out = {
            "router": name,
            "engines": fleet_size,
            "steps": steps,
            "rag": rag,
            "chat": chats,
            "cpu_s_per_1k": 1000 * cpu / total,
            "max_share_x_engines": share,
            "engines_used": sum(1 for c in counts if c),
            "sustained_rps_p99_under_5ms": max(ok, default=0.0),
        }
        if name.startswith("ragserve"):
            out["decision"] = decision_latency(url)
            metrics = scrape(url)  # registration churn: engines dropped for missed heartbeats register again
            out["registrations"] = metrics.get("ragserve_router_registrations_total", 0.0)
            dropped = 'ragserve_router_engines_dropped_total{reason="heartbeat_timeout"}'
            out["heartbeat_drops"] = metrics.get(dropped, 0.0)
        return out
    finally:
        router.stop()
        fleet.stop()


def markdown(report: dict) -> str:
    real = " --real" in report["command"]
    lines = [
        "# Router scale on " + ("real engines" if real else "simulated engines"),
        "",
        f"Command: `{report['command']}`",
        *(f"Appended (more repeats, same trace): `{cmd}`" for cmd in report.get("appended", [])),
        "",
        f"Versions: {report['versions']}." + ("" if real else f" Sim cost: `{' '.join(SIM_COST)}`."),
        "",
        "| engines | router | sustained req/s (p99 added < 5 ms) | added p50 / p99 ms at each rate | "
        "decision p50 / p99 ms | CPU s / 1k req | RAG cached | RAG TTFT p50 / p95 ms | chat cached after 1st | "
        "max share x N | engines used | registrations |",
        "|---:|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        steps = ", ".join(f"{s['rate']:g}: {s['added_p50_ms']:.1f} / {s['added_p99_ms']:.1f}" for s in r["steps"])
        d = r.get("decision")
        dec = f"{d['p50_ms']:.2f} / {d['p99_ms']:.2f}" if d else "-"
        rag, chat = r["rag"], r["chat"]
        lines.append(
            f"| {r['engines']} | {r['router']} | {r['sustained_rps_p99_under_5ms']:g} | {steps} | {dec} | "
            f"{r['cpu_s_per_1k']:.1f} | {rag['cached_share']:.1%} | {rag['ttft_p50_ms']:.0f} / "
            f"{rag['ttft_p95_ms']:.0f} | {chat['cached_share_after_first']:.1%} | "
            f"{r['max_share_x_engines']:.2f} | {r['engines_used']} | {r.get('registrations', '-')} |"
        )
    lines += [f"| {f['engines']} | {f['router']} | failed: {f['error'][-200:]!r} |" for f in report["failed"]]
    routed = [r for r in report["results"] if "routing" in r["chat"]]
    if routed:
        lines += ["", "Chat phase, the router's metrics: decisions by reason; cached tokens predicted / reported."]
    for r in routed:
        c, f = r["chat"]["routing"], r["chat"]["follow_ups"]
        reasons = ", ".join(f"{k} {v:g}" for k, v in sorted(c["reasons"].items()))
        cached = ", ".join(f"{w} {a / max(b, 1):.1%}" for w, (a, b) in f["cached"].items())
        lines.append(
            f"- {r['engines']} {r['router']}: {reasons}; {c['predicted_cached_tokens']:,.0f} / "
            f"{c['actual_cached_tokens']:,.0f} of {c['prompt_tokens']:,.0f} prompt tokens; follow-ups on the "
            f"previous turn's engine {f['stayed']}, moved {f['moved']} ({f['moved_reasons']}); cached: {cached}"
        )
    ing = report["index"]["ingest"]
    lines += [
        "",
        f"Index (in process, MemoryState): {ing['events_per_s']:,.0f} KV events/s "
        f"({ing['hashes_per_s']:,.0f} block hashes/s, {ing['engines']} engines); "
        f"{ing['index_bytes'] / 2**20:.0f} MiB traced at {ing['blocks']:,} blocks "
        f"({ing['bytes_per_block']:.0f} B/block + the 65 B hash objects). match_exact p50: "
        + ", ".join(f"{m['engines']} engines {m['p50_ms']:.3f} ms" for m in report["index"]["match_exact"])
        + ".",
    ]
    if any(r["rag"].get("per_request") for r in report["results"]):
        lines += summary_markdown(report["results"])
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path, stem: str) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    routers = sorted({r["router"] for r in report["results"]})
    styles = dict(zip(sorted({r["engines"] for r in report["results"]}), ("-", "--", ":", "-."), strict=False))
    for r in report["results"]:
        color = f"C{routers.index(r['router'])}"
        ax.plot(
            [s["rate"] for s in r["steps"]],
            [max(s["added_p50_ms"], 0.1) for s in r["steps"]],
            marker="o",
            color=color,
            linestyle=styles[r["engines"]],
            label=f"{r['router']} x{r['engines']}",
        )
    ax.set_yscale("log")
    ax.set(xlabel="router requests/s (offered)", ylabel="added latency p50 (ms, log)", title="Router hop vs. load")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_added.png", dpi=120)
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [f"{r['router']}\nx{r['engines']}" for r in report["results"]]
    ax.bar(names, [r["rag"]["cached_share"] for r in report["results"]])
    ax.set(ylabel="RAG prompt tokens from cache", title="Routing quality")
    ax.tick_params(axis="x", labelsize=6)
    fig.tight_layout()
    fig.savefig(out / f"{stem}_quality.png", dpi=120)
    plt.close("all")


def save(report: dict, out: Path, stem: str) -> None:
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    plot(report, out, stem)


def installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # a run of ragserve's rows only needs no peer
        return "not installed"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fleets", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 256])
    p.add_argument("--routers", type=lambda s: s.split(","), default=list(ROUTERS))
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[25, 50, 100])
    p.add_argument("--step-s", type=float, default=3.0, help="seconds of load per rate step")
    p.add_argument("--rag-requests", type=int, default=120)
    p.add_argument("--rag-rate", type=float, default=20.0)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per sim (16 tokens each)")
    p.add_argument("--model", default=None, help="default: the tiny test model (its tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--real",
        action="store_true",
        help="real `ragserve engine`s (--model, default smollm2-135m) "
        "instead of sims: use with --fleets 2 and a small load",
    )
    p.add_argument(
        "--baseline-src",
        default=None,
        help="a `router/` directory of another tree (git archive REV router): ROUTER@baseline runs its router",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="with --real: a flag for every engine (repeatable), e.g. --engine-arg=--long-prefill-token-threshold=256",
    )
    p.add_argument("--profile", action="store_true", help="ragserve routers under cProfile (.prof in the logs)")
    p.add_argument("--replot", default=None, help="only redraw the plots of this result JSON")
    p.add_argument("--repeats", type=int, default=1, help="runs of every router, interleaved (router order each)")
    p.add_argument(
        "--append",
        action="store_true",
        help="add this run's repeats to the result file of the same --tag (a long run split into locked parts)",
    )
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    if args.replot:
        path = Path(args.replot)
        plot(json.loads(path.read_text()), path.parent, path.stem)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the fleet and router, not orphan them
    if args.model is None and args.real:
        args.model = "smollm2-135m"
    elif args.model is None:
        from tests.helpers.tiny_models import tiny_model

        args.model = str(tiny_model("llama"))
    args.logs = Path(tempfile.mkdtemp(prefix="ragserve-router-scale-"))
    print(f"process logs: {args.logs}", flush=True)
    docs = load_corpus()
    trace = make_trace(docs, args.rag_requests, 1.1, 4, args.seed)
    chat = (system_prompt(docs, 400, args.seed), make_users(docs, args.users, args.rounds, 600, 0.1, args.seed))
    versions = {k: installed(k) for k in ("smg", "vllm-router")}
    report = {
        "command": "python bench/router_scale.py " + " ".join(sys.argv[1:]),
        "versions": versions,
        "results": [],
        "failed": [],
        "index": index_figures(args.fleets),
    }
    out = Path(args.out)
    stem = "router_scale" + ("-real" if args.real else "") + (f"-{args.tag}" if args.tag else "")
    first = 0
    if args.append:  # the earlier part's rows, command and index figures stay; repeats go on numbering
        report = {**json.loads((out / f"{stem}.json").read_text()), "versions": versions}
        report.setdefault("appended", []).append("python bench/router_scale.py " + " ".join(sys.argv[1:]))
        first = 1 + max((r["repeat"] for r in report["results"]), default=-1)
    reps = range(first, first + args.repeats)
    runs = [(n, rep, name) for n in args.fleets for rep in reps for name in args.routers]
    for n, rep, name in runs:  # repeats interleaved: every router once, then again
        try:
            report["results"].append({**run_config(name, n, args, docs, trace, chat), "repeat": rep})
        except (SystemExit, Exception) as exc:  # one router failing to start must not lose the others' rows
            report["failed"].append({"router": name, "engines": n, "repeat": rep, "error": str(exc)[-1500:]})
            print(f"{name} x{n} failed: {exc}", flush=True)
            continue
        row = {k: v for k, v in report["results"][-1].items() if k != "steps"}
        row["rag"] = {k: v for k, v in row["rag"].items() if k != "per_request"}
        print(json.dumps(row), flush=True)
        save(report, out, stem)  # after every row: a run cut short keeps what it measured
    save(report, out, stem)
    print(markdown(report))
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
