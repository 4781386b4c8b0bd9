"""Cold-start benchmark (issue 37): how long a new `ragserve engine` takes to be ready, and to serve at full speed.

    python bench/cold_start.py --model PATH --before-src /tmp/main-src   # before (main's tree) and after

For each variant (the code under test, and optionally a --before-src tree run through PYTHONPATH) and each
start: `fresh` (an empty RAGSERVE_CACHE_DIR: no compile cache, no built C++ ops), `warm` (a second start on
that directory, as a restarted pod or a second pod on a hostPath volume) and `shipped` (a copy of it in
another place, started with --shipped-threads torch threads, --threads unless given: an image or volume that
carries a cache built elsewhere; inductor's key holds the thread count, so another count recompiles).
After /ready, rounds of probes run a decode at each batch size (one streamed completion
per sequence, its inter-token latency being the decode step) until the engine reports no graph pending
for ROUNDS_STEADY rounds (MIN_ROUNDS at least); steady state is the median of those rounds. Time to full
speed: from process start to the first round, with no graph pending, where every size is within 10 % of
steady; worst slowdown: the slowest probe after /ready over steady. Each start runs --repeats times,
variants interleaved; medians reported, every round's step times kept in the JSON. --seed-cache DIR copies a
cache built before (e.g. by a fresh start) into each variant's directory first, so that a run of minutes can
skip the fresh start (--starts warm shipped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"
ROUNDS_STEADY, MIN_ROUNDS, FULL_SPEED, MAX_S = 5, 8, 1.10, 300.0
NEW_TOKENS = 48


def start(model: str, cache: Path, threads: int, src: str | None, max_num_seqs: int, log: Path) -> tuple:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAGSERVE_", "TORCHINDUCTOR_"))}
    env |= {"RAGSERVE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": str(threads), "TMPDIR": str(cache / "tmp")}
    (cache / "tmp").mkdir(parents=True, exist_ok=True)  # the pod's /tmp: main's inductor cache went there
    if src:  # the other tree's packages first on the path (the venv's editable install points here)
        env["PYTHONPATH"] = f"{src}/engine:{src}"
    with socket.socket() as sock:  # a port free now (a random one collided with another process's)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "ragserve.cli", "engine", "--model", model, "--served-model-name", "m"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--no-enforce-eager", "--max-num-seqs", str(max_num_seqs)]
    argv += ["--max-model-len", "512", "--num-gpu-blocks", "256"]
    out = log.open("w")
    proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float | None = None) -> None:
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None
    while proc.poll() is None:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"engine not ready after {timeout_s:.0f} s")
        time.sleep(0.1)
    raise RuntimeError(f"engine exited with {proc.returncode}")


async def step_seconds(client: httpx.AsyncClient, url: str, batch: int, rng: random.Random) -> float:
    """One decode at `batch` sequences: the median over its requests of the mean inter-token latency."""

    async def one() -> float:
        body = {"model": "m", "prompt": [rng.randrange(100, 1000) for _ in range(8)], "max_tokens": NEW_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        stamps = []
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
        # first token to last: NEW_TOKENS - 1 decode steps. Not per chunk: the detokenizer holds back tokens
        # that end mid-character, so some random prompts stream 48 tokens in far fewer chunks (that read 3x)
        return (stamps[-1] - stamps[0]) / (NEW_TOKENS - 1)

    return statistics.median(await asyncio.gather(*(one() for _ in range(batch))))


def gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ragserve:decode_graph"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0].removeprefix("ragserve:")] = float(value)
    return out


async def probe(url: str, sizes: list[int], t_start: float) -> tuple[list[dict], dict]:
    rounds, quiet, rng = [], 0, random.Random(0)
    until = time.perf_counter() + MAX_S  # from ready: a fresh SmolLM2 start compiles for minutes before it
    async with httpx.AsyncClient(timeout=120) as client:
        while (quiet < ROUNDS_STEADY or len(rounds) < MIN_ROUNDS) and time.perf_counter() < until:
            t = time.perf_counter() - t_start
            steps = {b: await step_seconds(client, url, b, rng) for b in sizes}
            g = gauges(url)
            pending = g.get("decode_graphs_pending", 0) > 0
            quiet = 0 if pending else quiet + 1
            rounds.append({"t": t, "steps": steps, "pending": pending})
    return rounds, g


def summarize(rounds: list[dict], sizes: list[int], t_ready: float) -> dict:
    steady = {b: statistics.median(r["steps"][b] for r in rounds[-ROUNDS_STEADY:]) for b in sizes}
    compiled = max((i + 1 for i, r in enumerate(rounds) if r["pending"]), default=0)  # nothing pending from here
    ok = [all(r["steps"][b] <= FULL_SPEED * steady[b] for b in sizes) for r in rounds]
    first = next((i for i in range(compiled, len(ok)) if ok[i]), len(ok) - 1)
    worst = max(r["steps"][b] / steady[b] for r in rounds for b in sizes)
    return {"ready_s": t_ready, "full_speed_s": max(t_ready, rounds[first]["t"]), "worst_x": worst,
            "steady_ms": {b: 1000 * s for b, s in steady.items()}, "rounds": len(rounds),
            "round_steps_ms": [{"t": r["t"], "pending": r["pending"], **{b: 1000 * r["steps"][b] for b in sizes}}
                               for r in rounds]}  # fmt: skip


def run_once(args, variant: str, src: str | None, cache: Path, threads: int, log: Path) -> dict:
    t0 = time.perf_counter()
    proc, url = start(args.model, cache, threads, src, args.max_num_seqs, log)
    try:
        wait_ready(proc, url)
        t_ready = time.perf_counter() - t0
        rounds, g = asyncio.run(probe(url, args.sizes, t0))
    finally:
        proc.terminate()
        proc.wait(60)
    return {**summarize(rounds, args.sizes, t_ready), "gauges": g, "threads": threads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--before-src", help="a checkout of the code before the change (e.g. git archive main)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="decode batch sizes probed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shipped-threads", type=int, help="torch threads of the shipped start (default: --threads)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--starts", nargs="+", default=["fresh", "warm", "shipped"], help="which starts, in order")
    ap.add_argument("--seed-cache", help="a cache directory copied into each variant's before its first start")
    ap.add_argument("--out", default=str(RESULTS / "cold-start"))
    ap.add_argument("--table-only", action="store_true", help="rewrite the .md table from the .json (no run)")
    args = ap.parse_args()
    if args.table_only:
        saved = json.loads(Path(args.out).with_suffix(".json").read_text())
        return write(args, saved["results"], saved["argv"])
    variants = [("before", args.before_src)] if args.before_src else []
    variants.append(("after", None))
    results: dict[str, dict[str, list]] = {v: {k: [] for k in args.starts} for v, _ in variants}
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    for rep in range(args.repeats):
        for variant, src in variants:
            cache, shipped = work / f"{variant}-{rep}", work / f"{variant}-{rep}-shipped"
            if args.seed_cache:
                shutil.copytree(args.seed_cache, cache, symlinks=True)
            for start_kind in args.starts:
                threads = args.threads
                if start_kind == "shipped":
                    shutil.copytree(cache, shipped, symlinks=True)
                    threads = args.shipped_threads or args.threads
                where = shipped if start_kind == "shipped" else cache
                log = work / f"{variant}-{rep}-{start_kind}.log"
                r = run_once(args, variant, src, where, threads, log)
                results[variant][start_kind].append(r)
                summary = {k: v for k, v in r.items() if k not in ("gauges", "round_steps_ms")}
                print(variant, start_kind, rep, json.dumps(summary), flush=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    write(args, json.loads(json.dumps(results)), sys.argv)  # through JSON: the same keys as --table-only


def write(args, results: dict, argv: list[str]) -> None:
    sizes = "/".join(map(str, args.sizes))
    lines = [f"`python {' '.join(argv)}`", "", f"sizes probed {sizes}; medians of {args.repeats} runs", "",
             f"| code | start | threads | ready (s) | full speed (s) | worst step / steady | steady ms at {sizes} "
             "| graphs generated |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for variant, starts in results.items():
        for kind, runs in starts.items():
            med = {k: statistics.median(r[k] for r in runs) for k in ("ready_s", "full_speed_s", "worst_x")}
            steady = "/".join(f"{statistics.median(r['steady_ms'][str(b)] for r in runs):.1f}" for b in args.sizes)
            misses = [r["gauges"].get("decode_graph_cache_misses") for r in runs]
            generated = "n/a" if None in misses else f"{statistics.median(misses):g}"
            lines.append(f"| {variant} | {kind} | {runs[0]['threads']} | {med['ready_s']:.1f} | "
                         f"{med['full_speed_s']:.1f} | {med['worst_x']:.2f} | {steady} | {generated} |")  # fmt: skip
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
