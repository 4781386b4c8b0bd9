"""How long a new router replica takes to route exactly: two `ragserve router --redis` replicas over one Redis
and `ragserve sim-engine --count N` engines registered through the first.

The first replica routes one RAG chat per document (the demo corpus) so the engines hold their prefixes and
their KV events are in Redis. Then a second replica starts on the same Redis; from its spawn the bench polls
/ready until it sees every engine, then sends the first document's chat again until it goes to the engine that
holds it with reason `prefix_hit` (the shared KV index read from Redis) and checks every other document the same
way. Times are from the spawn (process start-up included) and from the first /ready answer. Median of --repeats.

    flock /tmp/cpu.lock .venv/bin/python bench/replica_exact.py [--engines 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_procs import MODEL, spawn, start_fleet, wait_until  # noqa: E402

from ragserve.demo.client import rag_messages  # noqa: E402
from ragserve.demo.corpus import load_corpus  # noqa: E402
from ragserve.demo.retrieve import document_context  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402


def router(redis: str, logs: Path):
    port, grpc_port = free_port(), free_port()
    argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--grpc-port", str(grpc_port), "--policy", "kv_aware", "--redis", redis, "--log-level", "warning"]
    return spawn("router", [*argv, "--registry-allow-unauthenticated"], logs), f"http://127.0.0.1:{port}", grpc_port


def chat(url: str, ctx, question: str) -> httpx.Response:
    body = {"model": MODEL, "messages": rag_messages(ctx.title, ctx.text, question), "max_tokens": 1}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def one(args, logs: Path, contexts: list) -> dict:
    port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
    )
    url_redis = f"redis://127.0.0.1:{port}/0"
    procs = []
    try:
        first, url1, grpc1 = router(url_redis, logs)
        procs.append(first)
        fleet, _ = start_fleet(args.model, args.engines, 1024, logs, f"127.0.0.1:{grpc1}")
        procs.append(fleet)
        wait_until(lambda: httpx.get(url1 + "/ready").json().get("healthy_engines") == args.engines, "fleet", first)
        holder = {}
        for i, ctx in enumerate(contexts):
            holder[i] = chat(url1, ctx, "What is this about?").headers["x-ragserve-engine"]
        time.sleep(1.0)  # the KV events reach Redis (they stream continuously)
        t0 = time.monotonic()
        second, url2, _ = router(url_redis, logs)
        procs.append(second)
        wait_until(lambda: httpx.get(url2 + "/ready").json().get("healthy_engines") == args.engines, "2nd", second)
        ready = time.monotonic()
        tries = 0
        while True:
            tries += 1
            resp = chat(url2, contexts[0], "And what else?")
            if resp.headers.get("x-ragserve-route-reason") == "prefix_hit" and (
                resp.headers["x-ragserve-engine"] == holder[0]
            ):
                break
            time.sleep(0.02)
        exact = time.monotonic()
        right = sum(
            chat(url2, c, "And what else?").headers["x-ragserve-engine"] == holder[i] for i, c in enumerate(contexts)
        )
        return {
            "spawn_to_ready_s": ready - t0,
            "spawn_to_exact_s": exact - t0,
            "ready_to_exact_s": exact - ready,
            "tries": tries,
            "documents_on_holder": f"{right}/{len(contexts)}",
        }
    finally:
        for proc in reversed(procs):
            proc.stop()
        redis.terminate()
        redis.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    if args.model is None:
        from tests.helpers.tiny_models import tiny_model

        args.model = str(tiny_model("llama"))
    logs = Path(tempfile.mkdtemp(prefix="ragserve-replica-exact-"))
    contexts = [document_context(d) for d in load_corpus()[: args.documents]]
    runs = [one(args, logs, contexts) for _ in range(args.repeats)]
    keys = ("spawn_to_ready_s", "spawn_to_exact_s", "ready_to_exact_s")
    report = {
        "command": "python bench/replica_exact.py " + " ".join(sys.argv[1:]),
        "median": {k: statistics.median(r[k] for r in runs) for k in keys},
        "runs": runs,
    }
    (Path(args.out) / "replica_exact.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
