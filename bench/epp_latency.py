"""Endpoint picker decision latency vs. the HTTP gateway's added latency, same engine, same router, same run:

- EPP decision: at an Envoy-like ext_proc client (tests/helpers/envoy.py, TLS as the router's default), the time
  from sending the request body's last chunk to the picker's first answer (the routing decision: parse, tokenize,
  hash, index lookup, kv_aware's cost model, slot reserved). The request is then served by the picked engine and
  its answer streamed back through the picker, as a gateway would.
- HTTP gateway added latency: a short non-streamed chat request through the router minus the same request direct
  to the engine (the decision plus the proxy hop).

Requests alternate direct / router / picker; `--rounds` rounds of `--requests` each; each statistic is the median
over rounds of the per-round p50 / p99.

    .venv/bin/python bench/epp_latency.py [--quick] [--tag TAG]

Results go to bench/results/epp_latency[-TAG].{json,md} with the command that produced them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from router import Procs, pct, start_stack, wait_until  # bench/router.py
from tests.helpers import envoy
from tests.helpers.net import free_port

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there, one word please."}], "max_tokens": 1}
CHAT = "/v1/chat/completions"
WARMUP = 20


def one_round(client: httpx.Client, picker: envoy.Envoy, router: str, engine: str, n: int) -> dict[str, list]:
    times: dict[str, list[float]] = {"direct": [], "router": [], "epp_decision": []}
    for _ in range(n):
        for name, base in (("direct", engine), ("router", router)):
            t0 = time.perf_counter()
            client.post(base + CHAT, json=BODY).raise_for_status()
            times[name].append(time.perf_counter() - t0)
        pick = picker.pick(CHAT, BODY, chunks=2)
        assert pick.immediate is None and picker.serve(pick, client).status == 200
        times["epp_decision"].append(pick.decided_s)
    return times


def measure(args) -> dict:
    procs = Procs(args.logs)
    epp_port = free_port()
    args.router_flags = ["--epp-port", str(epp_port)]
    try:
        router, [engine] = start_stack(procs, args, "kv_aware", 1, 4096)
        picker = envoy.Envoy(f"127.0.0.1:{epp_port}")
        wait_until(lambda: envoy.health_status(picker.chan, "readiness") == "SERVING", "picker ready")
        rounds = []
        with httpx.Client(timeout=60) as client:
            one_round(client, picker, router, engine, WARMUP)
            for _ in range(args.rounds):
                rounds.append(one_round(client, picker, router, engine, args.requests))
        picker.close()
    finally:
        procs.stop()

    def median_of(name: str, q: float) -> float:
        return statistics.median(pct(r[name], q) * 1000 for r in rounds)

    stats = {name: {"p50_ms": median_of(name, 0.5), "p99_ms": median_of(name, 0.99)} for name in rounds[0]}
    added = {
        "p50_ms": statistics.median((pct(r["router"], 0.5) - pct(r["direct"], 0.5)) * 1000 for r in rounds),
        "p99_ms": statistics.median((pct(r["router"], 0.99) - pct(r["direct"], 0.99)) * 1000 for r in rounds),
    }
    return {"rounds": args.rounds, "requests_per_round": args.requests, "latency": stats, "http_added": added}


def write_results(args, report: dict) -> None:
    out = Path(args.out)
    name = "epp_latency" + (f"-{args.tag}" if args.tag else "")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    lat, added = report["latency"], report["http_added"]
    lines = [
        "# Endpoint picker decision latency vs. HTTP gateway added latency",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{report['rounds']} rounds x {report['requests_per_round']} requests each way, interleaved (direct, "
        "router, picker), one real engine on the tiny test model, kv_aware; median over rounds of each round's "
        "percentile.",
        "",
        "| measured | p50 ms | p99 ms |",
        "|---|---:|---:|",
        f"| EPP decision (last body chunk -> picker's answer, at the client) | {lat['epp_decision']['p50_ms']:.2f} "
        f"| {lat['epp_decision']['p99_ms']:.2f} |",
        f"| HTTP gateway added latency (router - direct) | {added['p50_ms']:.2f} | {added['p99_ms']:.2f} |",
        f"| direct to the engine | {lat['direct']['p50_ms']:.2f} | {lat['direct']['p99_ms']:.2f} |",
        f"| through the HTTP gateway | {lat['router']['p50_ms']:.2f} | {lat['router']['p99_ms']:.2f} |",
        "",
    ]
    (out / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: the tiny llama test model)")
    p.add_argument("--quick", action="store_true", help="fewer requests")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=200, help="requests per round, each way")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--tag", default="", help="suffix of the result file names")
    args = p.parse_args()
    command = "python bench/epp_latency.py " + " ".join(sys.argv[1:])
    if args.model is None:
        from tests.helpers.tiny_models import tiny_model

        args.model = tiny_model("llama")
    if args.quick:
        args.requests = 50
    args.logs = Path(tempfile.mkdtemp(prefix="ragserve-bench-epp-"))
    print(f"process logs: {args.logs}")
    report = {"command": command.strip(), **measure(args)}
    write_results(args, report)


if __name__ == "__main__":
    main()
