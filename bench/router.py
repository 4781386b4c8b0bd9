"""Router benchmark, same run for baseline and router:

1. Overhead: p50/p99 latency of short non-streaming chat requests through the router (kv_aware:
   rendering, tokenization, hashing and index lookup included) vs. direct to the engine.
2. Routing quality on a RAG-like trace (>= 20 documents of 1-2k tokens, Zipf popularity, questions
   as suffixes, 3 engines with a KV cache smaller than the corpus): prefix-cache hit rate (tokens,
   from usage.prompt_tokens_details.cached_tokens) and TTFT p50/p95 for round_robin, least_loaded,
   prefix and kv_aware; ratios kv_aware vs. round_robin.

    .venv/bin/python bench/router.py [--quick] [--model DIR] [--tag TAG]

Every engine is a real `ragserve engine` process (default: the tiny test model, so the hop and the
routing are measured, not model speed). Results go to bench/results/router[-TAG].{json,md} with the
command that produced them.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.helpers.net import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPARED = ("round_robin", "least_loaded", "prefix", "kv_aware")  # the policies a default run compares
WORDS = ("cache", "block", "prefix", "engine", "router", "token", "layer", "query", "answer", "vector")


class Procs:
    def __init__(self, logs: Path) -> None:
        self.logs, self.procs = logs, []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs = []


def wait_until(check, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what} (see the process logs)")


def start_stack(procs: Procs, args, policy: str, n_engines: int, num_blocks: int) -> tuple[str, list[str]]:
    port, grpc_port = free_port(), free_port()
    router = f"http://127.0.0.1:{port}"
    flags = f"--host 127.0.0.1 --port {port} --grpc-port {grpc_port} --policy {policy} --log-level warning"
    flags += " --registry-allow-unauthenticated"  # loopback only
    procs.start(
        f"router-{policy}", [sys.executable, "-m", "ragserve.cli", "router", *flags.split(), *args.router_flags]
    )
    wait_until(lambda: httpx.get(router + "/health").status_code == 200, "router")
    urls = []
    for i in range(n_engines):
        p = free_port()
        urls.append(f"http://127.0.0.1:{p}")
        flags = f"--host 127.0.0.1 --port {p} --served-model-name tiny --num-gpu-blocks {num_blocks} "
        flags += f"--router 127.0.0.1:{grpc_port} --advertise-url {urls[-1]} --device cpu"
        argv = [sys.executable, "-m", "ragserve.cli", "engine", "--model", str(args.model), *flags.split()]
        procs.start(f"engine-{policy}-{i}", argv)
    wait_until(lambda: httpx.get(router + "/ready").json()["engines"] == n_engines, f"{n_engines} engines", 600)
    return router, urls


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def overhead(args) -> dict:
    procs = Procs(args.logs)
    try:
        router, [engine] = start_stack(procs, args, "kv_aware", 1, 4096)
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi there, one word please."}],
            "max_tokens": 1,
        }
        times: dict[str, list[float]] = {"direct": [], "router": []}
        with httpx.Client(timeout=60) as client:
            for i in range(args.overhead_requests + 20):
                for name, base in (("direct", engine), ("router", router)):
                    t0 = time.perf_counter()
                    client.post(base + "/v1/chat/completions", json=body).raise_for_status()
                    if i >= 20:
                        times[name].append(time.perf_counter() - t0)
        p50 = {k: statistics.median(v) * 1000 for k, v in times.items()}
        p99 = {k: pct(v, 0.99) * 1000 for k, v in times.items()}
        print(f"\n== router overhead ({len(times['router'])} short requests each, interleaved, kv_aware, real engine)")
        print(f"{'':8} {'p50 ms':>9} {'p99 ms':>9}")
        for name in times:
            print(f"{name:8} {p50[name]:9.2f} {p99[name]:9.2f}")
        added = p50["router"] - p50["direct"]
        ratio = p50["router"] / p50["direct"]
        print(f"added at p50: {added:.2f} ms (target < 2 ms); router/direct p50 ratio {ratio:.2f}x")
        return {"requests": len(times["router"]), "p50_ms": p50, "p99_ms": p99, "added_p50_ms": added}
    finally:
        procs.stop()


def make_trace(args) -> tuple[list[str], list[int]]:
    """Documents of 1-2k tokens (counted with the model's tokenizer) and Zipf-distributed picks."""
    from ragserve.tokenizer import PromptTokenizer

    tok = PromptTokenizer.from_dir(args.model)
    rng = random.Random(args.seed)
    docs = []
    for d in range(args.docs):
        target, words = rng.randint(1000, 2000), []
        while len(tok.encode(" ".join(words), add_special_tokens=False)) < target - 20:
            words += [f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(20)]
        docs.append(f"Document {d}. " + " ".join(words))
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.docs)]
    return docs, rng.choices(range(args.docs), weights=weights, k=args.requests)


def run_trace(router: str, docs: list[str], picks: list[int], concurrency: int) -> dict:
    ttfts, prompt, cached, errors = [], 0, 0, 0
    lock = threading.Lock()

    def one(i: int, doc: int) -> None:
        nonlocal prompt, cached, errors
        body = {
            "model": "tiny",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [
                {"role": "system", "content": "Answer from the context.\n\n" + docs[doc]},
                {"role": "user", "content": f"Question {i}: what does item {i % 97} mean?"},
            ],
        }
        t0, first, usage = time.perf_counter(), None, None
        try:
            with httpx.stream("POST", router + "/v1/chat/completions", json=body, timeout=300) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        first = first or time.perf_counter()
                        usage = json.loads(line[6:]).get("usage") or usage
        except httpx.HTTPError:
            with lock:
                errors += 1
            return
        with lock:
            ttfts.append(first - t0)
            if usage:
                prompt += usage["prompt_tokens"]
                cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(picks)), picks))
    return {
        "hit_rate": cached / max(prompt, 1),
        "ttft_p50": pct(ttfts, 0.5),
        "ttft_p95": pct(ttfts, 0.95),
        "errors": errors,
        "requests": len(picks),
    }


def quality(args) -> dict:
    docs, picks = make_trace(args)
    print(
        f"\n== routing quality: {args.docs} docs, Zipf {args.zipf}, {args.requests} requests, "
        f"concurrency {args.concurrency}, 3 engines x {args.num_blocks} KV blocks, real engines"
    )
    results = {}
    for policy in args.policies:
        procs = Procs(args.logs)
        try:
            router, _ = start_stack(procs, args, policy, 3, args.num_blocks)
            results[policy] = run_trace(router, docs, picks, args.concurrency)
        finally:
            procs.stop()
        r = results[policy]
        print(
            f"{policy:13} hit {r['hit_rate']:6.1%}  TTFT p50 {r['ttft_p50'] * 1000:8.1f} ms  "
            f"p95 {r['ttft_p95'] * 1000:8.1f} ms  errors {r['errors']}"
        )
    if {"kv_aware", "round_robin"} <= set(results):
        kv, rr = results["kv_aware"], results["round_robin"]
        print(
            f"kv_aware vs round_robin: hit rate {kv['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x (target >= 3x), "
            f"TTFT p95 {rr['ttft_p95'] / kv['ttft_p95']:.2f}x better (target >= 3x)"
        )
    return results


def write_results(args, report: dict) -> None:
    """bench/results/router[-TAG].json and .md, each with the command that produced it."""
    out = Path(args.out)
    name = "router" + (f"-{args.tag}" if args.tag else "")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Router benchmark", "", f"Command: `{report['command']}`", ""]
    if "overhead" in report:
        o = report["overhead"]
        lines += [f"Overhead: {o['requests']} short chat requests each way, interleaved, one real engine.", ""]
        lines += ["| path | p50 ms | p99 ms |", "|---|---:|---:|"]
        lines += [f"| {k} | {o['p50_ms'][k]:.2f} | {o['p99_ms'][k]:.2f} |" for k in ("direct", "router")]
        lines += ["", f"Added at p50: {o['added_p50_ms']:.2f} ms.", ""]
    if "quality" in report:
        lines += [
            f"Routing quality: {args.docs} documents, Zipf {args.zipf}, {args.requests} requests, "
            f"concurrency {args.concurrency}, 3 real engines x {args.num_blocks} KV blocks.",
            "",
            "| policy | prompt tokens from cache | TTFT p50 ms | TTFT p95 ms | errors |",
            "|---|---:|---:|---:|---:|",
        ]
        for policy, r in report["quality"].items():
            ttft = f"{r['ttft_p50'] * 1000:.1f} | {r['ttft_p95'] * 1000:.1f}"
            lines.append(f"| {policy} | {r['hit_rate']:.1%} | {ttft} | {r['errors']} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / name}.json and .md")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: the tiny llama test model)")
    p.add_argument("--quick", action="store_true", help="fewer requests")
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--num-blocks", type=int, default=400, help="KV blocks per engine (~4 documents)")
    p.add_argument("--overhead-requests", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", choices=("overhead", "quality"), default=None)
    p.add_argument("--policies", type=lambda t: t.split(","), default=list(COMPARED), help="comma-separated")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for router[-TAG].json/.md")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--router-flags", type=str.split, default=[], help="extra router flags, e.g. '--load-weight 8'")
    args = p.parse_args()
    command = "python bench/router.py " + " ".join(sys.argv[1:])
    if args.model is None:
        from tests.helpers.tiny_models import tiny_model

        args.model = tiny_model("llama")
    if args.quick:
        args.requests, args.overhead_requests = 90, 100
    args.logs = Path(tempfile.mkdtemp(prefix="ragserve-bench-router-"))
    print(f"process logs: {args.logs}")
    report: dict = {"command": command.strip()}
    if args.skip != "overhead":
        report["overhead"] = overhead(args)
    if args.skip != "quality":
        report["quality"] = quality(args)
    write_results(args, report)


if __name__ == "__main__":
    main()
