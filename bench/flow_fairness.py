"""Flow control under overload with real engines: priority, fairness between tenants, token quotas.

Three stacks, each a router and one real engine (tiny test model, --max-num-seqs 8): "flow" with the router's
flow control on (--max-inflight-per-engine 8, tenants from X-Tenant, a quotas file), "tuned" the same with one
place per engine kept for critical requests (--critical-reserve-per-engine 1), the class sent to the engine as
its scheduling priority (--engine-priority; the engine on --scheduling-policy priority, which admits a critical
request at once, preempting a lower-priority one if need be, and prefills it in a step of its own) and each tenant's
max-min fair allocation of the places, by its recent demand, kept free for it (--tenant-fair-share; with
--engine-priority a tenant under it is admitted past the places and the engine preempts for it by rank), "baseline"
with flow control off (the engine's own FCFS queue). Scenarios a and b run on all three, interleaved
(repeats rotate which goes first); c on flow and baseline; the table gives the median over repeats.

a. priority: TTFT p95 of critical probes (X-Ragserve-Priority: 1, one at a time, from a process of their own:
   bench/flow_probe.py) unloaded, then while 32 standard and 8 sheddable clients (closed loops) overload the
   engine; the ratio (goal <= 1.5x), and what the low classes got (sheddable 429s, standard TTFT).
b. fairness: tenant A (4 clients) alone, then with tenant B (40 clients, the same requests: 10x A's tokens);
   A's TTFT p95 ratio contended / solo (goal <= 2x) and Jain's index over the tenants' token throughput.
c. quota: one tenant with 1200 tokens/min sending as fast as it is let for 20 s: tokens admitted against
   the bucket's N + N x elapsed / 60 (goal +- 10 %), and after each 429 a retry after exactly Retry-After
   seconds (must succeed) next to the exact wait the x-ratelimit headers give.

    flock /tmp/cpu.lock .venv/bin/python bench/flow_fairness.py [--repeats 3] [--scenarios abc]
        [--engine-core 1 --aux-core 0]

--engine-core pins the engines to one core and --aux-core the routers, the load generator and the probes to
another, as a deployment keeps clients and gateways off the engine's CPU; without them every process shares
both cores of this machine.

Between phases the script waits for every stack's router to hold no request (its in-flight gauge at 0): a
place still held then is a leak (a client that left mid-stream whose place never came back), and the run stops
saying so rather than later with a 503 queue_timeout.

Results: bench/results/NAME.{json,md} (--name, default flow_fairness).
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import rotated  # noqa: E402

from router import Procs, pct, wait_until  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PIN: dict[str, list[str]] = {"engine": [], "aux": []}  # taskset prefixes (--engine-core, --aux-core)
SEQS = 8  # the engine's running batch, and the flow router's places per engine
QUOTA_TENANT, QUOTA_TPM = "metered", 1200
PROMPT = " ".join(f"word{i}" for i in range(60))


def held(url: str) -> float:
    """The router's requests in flight (each holds a place in its queue's count)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("ragserve_router_requests_in_flight "))


def settle(urls: dict[str, str], after: str, timeout: float = 30) -> None:
    """Every router back to nothing in flight once the clients of a phase left (the engine aborts their streams)."""
    for mode, url in urls.items():
        deadline = time.monotonic() + timeout
        while (n := held(url)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if n:
            raise SystemExit(f"{mode}: {n:g} requests still in flight {timeout:g} s after {after}: leaked places")


def body(tag: str, max_tokens: int, stream: bool = True) -> dict:
    b = {"model": "tiny", "prompt": f"{tag} {PROMPT}", "max_tokens": max_tokens, "ignore_eos": True}
    return b | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})


def start_stack(procs: Procs, name: str, model: str, flags: list[str], engine_flags: tuple[str, ...] = ()) -> str:
    port, grpc_port, eport = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--grpc-port", str(grpc_port), "--registry-allow-unauthenticated", "--log-level", "warning"]
    procs.start(f"router-{name}", [*PIN["aux"], *argv, "--tenant-header", "X-Tenant", *flags])
    wait_until(lambda: httpx.get(url + "/health").status_code == 200, f"router {name}")
    argv = [sys.executable, "-m", "ragserve.cli", "engine", "--model", model, "--served-model-name", "tiny"]
    argv += ["--host", "127.0.0.1", "--port", str(eport), "--device", "cpu", "--enforce-eager"]
    argv += ["--max-num-seqs", str(SEQS), *engine_flags]
    argv += ["--router", f"127.0.0.1:{grpc_port}", "--advertise-url", f"http://127.0.0.1:{eport}"]
    procs.start(f"engine-{name}", [*PIN["engine"], *argv, "--log-level", "warning"])
    wait_until(lambda: httpx.get(url + "/ready").json()["healthy_engines"] == 1, f"engine of {name}", 600)
    for i in range(8):  # warm-up: first requests pay one-off costs
        httpx.post(url + "/v1/completions", json=body(f"warm-up {i}", 32, stream=False), timeout=120)
    asyncio.run(probes(url, 5, 0.05))  # and the first critical (streamed, priority) ones
    return url


class Load:
    """Closed-loop clients: each sends its next request when the last one ended (a 429: after Retry-After)."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client, self.url, self.stop = client, url, asyncio.Event()
        self.records: list[dict] = []  # every request: tenant, cls, status, ttft, tokens, end

    async def request(self, b: dict, headers: dict) -> dict:
        start, rec = time.monotonic(), {"status": 0, "ttft": None, "tokens": 0, "retry_after": None}
        async with self.client.stream("POST", self.url + "/v1/completions", json=b, headers=headers) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                rec["retry_after"] = resp.headers.get("retry-after")
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if rec["ttft"] is None:
                    rec["ttft"] = time.monotonic() - start
                if usage := json.loads(line[6:]).get("usage"):
                    rec["tokens"] = usage["total_tokens"]
        rec["end"] = time.monotonic()
        return rec

    async def loop(self, tag: str, max_tokens: int, headers: dict) -> None:
        while not self.stop.is_set():
            rec = await self.request(body(tag, max_tokens), headers)
            self.records.append(rec | {"tag": tag, "end": time.monotonic()})
            if rec["status"] != 200:  # a client that honours Retry-After
                await asyncio.sleep(float(rec["retry_after"] or 1))

    def run(self, tag: str, clients: int, max_tokens: int, headers: dict) -> list[asyncio.Task]:
        return [asyncio.create_task(self.loop(tag, max_tokens, headers)) for _ in range(clients)]

    async def end(self, tasks: list[asyncio.Task]) -> None:
        self.stop.set()
        for t in tasks:
            t.cancel()  # the clients leave mid-stream: the router frees their places
        await asyncio.gather(*tasks, return_exceptions=True)


async def probes(url: str, n: int, gap: float) -> list[float]:
    """Critical probes' TTFTs, from a process of their own (bench/flow_probe.py)."""
    argv = [*PIN["aux"], sys.executable, str(ROOT / "bench" / "flow_probe.py"), url, str(n), str(gap)]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode:
        raise SystemExit(f"critical probes failed (exit {proc.returncode})")
    return json.loads(out)


async def priority(url: str, n: int) -> dict:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
        unloaded = await probes(url, n, 0.05)
        load = Load(client, url)
        tasks = load.run("standard", 32, 32, {"X-Tenant": "batch"})
        tasks += load.run("sheddable", 8, 32, {"X-Tenant": "batch", "X-Ragserve-Priority": "-1"})
        await asyncio.sleep(3)
        t0 = time.monotonic()
        loaded = await probes(url, n, 0.25)
        seconds = time.monotonic() - t0
        await load.end(tasks)
    window = [r for r in load.records if r["end"] >= t0]
    std = [r["ttft"] for r in window if r["tag"] == "standard" and r["status"] == 200]
    shed = [r for r in window if r["tag"] == "sheddable"]
    return {
        "critical_unloaded_p50_ms": 1000 * pct(unloaded, 0.5),
        "critical_unloaded_p95_ms": 1000 * pct(unloaded, 0.95),
        "critical_loaded_p50_ms": 1000 * pct(loaded, 0.5),
        "critical_loaded_p95_ms": 1000 * pct(loaded, 0.95),
        "ratio": pct(loaded, 0.95) / pct(unloaded, 0.95),
        "standard_ttft_p50_ms": 1000 * pct(std, 0.5),
        "standard_ttft_p95_ms": 1000 * pct(std, 0.95),
        "standard_per_s": len(std) / seconds,
        "sheddable_429_per_s": sum(r["status"] == 429 for r in shed) / seconds,
        "sheddable_served_per_s": sum(r["status"] == 200 for r in shed) / seconds,
    }


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else float("nan")


async def fairness(url: str, seconds: float) -> dict:
    a_hdr, b_hdr = {"X-Tenant": "A"}, {"X-Tenant": "B"}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
        solo = Load(client, url)
        tasks = solo.run("A", 4, 32, a_hdr)
        await asyncio.sleep(seconds / 2)
        await solo.end(tasks)
        both = Load(client, url)
        tasks = both.run("B", 40, 32, b_hdr)
        await asyncio.sleep(2)
        tasks += both.run("A", 4, 32, a_hdr)
        await asyncio.sleep(1)
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        await both.end(tasks)

    def ttfts(load: Load) -> list[float]:
        return [r["ttft"] for r in load.records if r["tag"] == "A" and r["status"] == 200]

    done = [r for r in both.records if r["status"] == 200 and r["end"] >= t0 and r["tokens"]]
    tokens = {t: sum(r["tokens"] for r in done if r["tag"] == t) / seconds for t in ("A", "B")}
    solo_p95, both_p95 = pct(ttfts(solo), 0.95), pct(ttfts(both), 0.95)
    return {
        "a_solo_p95_ms": 1000 * solo_p95,
        "a_contended_p50_ms": 1000 * pct(ttfts(both), 0.5),
        "a_contended_p95_ms": 1000 * both_p95,
        "ratio": both_p95 / solo_p95,
        "a_tokens_per_s": tokens["A"],
        "b_tokens_per_s": tokens["B"],
        "jain": jain(list(tokens.values())),
    }


def quota(url: str, seconds: float) -> dict:
    rate, admitted, retries, retry_ok, retry_vs_exact = QUOTA_TPM / 60, 0, 0, 0, []
    hdr = {"X-Tenant": QUOTA_TENANT}
    with httpx.Client(timeout=60) as client:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            resp = client.post(url + "/v1/completions", json=body("quota", 8, stream=False), headers=hdr)
            if resp.status_code == 200:
                admitted += resp.json()["usage"]["total_tokens"]
                prompt = resp.json()["usage"]["prompt_tokens"]
                continue
            assert resp.status_code == 429, resp.text
            retry = int(resp.headers["retry-after"])
            exact = (prompt - int(resp.headers["x-ratelimit-remaining-tokens"])) / rate
            retry_vs_exact.append(retry - exact)
            time.sleep(retry)
            again = client.post(url + "/v1/completions", json=body("quota", 8, stream=False), headers=hdr)
            retries, retry_ok = retries + 1, retry_ok + (again.status_code == 200)
            if again.status_code == 200:
                admitted += again.json()["usage"]["total_tokens"]
        elapsed = time.monotonic() - start
    expected = QUOTA_TPM + rate * elapsed
    return {
        "seconds": elapsed,
        "admitted_tokens": admitted,
        "expected_tokens": expected,
        "admitted_vs_expected": admitted / expected,
        "retries_after_retry_after": retries,
        "retries_admitted": retry_ok,
        "retry_after_minus_exact_s_max": max(retry_vs_exact, default=float("nan")),
        "retry_after_minus_exact_s_min": min(retry_vs_exact, default=float("nan")),
    }


def commit() -> str:
    """The checked-out commit (with "+changes" when the tree differs from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


HEADS = {"flow": "flow control", "tuned": "+ reserve, engine priority, fair share", "baseline": "baseline (off)"}


def table(rows: dict[str, dict], digits: int, heads: dict[str, str]) -> list[str]:
    modes = [m for m in heads if m in rows]
    lines = ["| | " + " | ".join(heads[m] for m in modes) + " |", "|---|" + "---:|" * len(modes)]
    for key in rows[modes[0]]:
        lines.append(f"| {key} | " + " | ".join(f"{rows[m][key]:.{digits}f}" for m in modes) + " |")
    return lines


def write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{report['name']}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Flow control under overload (real engines)", "", f"Command: `{report['command']}`", ""]
    lines += [report["setup"], "", f"Median of {report['repeats']} interleaved repeats.", ""]
    pins = report["pinning"]
    if pins["engine_core"] is not None or pins["aux_core"] is not None:
        lines += [f"Engines pinned to core {pins['engine_core']}; routers, load generator and probes to core "
                  f"{pins['aux_core']} (taskset).", ""]  # fmt: skip
    if report["priority"]:
        lines += ["## a. Priority", "", *table(report["priority"], 2, HEADS), ""]
    if report["fairness"]:
        lines += ["## b. Fairness (A: 4 clients, B: 40 clients, same requests)", ""]
        lines += [*table(report["fairness"], 3, HEADS), ""]
    if report["quota"]:
        lines += [f"## c. Quota ({QUOTA_TPM} tokens/min, one tenant, as fast as admitted)", ""]
        lines += table(report["quota"], 2, {"flow": "flow control (quota)", "baseline": "baseline (no quota)"})
    (out / f"{report['name']}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: the tiny llama test model)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--probes", type=int, default=20, help="critical probes per phase")
    p.add_argument("--seconds", type=float, default=8.0, help="fairness measuring window")
    p.add_argument("--quota-seconds", type=float, default=20.0)
    p.add_argument("--scenarios", default="abc", help="which of a (priority), b (fairness), c (quota) to run")
    p.add_argument("--engine-core", type=int, default=None, help="pin the engines to this core")
    p.add_argument("--aux-core", type=int, default=None, help="pin the routers, this client and the probes to it")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--name", default="flow_fairness", help="result files' name (.json, .md) under --out")
    args = p.parse_args()
    if args.engine_core is not None:
        PIN["engine"] = ["taskset", "-c", str(args.engine_core)]
    if args.aux_core is not None:
        PIN["aux"] = ["taskset", "-c", str(args.aux_core)]
        os.sched_setaffinity(0, {args.aux_core})
    code = commit()  # now: the tree may change while it runs
    if args.model is None:
        from tests.helpers.tiny_models import tiny_model

        args.model = str(tiny_model("llama"))
    logs = Path(tempfile.mkdtemp(prefix="ragserve-bench-flow-"))
    print(f"process logs: {logs}")
    quotas = logs / "quotas.txt"
    quotas.write_text(f"{QUOTA_TENANT} tpm={QUOTA_TPM}\n")
    procs = Procs(logs)
    try:
        flow = ["--max-inflight-per-engine", str(SEQS), "--queue-size", "512", "--queue-timeout", "60"]
        flow += ["--tenant-quotas-file", str(quotas)]
        tuned = [*flow, "--critical-reserve-per-engine", "1", "--engine-priority", "--tenant-fair-share"]
        urls = {
            "flow": start_stack(procs, "flow", args.model, flow),
            "tuned": start_stack(procs, "tuned", args.model, tuned, ("--scheduling-policy", "priority")),
            "baseline": start_stack(procs, "baseline", args.model, []),
        }
        runs: dict[str, dict[str, list]] = {"priority": {m: [] for m in urls}, "fairness": {m: [] for m in urls}}
        for rep in range(args.repeats):
            for mode in rotated(list(urls), rep):
                print(f"repeat {rep} {mode}", flush=True)
                if "a" in args.scenarios:
                    runs["priority"][mode].append(asyncio.run(priority(urls[mode], args.probes)))
                    settle(urls, f"repeat {rep} {mode} priority")
                if "b" in args.scenarios:
                    runs["fairness"][mode].append(asyncio.run(fairness(urls[mode], args.seconds)))
                    settle(urls, f"repeat {rep} {mode} fairness")
                print({s: r[mode][-1] for s, r in runs.items() if r[mode]}, flush=True)
        report = {
            "command": "python bench/flow_fairness.py " + " ".join(sys.argv[1:]),
            "setup": f"Per mode: a router and one real engine (tiny test model, CPU, --max-num-seqs {SEQS}); "
            f"flow control: --max-inflight-per-engine {SEQS}; tuned: also --critical-reserve-per-engine 1 "
            "--engine-priority --tenant-fair-share, the engine on --scheduling-policy priority. Times in ms, "
            f"rates per second. Code at {code}.",
            "name": args.name,
            "repeats": args.repeats,
            "runs": runs,
            "quota": {m: quota(urls[m], args.quota_seconds) for m in ("flow", "baseline")}
            if "c" in args.scenarios
            else {},
            "pinning": {"engine_core": args.engine_core, "aux_core": args.aux_core},
        }
        for scenario in ("priority", "fairness"):
            report[scenario] = {m: median_of(r) for m, r in runs[scenario].items() if r}
    finally:
        procs.stop()
    write(Path(args.out), report)
    print(json.dumps({k: report[k] for k in ("priority", "fairness", "quota")}, indent=2))


if __name__ == "__main__":
    main()
