"""Cluster benchmark: a scenario through the full local stack (N engines), per configuration:

    round_robin             router rotates, engines alone (no cachestore)
    prefix                  consistent hashing on X-Context-Hash, no cachestore
    kv_aware                the cost model (cached, queued and decode work per engine), no cachestore
    kv_aware+cachestore     the same, store-aware: engines fetch blocks peers computed from the cachestore
    kv_aware+external       kv_aware with the engines external, as unmodified vLLM pods look to the router: no
                            registration, vLLM KV events over ZMQ, followed with --external-engine (StackConfig's
                            external_engines); no cachestore
    kv_aware+cachestore+external  the same, the engines sharing a cachestore the router does not know of (a vLLM
                            pod with an LMCache-like store of its own)

The default runs the first four. A config `X+external` is also compared with `X` (its registered twin) when both
run: external / registered for TTFT, cached-token share and the router's prefix-hit share.

Scenarios (--scenario):
    rag    the demo corpus (11 documents of 1.3-2.8k tokens), document popularity Zipf(s), several
           questions per document, N requests from C concurrent clients (closed loop), streamed.
    chat   multi-round chat (bench/multi_round_chat.py): users joining over time share a system prompt,
           each with a history of its own that grows every round (--users, --rounds, --system-tokens,
           --history-tokens, --answer-tokens, --join-interval).

Every configuration starts a fresh stack (`ragserve.stack`), warms each engine with an unrelated prompt,
has it compile its decode graphs for every batch size up to the workload's concurrency (and waits until
none is compiling; not with --enforce-eager), then runs the same workload. Per configuration, from the engines' /metrics
(differences over the run): prompt tokens computed, served from the local prefix cache, and fetched from the cachestore
(`vllm:external_prefix_cache_hits`; while the engine does not export it, the cachestore's own
`ragserve_cachestore_hits_total` x block size); from the clients: TTFT mean/p50/p95 and end-to-end
latency through the router, throughput, the share of prompt tokens served from cache after a
document's (a user's) first request (usage.prompt_tokens_details.cached_tokens), each engine's share of
requests and prompt tokens; and ratios to round_robin in the same run.

    .venv/bin/python bench/rag_cluster.py [--scenario rag|chat] [--engines N] [--quick] [--out bench/results]

--quick: tiny random model, short workload (the test suite runs it). Default: SmolLM2-135M.
--repeats R runs every configuration R times, interleaved (ABBA: the order reversed every other round), and
reports each figure's median over the repeats (the per-repeat values of the headline figures alongside).
Writes rag_cluster[-chat][-quick][-TAG].md / .json and PNG plots (matplotlib) into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import httpx

from ragserve.demo.client import ChatResult, rag_messages
from ragserve.demo.corpus import Document, load_corpus
from ragserve.demo.retrieve import document_context
from ragserve.stack.config import StackConfig
from ragserve.stack.process import LogSink
from ragserve.stack.spec import engine_threads
from ragserve.stack.supervisor import Stack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_round_chat import bench_client, make_users, routed_chat, run_chat, system_prompt  # noqa: E402  (bench/ is not a package)


@dataclass(frozen=True)
class Config:
    policy: str  # the router's
    cachestore: bool = False
    external: bool = False  # engines pose as vLLM pods (StackConfig.external_engines)

    @property
    def engines_label(self) -> str:
        return "external (vLLM KV events)" if self.external else "registered"

    @property
    def cachestore_label(self) -> str:
        if not self.cachestore:
            return "none"
        return "engines' only (router unaware)" if self.external else "registered (store-aware routing)"


CONFIGS = {
    "round_robin": Config("round_robin"),
    "prefix": Config("prefix"),
    "kv_aware": Config("kv_aware"),
    "kv_aware+cachestore": Config("kv_aware", cachestore=True),
    "kv_aware+external": Config("kv_aware", external=True),
    "kv_aware+cachestore+external": Config("kv_aware", cachestore=True, external=True),
}
DEFAULT_CONFIGS = ["round_robin", "prefix", "kv_aware", "kv_aware+cachestore"]
BASELINE = "round_robin"  # ratios are against it; without it in --configs, against the first config
EXTERNAL = "+external"
HEADLINE = ("ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "latency_mean_s", "cached_share_after_first",
            "prefix_hit_share")  # fmt: skip


@dataclass
class TraceRequest:
    index: int
    doc_id: str
    question: str
    first: bool  # first request of its document in the trace
    start_s: float = 0.0  # perf_counter when sent (set on a copy per run)
    route: dict = field(default_factory=dict)  # router's reason and predicted TTFT (set on the copy)


@dataclass
class ConfigResult:
    name: str
    engines: str  # registered | external (Config.engines_label)
    cachestore: str  # none | registered | engines' only (Config.cachestore_label)
    requests: int
    errors: int
    prompt_tokens: int  # engine metrics
    local: int
    fetched: int
    computed: int
    fetched_source: str
    usage_prompt_tokens: int  # the same, from the responses' usage (a cross-check)
    usage_cached_tokens: int
    cached_share_after_first: float  # from usage, requests whose document was seen before
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p95_after_first_s: float  # requests whose document was seen before
    wall_s: float
    requests_per_s: float
    prompt_tokens_per_s: float
    ttft_mean_s: float = 0.0
    latency_mean_s: float = 0.0  # end to end, through the router
    latency_p50_s: float = 0.0
    latency_p95_s: float = 0.0
    output_tokens_per_s: float = 0.0
    engine_shares: dict = field(default_factory=dict)  # engine -> {"requests": share, "prompt_tokens": share}
    min_request_share: float = 0.0
    ratios: dict = field(default_factory=dict)
    preemptions: int = 0  # engines' vllm:num_preemptions over the run
    fetches_abandoned: int = 0  # engines' ragserve:cachestore_fetches_abandoned over the run (they recomputed)
    blocks_not_imported: int = 0  # fetched blocks the engines had no free KV block for (recomputed)
    offload_dropped: int = 0  # blocks the engines never offloaded (offload queue full): peers cannot fetch them
    first_sight: int = 0  # requests whose document (user history) no engine had seen: cold under every policy
    prediction_error_p50_s: float | None = None  # kv_aware: median |predicted - actual TTFT| (actual via router)
    cached_share: float = 0.0  # usage: cached / prompt tokens over every request
    prefix_hit_share: float = 0.0  # requests the router sent with reason prefix_hit (kv_aware)
    router_predicted_cached: int = 0  # the router's predicted cached tokens, over the run (its metrics) ...
    router_actual_cached: int = 0  # ... and what the engines then reported
    router_kv_stored: int = 0  # BlockStored ops the router's index applied over the run
    repeats: int = 1
    repeat_values: dict = field(default_factory=dict)  # HEADLINE figure -> its value per repeat (run order)
    vs_registered: dict = field(default_factory=dict)  # X+external: external / registered twin X
    per_request: list = field(default_factory=list)  # one record per request, in send order (see request_rows)


def make_trace(docs: list[Document], n: int, zipf_s: float, per_doc: int, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    order = docs[:]
    rng.shuffle(order)  # which documents are popular
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(order))]
    questions = {}
    for d in order:
        picks = rng.sample(d.passages, min(per_doc, len(d.passages)))
        questions[d.id] = [f"What does the part starting '{' '.join(p.text.split()[:8])}' say?" for p in picks]
    seen: set[str] = set()
    trace = []
    for i in range(n):
        doc = rng.choices(order, weights)[0]
        trace.append(TraceRequest(i, doc.id, rng.choice(questions[doc.id]), doc.id not in seen))
        seen.add(doc.id)
    return trace


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum over label sets}."""
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def engine_totals(stack: Stack) -> dict[str, float]:
    """The engines' metrics summed, the cachestore's hits and the router's accuracy counters ("router:...")."""
    totals: dict[str, float] = {"router:" + k: v for k, v in router_totals(stack).items()}
    for url in stack.engine_urls:
        for k, v in scrape(url + "/metrics").items():
            totals[k] = totals.get(k, 0.0) + v
    if stack.cfg.cachestore:
        port = stack.ports.cachestore_metrics
        totals["cachestore_get_hits"] = scrape(f"http://127.0.0.1:{port}/metrics").get(
            "ragserve_cachestore_hits_total", 0.0
        )
    return totals


async def run_trace(stack: Stack, model: str, trace, docs, clients: int, max_tokens: int):
    contexts = {d.id: document_context(d) for d in docs}
    queue: asyncio.Queue = asyncio.Queue()
    for r in trace:
        queue.put_nowait(r)
    results: list[tuple[TraceRequest, ChatResult]] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            r = queue.get_nowait()
            ctx = contexts[r.doc_id]
            body = {"model": model, "messages": rag_messages(ctx.title, ctx.text, r.question)}
            body.update(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            sent = replace(r, start_s=time.perf_counter())
            result, sent.route = await routed_chat(http, stack.url, body, {"X-Context-Hash": ctx.hash})
            results.append((sent, result))

    async with bench_client() as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return results


def warm_up(stack: Stack, model: str) -> None:
    """Load lazy kernels on every engine with a prompt no trace request shares."""
    for url in stack.engine_urls:
        resp = httpx.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 2}, timeout=300
        )
        resp.raise_for_status()


def compile_decode_graphs(stack: Stack, model: str, concurrency: int, timeout_s: float = 1800) -> float:
    """Make every engine compile the decode graphs the workload will use before anything is timed: on each
    engine `concurrency` requests finishing one after another decode at every batch size up to it; then
    wait until no engine has a graph compiling (ragserve:decode_graphs_pending). Otherwise a config's first
    minutes would share the CPU with inductor (and the first config would pay the cold compile cache)."""
    t0 = time.perf_counter()

    async def drive(http: httpx.AsyncClient, url: str) -> None:
        bodies = [
            {"model": model, "prompt": f"Compile warm-up {k}: count slowly.", "max_tokens": 8 * (k + 1),
             "ignore_eos": True, "temperature": 0.0}
            for k in range(concurrency)
        ]  # fmt: skip
        resps = await asyncio.gather(*(http.post(f"{url}/v1/completions", json=b, timeout=600) for b in bodies))
        for r in resps:
            r.raise_for_status()

    async def all_engines() -> None:
        async with httpx.AsyncClient() as http:
            await asyncio.gather(*(drive(http, url) for url in stack.engine_urls))

    asyncio.run(all_engines())
    while any(scrape(url + "/metrics").get("ragserve:decode_graphs_pending", 0) for url in stack.engine_urls):
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"decode graphs still compiling after {timeout_s:.0f} s")
        time.sleep(1.0)
    return time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)] if s else float("nan")


def run_workload(stack: Stack, model: str, args, docs, trace):
    if args.scenario == "chat":
        return asyncio.run(run_chat(stack.url, model, trace[0], trace[1], args.answer_tokens))
    return asyncio.run(run_trace(stack, model, trace, docs, args.clients, args.max_tokens))


def router_totals(stack: Stack) -> dict[str, float]:
    """The router's routing-accuracy counters: predicted vs reported cached tokens, KV-index ops applied."""
    m = scrape(stack.url + "/metrics")
    names = ("predicted_cached_tokens_total", "actual_cached_tokens_total")
    out = {n: m.get("ragserve_router_" + n, 0.0) for n in names}
    out["kv_stored"] = kv_events_stored(stack.url)
    return out


def kv_events_stored(url: str) -> float:
    """ragserve_router_kv_events_total{kind="stored"} (scrape() sums over the kinds)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ragserve_router_kv_events_total{") and 'kind="stored"' in line:
            return float(line.rpartition(" ")[2])
    return 0.0


def run_config(name: str, args, docs, trace) -> ConfigResult:
    conf = CONFIGS[name]
    policy, cachestore = conf.policy, conf.cachestore
    engine_flags = ["--max-model-len", str(args.max_model_len), "--num-gpu-blocks", str(args.num_gpu_blocks)]
    engine_flags += ["--block-size", str(args.block_size), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    engine_flags += ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
    engine_flags += ["--enforce-eager"] if args.enforce_eager else []
    cfg = StackConfig(
        engines=args.engines, model=args.model, served_model_name=args.served_model_name, port=0, policy=policy,
        redis="off", cachestore=cachestore, cachestore_memory=4 * 1024**3, engine_flags=engine_flags,
        log_level="warning", engine_threads=args.engine_threads, external_engines=conf.external,
        embedding_engines=0,  # generation only: no embedding engine beside the measured ones
    )  # fmt: skip
    print(f"[{name}] starting {args.engines} {conf.engines_label} engines ({args.model}), policy {policy}, "
          f"cachestore {conf.cachestore_label}")  # fmt: skip
    with Stack(cfg, LogSink(show=args.verbose)) as stack:
        model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        warm_up(stack, model)
        concurrency = args.users if args.scenario == "chat" else args.clients
        if not args.enforce_eager:
            compile_s = compile_decode_graphs(stack, model, concurrency)
            print(f"[{name}] decode graphs up to batch {concurrency} compiled in {compile_s:.0f} s")
        before = engine_totals(stack)
        t0 = time.perf_counter()
        results = run_workload(stack, model, args, docs, trace)
        wall = time.perf_counter() - t0
        time.sleep(0.5)  # let offload counters settle
        after = engine_totals(stack)
    result = summarize(name, conf, results, before, after, wall, args.block_size, engine_ids(conf, args.engines))
    print(
        f"[{name}] {result.requests} requests in {wall:.0f}s, {result.errors} errors; "
        f"{100 * result.cached_share_after_first:.0f}% of prompt tokens from cache after 1st sight; "
        f"TTFT mean {result.ttft_mean_s:.2f}s p50 {result.ttft_p50_s:.2f}s p95 {result.ttft_p95_s:.2f}s; "
        f"latency mean {result.latency_mean_s:.2f}s; shares {result.engine_shares}"
    )
    return result


def engine_ids(conf: Config, n: int) -> list[str]:
    """What the router calls the engines: their registered ids (ragserve.stack.spec.engine_spec's), or
    external-0.. in --external-engine order."""
    return [f"{'external' if conf.external else 'engine'}-{i}" for i in range(n)]


def summarize(name, conf: Config, results, before, after, wall, block_size, engines: list[str]) -> ConfigResult:
    def delta(metric: str) -> int:
        return int(after.get(metric, 0) - before.get(metric, 0))

    prompt, hits = delta("vllm:prompt_tokens_total"), delta("vllm:prefix_cache_hits_total")
    fetched, source = delta("vllm:external_prefix_cache_hits_total"), "engine vllm:external_prefix_cache_hits"
    if fetched == 0 and "cachestore_get_hits" in after:
        fetched, source = delta("cachestore_get_hits") * block_size, "cachestore Get hits x block size"
    usage_cached = sum(res.cached_tokens for _, res in results if res.ok)
    # fetched blocks are admitted as cache hits; count them once whether or not prefix_cache_hits includes them
    local = hits if abs(usage_cached - hits - fetched) < abs(usage_cached - hits) else max(0, hits - fetched)
    ok = [(r, res) for r, res in results if res.ok]
    later = [res for r, res in ok if not r.first]
    later_prompt = sum(res.prompt_tokens for res in later)
    ttfts = [res.ttft_s for _, res in ok if res.ttft_s is not None]
    later_ttfts = [res.ttft_s for res in later if res.ttft_s is not None]
    latencies = [res.latency_s for _, res in ok]
    shares = engine_shares([res for _, res in ok], engines)
    result = ConfigResult(
        name=name, engines=conf.engines_label, cachestore=conf.cachestore_label, requests=len(results),
        errors=len(results) - len(ok), prompt_tokens=prompt,
        local=local, fetched=fetched, computed=prompt - local - fetched, fetched_source=source if fetched else "",
        usage_prompt_tokens=sum(res.prompt_tokens for _, res in ok), usage_cached_tokens=usage_cached,
        cached_share_after_first=sum(res.cached_tokens for res in later) / later_prompt if later_prompt else 0.0,
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
        ttft_p95_after_first_s=percentile(later_ttfts, 95), wall_s=wall,
        requests_per_s=len(ok) / wall, prompt_tokens_per_s=sum(res.prompt_tokens for _, res in ok) / wall,
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        latency_mean_s=sum(latencies) / len(latencies) if latencies else float("nan"),
        latency_p50_s=percentile(latencies, 50), latency_p95_s=percentile(latencies, 95),
        output_tokens_per_s=sum(res.completion_tokens for _, res in ok) / wall, engine_shares=shares,
        min_request_share=min((v["requests"] for v in shares.values()), default=0.0),
        preemptions=delta("vllm:num_preemptions"), per_request=request_rows(results),
        fetches_abandoned=delta("ragserve:cachestore_fetches_abandoned_total"),
        blocks_not_imported=delta("ragserve:cachestore_blocks_not_imported_total"),
        offload_dropped=delta("ragserve:cachestore_offload_dropped_blocks_total"),
        first_sight=sum(1 for r, _ in results if r.first), prediction_error_p50_s=prediction_error(ok),
        cached_share=usage_cached / max(1, sum(res.prompt_tokens for _, res in ok)),
        prefix_hit_share=sum(r.route.get("reason") == "prefix_hit" for r, _ in ok) / max(1, len(ok)),
        router_predicted_cached=delta("router:predicted_cached_tokens_total"),
        router_actual_cached=delta("router:actual_cached_tokens_total"), router_kv_stored=delta("router:kv_stored"),
    )  # fmt: skip
    return result


def prediction_error(ok) -> float | None:
    errors = [abs(r.route["predicted_ttft_s"] - res.ttft_s) for r, res in ok
              if r.route.get("predicted_ttft_s") is not None and res.ttft_s is not None]  # fmt: skip
    return percentile(errors, 50) if errors else None


def request_rows(results) -> list[dict]:
    """Per request, in send order: when it was sent (s after the first), what it was, where it went, how it went."""
    t0 = min((r.start_s for r, _ in results), default=0.0)
    rows = []
    for r, res in sorted(results, key=lambda pair: pair[0].start_s):
        what = {"user": r.user, "round": r.round} if hasattr(r, "user") else {"doc": r.doc_id}
        rows.append({
            "sent_s": round(r.start_s - t0, 3), **what, "first": r.first, "engine": res.engine,
            "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
            "ttft_s": None if res.ttft_s is None else round(res.ttft_s, 3), "latency_s": round(res.latency_s, 3),
            "predicted_ttft_s": r.route.get("predicted_ttft_s"), "reason": r.route.get("reason", ""), "ok": res.ok,
        })  # fmt: skip
    return rows


def engine_shares(results: list[ChatResult], engines: list[str]) -> dict[str, dict[str, float]]:
    """Each engine's share of requests and prompt tokens; an engine that got none counts, at 0."""
    requests = {e: 0 for e in sorted(set(engines) | {r.engine for r in results})}
    tokens = dict.fromkeys(requests, 0)
    for r in results:
        requests[r.engine] += 1
        tokens[r.engine] += r.prompt_tokens
    n, t = max(1, len(results)), max(1, sum(tokens.values()))
    return {e: {"requests": requests[e] / n, "prompt_tokens": tokens[e] / t} for e in requests}


def median_result(runs: list[ConfigResult]) -> ConfigResult:
    """One configuration's repeats as one result: each number the median over them (ints rounded), engine shares
    likewise, the headline figures per repeat in repeat_values, every repeat's per-request rows (with "repeat")."""
    if len(runs) == 1:
        return runs[0]
    values = {}
    for f in fields(ConfigResult):
        got = [getattr(r, f.name) for r in runs]
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in got)
        if numbers and f.name != "repeats":
            m = statistics.median(got)
            values[f.name] = round(m) if isinstance(got[0], int) else m
    shares = {e: {k: statistics.median(r.engine_shares.get(e, {}).get(k, 0.0) for r in runs) for k in v}
              for e, v in runs[0].engine_shares.items()}  # fmt: skip
    rows = [{"repeat": i, **row} for i, r in enumerate(runs) for row in r.per_request]
    headline = {k: [getattr(r, k) for r in runs] for k in HEADLINE}
    return replace(runs[0], **values, engine_shares=shares, repeats=len(runs), repeat_values=headline, per_request=rows)


def run_order(configs: list[str], repeats: int) -> list[str]:
    """Interleaved repeats, ABBA: every other round in reverse, so drift over the run hits each config alike."""
    return [name for i in range(repeats) for name in (configs if i % 2 == 0 else configs[::-1])]


def baseline(names: list[str]) -> str:
    return BASELINE if BASELINE in names else names[0]


def add_ratios(results: list[ConfigResult]) -> None:
    base = next(r for r in results if r.name == baseline([r.name for r in results]))
    for r in results:
        r.ratios = {
            "ttft_mean_speedup": base.ttft_mean_s / r.ttft_mean_s,
            "latency_mean_speedup": base.latency_mean_s / r.latency_mean_s,
            "latency_p95_speedup": base.latency_p95_s / r.latency_p95_s,
            "ttft_p50_speedup": base.ttft_p50_s / r.ttft_p50_s,
            "ttft_p95_speedup": base.ttft_p95_s / r.ttft_p95_s,
            "ttft_p95_after_first_speedup": base.ttft_p95_after_first_s / r.ttft_p95_after_first_s,
            "throughput": r.requests_per_s / base.requests_per_s,
            "computed_tokens": r.computed / base.computed if base.computed else float("nan"),
        }
    add_twin_ratios(results)


def add_twin_ratios(results: list[ConfigResult]) -> None:
    """X+external against X in the same run: external / registered (TTFT: above 1 is slower; shares: below 1 is
    less cached)."""
    by_name = {r.name: r for r in results}
    for r in results:
        if not r.name.endswith(EXTERNAL) or (twin := by_name.get(r.name.removesuffix(EXTERNAL))) is None:
            continue
        ratios = {"twin": twin.name}
        for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "latency_mean_s", "cached_share",
                  "cached_share_after_first", "prefix_hit_share"):  # fmt: skip
            ratios[k] = getattr(r, k) / getattr(twin, k) if getattr(twin, k) else float("nan")
        r.vs_registered = ratios


def markdown(results: list[ConfigResult], args) -> str:
    if args.scenario == "chat":
        workload = (
            f"multi-round chat: {args.users} users joining every {args.join_interval:g} s, {args.rounds} rounds each, "
            f"a ~{args.system_tokens}-token shared system prompt, ~{args.history_tokens} tokens of history per user, "
            f"{args.answer_tokens}-token answers"
        )
    else:
        workload = f"RAG trace: {args.requests} requests from {args.clients} clients, Zipf s={args.zipf}"
    head = (
        f"# Cluster benchmark: {args.scenario}{' (quick)' if args.quick else ''}\n\n"
        f"{args.engines} engines, model `{args.model}`, {args.num_gpu_blocks} KV blocks of {args.block_size} tokens "
        f"and a {args.max_num_batched_tokens}-token step budget per engine (torch threads each: "
        f"{engine_threads(StackConfig(engines=args.engines, engine_threads=args.engine_threads)) or 'OMP_NUM_THREADS'})"
        + (
            f" (--long-prefill-token-threshold {args.long_prefill_token_threshold}: a prefill takes at most that many"
            " tokens a step)"
            if args.long_prefill_token_threshold
            else ""
        )
        + f"; {workload}; seed {args.seed}"
        + (f"; every config {args.repeats} times, interleaved (ABBA), medians" if args.repeats > 1 else "")
        + ".\n"
        f"Ratios are against `{baseline(args.configs)}` in the same run (baseline / config: higher is better).\n\n"
        "| config | TTFT mean | TTFT p50 | TTFT p95 | latency mean | latency p95 | req/s | output tok/s "
        "| prompt tok | local | fetched | computed | cached after 1st | min engine share |\n"
        "|---|" + "---:|" * 14 + "\n"
    )
    rows = [
        f"| {r.name} | {1000 * r.ttft_mean_s:.0f} ms | {1000 * r.ttft_p50_s:.0f} ms | {1000 * r.ttft_p95_s:.0f} ms | "
        f"{r.latency_mean_s:.2f} s | {r.latency_p95_s:.2f} s | {r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | "
        f"{r.prompt_tokens} | {r.local} | {r.fetched} | {r.computed} | {100 * r.cached_share_after_first:.1f}% | "
        f"{100 * r.min_request_share:.0f}% |"
        for r in results
    ]
    ratio_head = (
        "\n| config | TTFT mean x | TTFT p50 x | TTFT p95 x | TTFT p95 after 1st x | latency mean x "
        "| latency p95 x | throughput x |\n|---|" + "---:|" * 7 + "\n"
    )
    ratio_rows = [
        f"| {r.name} | {r.ratios['ttft_mean_speedup']:.2f} | {r.ratios['ttft_p50_speedup']:.2f} | "
        f"{r.ratios['ttft_p95_speedup']:.2f} | {r.ratios['ttft_p95_after_first_speedup']:.2f} | "
        f"{r.ratios['latency_mean_speedup']:.2f} | {r.ratios['latency_p95_speedup']:.2f} | "
        f"{r.ratios['throughput']:.2f} |"
        for r in results
    ]
    routing = (
        "\n| config | engines | cachestore | prefix_hit routes | cached share | cached after 1st "
        "| router predicted / reported cached | KV stored ops applied |\n|---|---|---|" + "---:|" * 5 + "\n"
        + "\n".join(routing_row(r) for r in results) + "\n"
    )  # fmt: skip
    share_rows = [
        f"- {r.name}: "
        + ", ".join(
            f"{e} {100 * v['requests']:.0f}% of requests / {100 * v['prompt_tokens']:.0f}% of prompt tokens"
            for e, v in r.engine_shares.items()
        )
        for r in results
    ]
    sources = {r.fetched_source for r in results if r.fetched_source}
    n, cold = results[0].requests, results[0].first_sight
    share = f"{100 * cold / max(n, 1):.0f}%"
    foot = f"\nFirst sight of a document (user): {cold} of {n} requests ({share}), cold under every policy.\n"
    foot += "\nPreemptions (KV full): " + ", ".join(f"{r.name} {r.preemptions}" for r in results) + "\n"
    if stored := [r for r in results if r.fetched or r.fetches_abandoned]:
        abandoned = ", ".join(f"{r.name} {r.fetches_abandoned}" for r in stored)
        foot += f"\nCachestore fetches abandoned at their deadline (the request recomputed): {abandoned}\n"
        lost = ", ".join(f"{r.name} {r.blocks_not_imported} / {r.offload_dropped}" for r in stored)
        foot += f"\nCachestore blocks fetched but not imported (no free KV block) / never offloaded: {lost}\n"
    errs = [
        f"{r.name} {1000 * r.prediction_error_p50_s:.0f} ms" for r in results if r.prediction_error_p50_s is not None
    ]
    foot += f"\nkv_aware's TTFT prediction, median absolute error per request: {', '.join(errs)}\n" if errs else ""
    foot += f"\nfetched tokens from: {', '.join(sorted(sources))}\n" if sources else ""
    return (
        head
        + "\n".join(rows)
        + "\n"
        + ratio_head
        + "\n".join(ratio_rows)
        + "\n"
        + routing
        + twin_table(results)
        + repeat_lines(results)
        + "\nEngine shares:\n\n"
        + "\n".join(share_rows)
        + "\n"
        + foot
    )


def routing_row(r: ConfigResult) -> str:
    accuracy = f"{r.router_predicted_cached / r.router_actual_cached:.3f}" if r.router_actual_cached else "-"
    return (
        f"| {r.name} | {r.engines} | {r.cachestore} | {100 * r.prefix_hit_share:.0f}% | {100 * r.cached_share:.1f}% "
        f"| {100 * r.cached_share_after_first:.1f}% | {accuracy} | {r.router_kv_stored} |"
    )


def twin_table(results: list[ConfigResult]) -> str:
    """External / registered, for each X+external whose twin X ran too."""
    twins = [r for r in results if r.vs_registered]
    if not twins:
        return ""
    keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "latency_mean_s", "cached_share", "cached_share_after_first",
            "prefix_hit_share")  # fmt: skip
    out = "\nExternal / registered (same run; TTFT and latency above 1: slower, shares below 1: less cached):\n\n"
    out += "| config | vs | " + " | ".join(keys) + " |\n|---|---|" + "---:|" * len(keys) + "\n"
    for r in twins:
        v = r.vs_registered
        out += f"| {r.name} | {v['twin']} | " + " | ".join(f"{v[k]:.3f}" for k in keys) + " |\n"
    return out


def repeat_lines(results: list[ConfigResult]) -> str:
    """Each headline figure per repeat (run order), so the medians' spread shows."""
    runs = [r for r in results if r.repeats > 1]
    if not runs:
        return ""
    out = "\nPer repeat (run order): TTFT mean (s) / cached share after 1st:\n\n"
    for r in runs:
        pairs = zip(r.repeat_values["ttft_mean_s"], r.repeat_values["cached_share_after_first"], strict=True)
        out += f"- {r.name}: " + ", ".join(f"{t:.2f} / {100 * c:.1f}%" for t, c in pairs) + "\n"
    return out


def _save(fig, ax, ylabel: str, title: str, path: Path) -> Path:
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot(results: list[ConfigResult], out: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0] * len(results)
    for part, color in (("local", "#2a9d8f"), ("fetched", "#e9c46a"), ("computed", "#e76f51")):
        values = [getattr(r, part) for r in results]
        ax.bar(names, values, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    tokens = _save(fig, ax, "prompt tokens", "Where prompt tokens came from", out / f"{stem}_tokens.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(results))
    for offset, label, attr in ((-0.27, "mean", "ttft_mean_s"), (0, "p50", "ttft_p50_s"), (0.27, "p95", "ttft_p95_s")):
        ax.bar([x + offset for x in xs], [1000 * getattr(r, attr) for r in results], 0.27, label=label)
    ax.set_xticks(list(xs), names)
    ttft = _save(fig, ax, "TTFT (ms, through the router)", "Time to first token", out / f"{stem}_ttft.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([x - 0.2 for x in xs], [r.latency_mean_s for r in results], 0.4, label="mean")
    ax.bar([x + 0.2 for x in xs], [r.latency_p95_s for r in results], 0.4, label="p95")
    ax.set_xticks(list(xs), names)
    latency = _save(fig, ax, "seconds", "End-to-end latency through the router", out / f"{stem}_latency.png")
    plt.close("all")
    return [tokens, ttft, latency]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, short workload")
    p.add_argument("--scenario", choices=("rag", "chat"), default="rag", help="RAG trace or multi-round chat")
    p.add_argument("--users", type=int, default=16, help="chat: users")
    p.add_argument("--rounds", type=int, default=4, help="chat: questions per user")
    p.add_argument("--system-tokens", type=int, default=400, help="chat: shared system prompt, about")
    p.add_argument("--history-tokens", type=int, default=600, help="chat: each user's history, about")
    p.add_argument("--answer-tokens", type=int, default=32, help="chat: tokens per answer")
    p.add_argument("--join-interval", type=float, default=2.0, help="chat: seconds between users joining")
    p.add_argument("--model", default=None, help="default: smollm2-135m (quick: the tiny test model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--engine-threads", type=int, default=0, help="torch threads per engine (0: cores / engines)")
    p.add_argument("--requests", type=int, default=None, help="default 80 (quick: 24)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--questions-per-doc", type=int, default=4)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=None, help="default 16 (quick: 4)")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks per engine; default 400 (quick: 256)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="engine token budget per step")
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="engine: a long prefill's tokens per step while others wait",
    )
    p.add_argument("--enforce-eager", action="store_true", help="engines run eager: no decode graphs to compile")
    p.add_argument("--tag", default="", help="suffix of the output file names")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    p.add_argument("--repeats", type=int, default=1, help="runs of every config, interleaved; medians reported")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--verbose", action="store_true", help="stream the stack's logs")
    args = p.parse_args(argv)
    quick = args.quick
    if args.model is None:
        if quick:
            from tests.helpers.tiny_models import tiny_model

            args.model, args.served_model_name = str(tiny_model("llama")), args.served_model_name or "tiny"
        else:
            args.model = "smollm2-135m"
    args.requests = args.requests or (24 if quick else 80)
    args.max_tokens = args.max_tokens or (4 if quick else 16)
    args.num_gpu_blocks = args.num_gpu_blocks or (256 if quick else 400)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown or not args.configs or len(set(args.configs)) < len(args.configs):
        p.error(f"--configs: distinct names of {', '.join(CONFIGS)}; unknown: {sorted(unknown)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    docs = load_corpus()
    if args.scenario == "chat":
        users = make_users(docs, args.users, args.rounds, args.history_tokens, args.join_interval, args.seed)
        trace = (system_prompt(docs, args.system_tokens, args.seed), users)
    else:
        trace = make_trace(docs, args.requests, args.zipf, args.questions_per_doc, args.seed)
    runs: dict[str, list[ConfigResult]] = {name: [] for name in args.configs}
    for name in run_order(args.configs, args.repeats):
        runs[name].append(run_config(name, args, docs, trace))
    results = [median_result(runs[name]) for name in args.configs]
    add_ratios(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scenario = "-chat" if args.scenario == "chat" else ""
    stem = "rag_cluster" + scenario + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.md").write_text(markdown(results, args))
    meta = {k: v for k, v in vars(args).items() if k != "out"}
    (out / f"{stem}.json").write_text(json.dumps({"args": meta, "results": [asdict(r) for r in results]}, indent=2))
    plot(results, out, stem)
    print(markdown(results, args))
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
