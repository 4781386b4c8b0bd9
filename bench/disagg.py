"""Disaggregated prefill/decode (docs/disaggregation.md) against two `both` engines, on the same cores, in one run.

    1P1D      router kv_aware --disagg-min-prompt-tokens 512; a --role prefill engine pinned to core 0 and a
              --role decode engine pinned to core 1 (`taskset -c`), both on the cachestore
    baseline  router kv_aware; two --role both engines, one pinned to core 0, one to core 1, same cachestore

Every engine: OMP_NUM_THREADS=1 and as deployed: compiled decode graphs (with the C++ paged decode attention),
capture sizes 1, 2, 4, 8 (--max-num-seqs 8), every context of the workload on a graph (--max-seq-len-to-capture is
the model length). An engine reports ready (registers) once its graphs are compiled or loaded from the graph store;
the bench waits for that. --eager runs them with --enforce-eager instead (the Python path), for comparison.
The cachestore, both routers and this load generator are not pinned (they share the same two cores with the engines,
see the result file's caveats), unless --aux-core N pins them to core N: with 0, the prefill engine's core, the
decode engine's core is its own (a deployment choice).

Per configuration and repeat (the configurations interleaved, ABBA), through its router:
    unloaded  --decoders users stream (ignore_eos, --decode-tokens max) for --window seconds, nothing else: the ITL
              reference, over the same context lengths as the loaded phase
    loaded    the same users for the same window, while --rag-clients closed-loop clients keep sending RAG prompts (a
              demo-corpus document, 1.3-2.8k tokens, made unique per request so nothing is cached; --rag-tokens answer
              tokens); then the users' streams are cut and the RAG requests in flight finish (no work is left on an
              engine when the next phase starts)
Measured: the users' inter-token latency p50/p95/p99: the gaps between stream chunks that carry tokens
(`return_token_ids`; a token without text of its own still counts; a gap still open when the window ends does not),
per repeat and pooled over the repeats (every gap is in the JSON), the RAG requests' TTFT p50/p95, output tokens per
second over the loaded phase, for 1P1D the prefill leg and the decode-leg TTFT (router metrics), and the KV moved per
RAG request, bytes and seconds (the engines' ragserve:kv_transfer_* counters). Medians over the repeats.

    .venv/bin/python bench/disagg.py [--quick] [--eager] [--repeats 3] [--aux-core 0] [--transfer-core 0] [--append]
        [--out bench/results]

--transfer-core N: every engine runs its KV transfer threads (fetch, offload, a decode engine's cache backing) on core
N (the engines' --kv-transfer-cpus), so the decode engine's core runs its steps only.

Result: disagg.{md,json} with --aux-core, disagg-unpinned.{md,json} without, -transfer{N} added with --transfer-core,
-eager added with --eager. --append
adds the run's repeats to the file's (same workload, eager or not; the ABBA order continues), so a long series can
run as several shorter ones.
--quick: the tiny test model and a short workload (a smoke run). Default: SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rag_cluster import scrape  # noqa: E402  (bench/ is not a package)

from ragserve.demo.corpus import load_corpus  # noqa: E402
from router import ROOT, Procs, pct, wait_until  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

PY = [sys.executable, "-m", "ragserve.cli"]
ENGINE = ["--device", "cpu", "--num-gpu-blocks", "1024", "--max-model-len", "4096", "--max-num-seqs", "8"]
GRAPHS = ["--max-seq-len-to-capture", "4096"]  # the model length: no context of the workload falls back to eager
LEG, DECODE_TTFT = "ragserve_router_disagg_prefill_seconds", "ragserve_router_disagg_decode_ttft_seconds"
TRANSFER = "ragserve:kv_transfer_"
ANSWER_LEAD_S = 2.0  # a RAG answer's lead before its 1st token (the baseline's last prefill chunk; 1P1D's leg end)
READY_S = 1800  # a cold start compiles four engines' decode graphs on 2 cores (a warm one loads them: seconds)


def start_router(procs: Procs, name: str, flags: list[str], pin: list[str]) -> tuple[str, str]:
    port, grpc = free_port(), free_port()
    argv = [*pin, *PY, "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc)]
    argv += ["--policy", "kv_aware"]
    procs.start(name, [*argv, "--registry-allow-unauthenticated", "--log-level", "warning", *flags])
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(url + "/health").status_code == 200, name)
    return url, f"127.0.0.1:{grpc}"


def start_engine(procs: Procs, name: str, core: int, role: str, links: tuple[str, str], model: str, args) -> str:
    router, store = links
    port = free_port()
    argv = ["env", "OMP_NUM_THREADS=1", "taskset", "-c", str(core), *PY, "engine", "--model", model]
    argv += ["--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), *ENGINE, "--role", role]
    argv += ["--enforce-eager"] if args.eager else GRAPHS
    argv += ["--kv-transfer-cpus", str(args.transfer_core)] if args.transfer_core is not None else []
    argv += ["--router", router, "--advertise-url", f"http://127.0.0.1:{port}", "--engine-id", name]
    procs.start(name, [*argv, "--cachestore", store, "--log-level", "warning"])
    return f"http://127.0.0.1:{port}"


def decode_body(tokens: int) -> dict:
    text = f"[{uuid.uuid4().hex[:8]}] Write a long story about a lighthouse keeper."
    messages = [{"role": "user", "content": text}]
    body = {"model": "bench", "messages": messages, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    return body | {"return_token_ids": True}


def rag_body(doc, tokens: int) -> dict:
    system = f"Request {uuid.uuid4().hex}. Answer from the context.\n\n{doc.title}\n\n{doc.text}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the context."}]
    return {"model": "bench", "messages": messages, "max_tokens": tokens, "stream": True, "return_token_ids": True}


@dataclass
class Stream:
    """One streamed request: the send time, then the arrival time of every chunk that carries tokens (an engine
    step's output), counted by token ids, not by text: a token without text of its own (a special token decoded by
    an ignore_eos user, a byte of a multi-byte character) is still a step's token; counted by text, it doubled the
    next gap and made the p99 of a few hundred gaps swing with what the model happened to write."""

    times: list[float] = field(default_factory=list)
    tokens: int = 0
    multi: int = 0  # chunks that carried more than one token (outputs that queued up on their way)
    textless: int = 0  # chunks that carried tokens but no text (counted by text, their step went to the next gap)


async def stream(client: httpx.AsyncClient, url: str, body: dict, out: Stream | None = None) -> Stream:
    """Fill `out` as the chunks come (a cancelled stream keeps what it had)."""
    out = Stream() if out is None else out
    out.times.append(time.perf_counter())
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"token_ids"' in line:
                choices = json.loads(line[6:])["choices"]
                if n := sum(len(c.get("token_ids") or ()) for c in choices):
                    out.times.append(time.perf_counter())
                    out.tokens, out.multi = out.tokens + n, out.multi + (n > 1)
                    out.textless += not any(c.get("delta", {}).get("content") for c in choices)
    return out


def split_gaps(users: list[Stream], rags: list[Stream]) -> dict[str, list[float]]:
    """The users' gaps by what the RAG requests were doing meanwhile: `rag_answering`, those overlapping a RAG
    request's answer (from ANSWER_LEAD_S before its first token to its last token: the RAG request is on the engine
    that decodes), in two parts, `rag_fetching` (before its second token: the lead, and for 1P1D the decode engine's
    fetch, landing and first step, as the first token, the prefill engine's, arrives before them) and `rag_decoding`
    (overlapping its later tokens), and `rag_prefill_only`, the rest (the RAG prompts only in prefill, on the prefill
    engine for 1P1D)."""
    rags = [r.times for r in rags if len(r.times) > 2]
    answering = [(t[1] - ANSWER_LEAD_S, t[-1]) for t in rags]
    decoding = [(t[2], t[-1]) for t in rags]
    names = ("rag_answering", "rag_decoding", "rag_fetching", "rag_prefill_only")
    parts: dict[str, list[float]] = {name: [] for name in names}
    for user in users:
        for a, b in zip(user.times[1:], user.times[2:], strict=False):
            if not any(a < end and b > start for start, end in answering):
                parts["rag_prefill_only"].append(b - a)
                continue
            parts["rag_answering"].append(b - a)
            decodes = any(a < end and b > start for start, end in decoding)
            parts["rag_decoding" if decodes else "rag_fetching"].append(b - a)
    return parts


def itls(streams: list[Stream]) -> list[float]:
    return [b - a for s in streams for a, b in zip(s.times[1:], s.times[2:], strict=False)]


def itl_figures(gaps_ms: list[float]) -> dict[str, float]:
    return {f"itl_p{q}_ms": pct(gaps_ms, q / 100) for q in (50, 95, 99)} | {"itl_gaps": len(gaps_ms)}


async def phase(url: str, args, docs, rag: bool) -> tuple[dict, list[float]]:
    """The users stream for the window (then their streams are cut), with RAG prompts arriving or without: both
    phases decode the same context lengths. Returns the figures and the users' gaps (ms)."""
    async with httpx.AsyncClient(timeout=600) as client:
        start, done = time.perf_counter(), asyncio.Event()
        rag_streams: list[Stream] = []

        async def rag_loop(i: int) -> None:
            n = i
            while not done.is_set():
                rag_streams.append(await stream(client, url, rag_body(docs[n % len(docs)], args.rag_tokens)))
                n += args.rag_clients

        loops = [asyncio.create_task(rag_loop(i)) for i in range(args.rag_clients if rag else 0)]
        users = [Stream() for _ in range(args.decoders)]
        tasks = [asyncio.create_task(stream(client, url, decode_body(args.decode_tokens), u)) for u in users]
        await asyncio.wait(tasks, timeout=args.window)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        done.set()
        await asyncio.gather(*loops)  # the RAG requests in flight finish (none left on an engine for the next phase)
        wall = time.perf_counter() - start
    gaps = [1000 * g for g in itls(users)]
    out_tokens = sum(s.tokens for s in users + rag_streams)
    result = itl_figures(gaps) | {"multi_token_chunks": sum(s.multi for s in users)}
    result["textless_chunks"] = sum(s.textless for s in users)
    if rag:  # the users' gaps split by what the RAG requests were doing meanwhile (see split_gaps)
        for name, part in split_gaps(users, rag_streams).items():
            result |= {f"itl_{name}_p{q}_ms": 1000 * pct(part, q / 100) if part else 0.0 for q in (50, 99)}
            result[f"itl_{name}_gaps"] = len(part)
    result |= {"wall_s": wall, "output_tokens_per_s": out_tokens / wall}
    if rag:
        ttft = [s.times[1] - s.times[0] for s in rag_streams if len(s.times) > 1]
        result |= {"rag_requests": len(rag_streams), "rag_ttft_p50_s": pct(ttft, 0.5)}
        result["rag_ttft_p95_s"] = pct(ttft, 0.95)
    return result, gaps


def transfers(engines: list[str]) -> dict[str, float]:
    """The engines' ragserve:kv_transfer_{bytes,seconds,requests}_total summed, by direction: {"bytes:stored": ...}."""
    out: dict[str, float] = {}
    for url in engines:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(TRANSFER) and 'direction="' in line:
                what = line[len(TRANSFER) : line.index("_total")]
                direction = line.split('direction="', 1)[1].split('"', 1)[0]
                key = f"{what}:{direction}"
                out[key] = out.get(key, 0.0) + float(line.rpartition(" ")[2])
    return out


def run_once(name: str, url: str, engines: list[str], args, docs) -> dict:
    unloaded, unloaded_gaps = asyncio.run(phase(url, args, docs, rag=False))
    r0, t0 = scrape(url + "/metrics"), transfers(engines)
    loaded, loaded_gaps = asyncio.run(phase(url, args, docs, rag=True))
    r1, t1 = scrape(url + "/metrics"), transfers(engines)
    n, diff = max(1, loaded["rag_requests"]), lambda k: r1.get(k, 0.0) - r0.get(k, 0.0)  # noqa: E731
    moved = {k: t1.get(k, 0.0) - t0.get(k, 0.0) for k in t1}
    legs, decode_legs, fetches = diff(LEG + "_count"), diff(DECODE_TTFT + "_count"), moved["requests:fetched"]
    result = {"unloaded_" + k: v for k, v in unloaded.items() if "itl" in k or k.endswith("_chunks")} | loaded
    result |= {
        "itl_p99_loaded_over_unloaded": loaded["itl_p99_ms"] / unloaded["itl_p99_ms"],
        "prefill_legs": legs,
        "prefill_leg_mean_s": diff(LEG + "_sum") / legs if legs else 0.0,
        "decode_leg_ttft_mean_s": diff(DECODE_TTFT + "_sum") / decode_legs if decode_legs else 0.0,
        "stored_mb_per_rag_request": moved["bytes:stored"] / n / 1e6,
        "store_put_s_per_rag_request": moved["seconds:stored"] / n,
        "fetched_mb_per_rag_request": moved["bytes:fetched"] / n / 1e6,
        "fetch_s_per_fetch": moved["seconds:fetched"] / fetches if fetches else 0.0,
    }
    print(name, json.dumps({k: round(v, 3) for k, v in result.items()}), flush=True)
    gaps = {"unloaded": [round(g, 2) for g in unloaded_gaps], "loaded": [round(g, 2) for g in loaded_gaps]}
    return result | {"gaps_ms": gaps}  # every gap: the pooled percentiles over the repeats (save)


def warm(urls: list[str], router: str, docs) -> None:
    short = decode_body(8) | {"stream": False}
    for url in [*urls, router]:
        for body in (short, rag_body(docs[0], 2) | {"stream": False}):
            resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
            assert resp.status_code == 200, resp.text


ROWS = {
    "unloaded_itl_gaps": "the users' gaps per unloaded phase (count: its p99 is the top 1 %)",
    "unloaded_itl_p50_ms": "unloaded decode ITL p50 (ms)",
    "unloaded_itl_p95_ms": "unloaded decode ITL p95 (ms)",
    "unloaded_itl_p99_ms": "unloaded decode ITL p99 (ms)",
    "itl_p50_ms": "decode ITL under RAG load p50 (ms)",
    "itl_p95_ms": "decode ITL under RAG load p95 (ms)",
    "itl_p99_ms": "decode ITL under RAG load p99 (ms)",
    "itl_gaps": "the users' gaps per loaded phase (count)",
    "itl_p99_loaded_over_unloaded": "ITL p99 loaded / unloaded, each repeat's own (median of the ratios)",
    "multi_token_chunks": "users' chunks that carried more than one token (loaded phase)",
    "textless_chunks": "users' chunks that carried tokens but no text (loaded phase; counted by text: merged gaps)",
    "itl_rag_prefill_only_p99_ms": "... p99 of the gaps while RAG prompts were only in prefill (ms)",
    "itl_rag_answering_p99_ms": "... p99 of the gaps overlapping a RAG answer (fetch, landing, its tokens) (ms)",
    "itl_rag_answering_gaps": "... gaps overlapping a RAG answer (count)",
    "itl_rag_fetching_p50_ms": "... of those, before the answer's 2nd token (fetch, landing, first step): p50 (ms)",
    "itl_rag_fetching_p99_ms": "... the same, p99 (ms)",
    "itl_rag_decoding_p50_ms": "... of those, while the answer's later tokens came (2nd to last): p50 (ms)",
    "itl_rag_decoding_p99_ms": "... the same, p99 (ms)",
    "rag_ttft_p50_s": "RAG TTFT p50 (s)",
    "rag_ttft_p95_s": "RAG TTFT p95 (s)",
    "rag_requests": "RAG requests served in the loaded phase",
    "output_tokens_per_s": "output tokens/s (loaded phase)",
    "wall_s": "loaded phase wall (s)",
    "prefill_leg_mean_s": "prefill leg mean (s, router metric)",
    "decode_leg_ttft_mean_s": "decode leg TTFT mean (s, router metric)",
    "stored_mb_per_rag_request": "KV MB put in the cachestore per RAG request",
    "store_put_s_per_rag_request": "seconds in cachestore puts per RAG request (engine offload threads)",
    "fetched_mb_per_rag_request": "KV MB engines fetched per RAG request",
    "fetch_s_per_fetch": "seconds per fetch (decode engine's fetch thread: lookup + gets)",
}
CAVEATS = """The machine has 2 cores. The engines are pinned one per core, but the cachestore, both routers and this
load generator are not: they take CPU from the engines they serve (the router tokenizes each 2k-token prompt, the
store copies ~95 MB of float32 KV per 2k-token SmolLM2 prompt in and out, the client parses every streamed chunk).
So the figures show the shape (does a prefill on the other core stop stalling the decode streams, what does the
transfer cost), not what a fleet with dedicated cores per component would reach. What 2 cores cannot show: more
than one engine per role (1P1D only, no xPyD ratios), a decode engine with its own memory bandwidth, and the
transfer over a real network (loopback here). The "..." rows split the users' gaps by whether a RAG answer was on
an engine (from 2 s before its first token): meaningful for 1P1D; in the baseline almost every gap overlaps one.
The baseline's `both` engines also offload full blocks to the same store (as a cachestore engine always does), so
its "put" row is not zero. Bytes and seconds: the engines' own `ragserve:kv_transfer_*_total{direction}` counters
(KV block bytes, without the store's headers; seconds spent in the calls, on the engines' offload and fetch
threads, not on their step loops)."""


def ratio(r: dict) -> float:
    return r["itl_p99_loaded_over_unloaded"]


def write_md(out: Path, report: dict) -> None:
    med = report["median"]
    lines = [f"# Disaggregated prefill/decode: 1P1D vs two `both` engines ({report['model']})", ""]
    lines += [f"`{report['commands'][0]}`", "", f"Workload: {json.dumps(report['workload'])}", ""]
    lines += [f"Medians over {report['repeats_done']} repeats (each repeat's values in the JSON).", ""]
    if commits := report.get("commits"):
        lines += [f"At commit {', '.join(dict.fromkeys(commits))} (every run's in the JSON).", ""]
    if len(report["commands"]) > 1:
        lines += ["Run as " + " then ".join(f"`{c}`" for c in report["commands"]) + " (repeats appended).", ""]
    lines += ["| figure | 1P1D | baseline | 1P1D / baseline |", "|---|---|---|---|"]
    for key, label in ROWS.items():
        if key not in med["1P1D"]:  # a row added after the file's first repeats
            continue
        a, b = med["1P1D"][key], med["baseline"][key]
        lines.append(f"| {label} | {a:.4g} | {b:.4g} | {a / b:.2f} |" if b else f"| {label} | {a:.4g} | {b:.4g} | |")
    lines += ["", "Per repeat, the users' ITL p99 loaded / unloaded (ms) and the ratio, in run order:", ""]
    for name, rs in report["runs"].items():
        per = ", ".join(f"{r['itl_p99_ms']:.0f}/{r['unloaded_itl_p99_ms']:.0f} = {ratio(r):.2f}" for r in rs)
        lines.append(f"- {name}: {per}")
    lines += ["", "Pooled: every repeat's gaps together (ms):", ""]
    lines += ["| | gaps | p50 | p95 | p99 | p99.9 |", "|---|---|---|---|---|---|"]
    for name, pooled in report["pooled"].items():
        for phase_name, f in pooled.items():
            lines.append(f"| {name} {phase_name} | {f['n']} | " + " | ".join(f"{f[q]:.0f}" for q in POOLED_Q) + " |")
    if (core := report["workload"].get("aux_core")) is not None:
        lines += [
            "",
            f"This run pinned the cachestore, both routers and the load generator to core {core} (`--aux-core`): "
            f"they took CPU from the engine on core {core} only, not from the other (a deployment choice).",
        ]
    if (core := report["workload"].get("transfer_core")) is not None:
        lines += [
            "",
            f"Every engine ran its KV transfer threads (fetch, offload) on core {core} (`--transfer-core`, the "
            "engines' `--kv-transfer-cpus`): off the decode engine's core.",
        ]
    lines += ["", CAVEATS, ""]
    out.write_text("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decoders", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=2000, help="the users' max_tokens in the loaded phase")
    p.add_argument("--window", type=float, default=48.0, help="seconds the users stream in each phase")
    p.add_argument("--rag-clients", type=int, default=2)
    p.add_argument("--rag-tokens", type=int, default=16)
    p.add_argument("--eager", action="store_true", help="the engines with --enforce-eager (not as deployed)")
    p.add_argument("--aux-core", type=int, default=None, help="pin the cachestore, routers and this client to it")
    p.add_argument(
        "--transfer-core", type=int, default=None, help="every engine's KV transfer threads on it (--kv-transfer-cpus)"
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--append", action="store_true", help="add the repeats to the result file's (same workload)")
    args = p.parse_args()
    model = "smollm2-135m"
    if args.quick:
        from tests.helpers.tiny_models import tiny_model

        model, args.repeats, args.window = str(tiny_model("llama")), 1, 2.0
    prior = previous(args)
    docs = [d for d in load_corpus() if len(d.text) > 6000][:6]
    logs = Path(tempfile.mkdtemp(prefix="ragserve-bench-disagg-"))
    print(f"process logs: {logs}", flush=True)
    procs, aux = Procs(logs), [] if args.aux_core is None else ["taskset", "-c", str(args.aux_core)]
    if args.aux_core is not None:
        os.sched_setaffinity(0, {args.aux_core})
    try:
        store_port, metrics_port = free_port(), free_port()
        store, store_metrics = f"127.0.0.1:{store_port}", f"http://127.0.0.1:{metrics_port}/metrics"
        argv = [*PY, "cachestore", "--host", "127.0.0.1", "--port", str(store_port)]
        procs.start("cachestore", [*aux, *argv, "--metrics-port", str(metrics_port), "--memory", "2GiB"])
        wait_until(lambda: httpx.get(store_metrics).status_code == 200, "cachestore")
        pd_url, pd_grpc = start_router(procs, "router-1p1d", ["--disagg-min-prompt-tokens", "512"], aux)
        base_url, base_grpc = start_router(procs, "router-baseline", [], aux)
        engines = {
            "1P1D": [start_engine(procs, "prefill", 0, "prefill", (pd_grpc, store), model, args),
                     start_engine(procs, "decode", 1, "decode", (pd_grpc, store), model, args)],
            "baseline": [start_engine(procs, "both-0", 0, "both", (base_grpc, store), model, args),
                         start_engine(procs, "both-1", 1, "both", (base_grpc, store), model, args)],
        }  # fmt: skip
        routers = {"1P1D": pd_url, "baseline": base_url}
        for name, url in routers.items():
            wait_until(lambda u=url: httpx.get(u + "/ready").json().get("healthy_engines") == 2, name, READY_S)
            warm(engines[name], url, docs)
        runs: dict[str, list[dict]] = prior["runs"] if prior else {name: [] for name in routers}
        done = min(len(rs) for rs in runs.values())
        for rep in range(done, done + args.repeats):  # ABBA, continued over appended runs
            for name in list(routers)[:: 1 if rep % 2 == 0 else -1]:
                runs[name].append(run_once(name, routers[name], engines[name], args, docs))
            save(args, model, runs, prior)
    finally:
        procs.stop()
    print(json.dumps(save(args, model, runs, prior)["median"], indent=2))


def git_commit() -> str:
    """The checkout's commit, "-dirty" if its code has uncommitted changes (docs and bench/results not counted)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    code = [".", ":!bench/results", ":!docs", ":!*.md"]
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", *code]).returncode != 0
    return head + ("-dirty" if dirty else "")


COMMIT = git_commit()
WORKLOAD = ("decoders", "window", "decode_tokens", "rag_clients", "rag_tokens", "aux_core", "eager", "transfer_core")
POOLED_Q = ("p50", "p95", "p99", "p99.9")


def result_path(args) -> Path:
    quick, pinned = "-quick" if args.quick else "", "" if args.aux_core is not None else "-unpinned"
    transfer = "" if args.transfer_core is None else f"-transfer{args.transfer_core}"
    return Path(args.out) / f"disagg{pinned}{transfer}{'-eager' if args.eager else ''}{quick}.json"


def previous(args) -> dict | None:
    """--append: the result file's report, which must have the same workload."""
    if not args.append or not result_path(args).exists():
        return None
    prior = json.loads(result_path(args).read_text())
    if any(prior["workload"].get(k) != getattr(args, k) for k in WORKLOAD):  # a key added since: None
        raise SystemExit(f"--append: {result_path(args)} has another workload: {prior['workload']}")
    return prior


def pooled(rs: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for phase_name in ("unloaded", "loaded"):
        gaps = [g for r in rs for g in r["gaps_ms"][phase_name]]
        out[phase_name] = {"n": len(gaps)} | {q: pct(gaps, float(q[1:]) / 100) for q in POOLED_Q}
    return out


def save(args, model: str, runs: dict[str, list[dict]], prior: dict | None) -> dict:
    """The result files, over the repeats done so far (written after each one: a cut run keeps them)."""
    command = "python bench/disagg.py " + " ".join(sys.argv[1:])
    report = {
        "commands": [*(prior["commands"] if prior else []), command],
        "commits": [*(prior.get("commits", []) if prior else []), COMMIT],
        "model": model,
        "workload": {k: getattr(args, k) for k in WORKLOAD},
        "repeats_done": min(len(rs) for rs in runs.values()),
        "median": {
            n: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "gaps_ms"} for n, rs in runs.items()
        },
        "pooled": {n: pooled(rs) for n, rs in runs.items()},
        "runs": runs,
    }
    path = result_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report) + "\n")  # one line: it holds every gap
    write_md(path.with_suffix(".md"), report)
    return report


if __name__ == "__main__":
    main()
