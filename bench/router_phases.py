"""Where a request's time goes inside the router: phase timestamps in a live kv_aware router, and the scheduler's
view of each router process, with smg's cache_aware beside it.

One request at a time through the router, then the same request straight to an engine (2 sims; `Hi`, 1 token),
then --gap-ms idle, --requests times; added = router p50 - direct p50. The ragserve router runs under this file's
--launch mode, which wraps a few of its functions with perf_counter_ns stamps (a few microseconds in all) and
writes their medians at exit:

- pre: the request's first byte parsed (uvicorn's on_message_begin) to its bytes written to the engine;
  with the marks on the way (time since that first byte when the step starts);
- pick: routing.Routing.pick (parse, check, tokenize, admit, decide, reserve);
- post: the engine's answer's first bytes read to the start of the answer's write to the client.

Per router process (every thread, /proc/PID/task/*/schedstat): CPU ms per request and ms per request spent
runnable but waiting for a core (the 2 cores are shared with the sims and this load generator). py-spy counts
that waiting as time in the function that was running; a write that wakes its reader on the same core is
where it mostly falls, which is why earlier profiles showed Conn.send and JoinedCycle._gathered so large.

    flock /tmp/cpu.lock .venv/bin/python bench/router_phases.py --gaps-ms 40,0 --repeats 3 --tag now
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import medians, provenance, rotated, write

MARKS = {  # a mark's name: module, qualified name of the function whose start it stamps
    "handler": ("ragserve_router.fast_routes", "assign_request_id"),
    "read_body": ("ragserve_router.app", "read_body"),
    "route": ("ragserve_router.app", "_route"),
    "forward": ("ragserve_router.proxy", "Proxy.forward"),
}
SPANS = {  # a span's name: the function whose duration it is (in the table in this order, after pick)
    "pick": ("ragserve_router.routing", "Routing.pick"),
    "parse": ("ragserve_router.routing", "parse_body"),
    "routing_key": ("ragserve_router.prompt", "Tokenizers.routing_key"),
    "tokens": ("ragserve_router.prompt", "prompt_tokens"),  # the chat template and the encode
    "render": ("ragserve.tokenizer", "PromptTokenizer.render_chat"),
    "encode": ("ragserve.token_cache", "TokenCache.encode"),
    "hashes": ("ragserve_router.prompt", "prefix_block_hashes"),
    "decide": ("ragserve_router.policies", "Decider.decide"),
    "lookup": ("ragserve_router.kv_aware", "KVAware._lookup"),
    "remember": ("ragserve_router.routing", "Routing.remember"),
}


COLUMNS = ("pre", "handler", "read_body", "route", "pick", *list(SPANS)[1:], "forward", "post")


def launch() -> None:
    """Run the router (argv: -m ragserve.cli router ...) with the stamps; medians (us) to $PHASES_OUT at exit."""
    import atexit
    import importlib
    import inspect
    import runpy

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from ragserve.http.direct import DirectExchange
    from ragserve_router.engine_wire import Conn

    now = time.perf_counter_ns
    got: dict[str, list[int]] = {k: [] for k in ["pre", "post", *MARKS, *SPANS]}
    t = {"request": 0, "answer": 0}

    def patch(module: str, qual: str, make) -> None:
        owner_name, _, attr = qual.rpartition(".")
        mod = importlib.import_module(module)
        owner = getattr(mod, owner_name) if owner_name else mod
        setattr(owner, attr, make(getattr(owner, attr)))

    def marked(name):
        def make(f):
            if inspect.iscoroutinefunction(f):

                async def stamp(*a, **k):
                    got[name].append(now() - t["request"])
                    return await f(*a, **k)
            else:

                def stamp(*a, **k):
                    got[name].append(now() - t["request"])
                    return f(*a, **k)

            return stamp

        return make

    def timed(name):
        def make(f):
            if inspect.iscoroutinefunction(f):

                async def span(*a, **k):
                    t0 = now()
                    try:
                        return await f(*a, **k)
                    finally:
                        got[name].append(now() - t0)
            else:

                def span(*a, **k):
                    t0 = now()
                    try:
                        return f(*a, **k)
                    finally:
                        got[name].append(now() - t0)

            return span

        return make

    def begin(f):
        def on_message_begin(self):
            t["request"] = now()
            return f(self)

        return on_message_begin

    def sent(f):
        def send(self, data):
            got["pre"].append(now() - t["request"])
            return f(self, data)

        return send

    def received(f):
        def data_received(self, data):
            if not self.buf:
                t["answer"] = now()
            return f(self, data)

        return data_received

    def answered(f):
        def head(self, response, chunked):  # just before the answer is written, as JoinedCycle's flush was
            got["post"].append(now() - t["answer"])
            return f(self, response, chunked)

        return head

    HttpToolsProtocol.on_message_begin = begin(HttpToolsProtocol.on_message_begin)
    Conn.send = sent(Conn.send)
    Conn.data_received = received(Conn.data_received)
    DirectExchange._head = answered(DirectExchange._head)
    for name, (module, qual) in MARKS.items():
        patch(module, qual, marked(name))
    for name, (module, qual) in SPANS.items():
        patch(module, qual, timed(name))

    def dump() -> None:
        medians = {k: statistics.median(v) / 1000 for k, v in got.items() if v}
        Path(os.environ["PHASES_OUT"]).write_text(json.dumps(medians))

    atexit.register(dump)
    sys.argv = ["ragserve", *sys.argv[4:]]  # [this file, --launch, -m, ragserve.cli, router, ...]
    runpy.run_module("ragserve.cli", run_name="__main__")


def schedstat(pid: int) -> tuple[int, int]:
    """Nanoseconds on a core and waiting for one, over the process's threads."""
    run = wait = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            a, b, _ = map(int, (task / "schedstat").read_text().split())
        except FileNotFoundError:
            continue
        run, wait = run + a, wait + b
    return run, wait


async def sequential(
    router: str, engines: list[str], n: int, gap_s: float, rag: list[tuple[str, dict]] | None = None
) -> tuple[list[float], list[float]]:
    """`rag`: RAG chats, (path, body), instead of `Hi`: the first one per context is sent unmeasured to the router
    and every engine, then each measured request asks a question of its own (routed 2k, direct 2k + 1)."""
    import httpx
    from router_scale import timed_post

    async def post(http: httpx.AsyncClient, url: str, k: int) -> float | None:
        if not rag:
            return await timed_post(http, url)
        t0 = time.perf_counter()
        resp = await http.post(url + rag[k][0], json=rag[k][1])
        return time.perf_counter() - t0 if resp.status_code == 200 else None

    routed, direct = [], []
    async with httpx.AsyncClient(timeout=30) as http:
        warm = len(rag or ()) - 2 * n
        for k in range(warm):
            await post(http, router, k)
            await asyncio.gather(*(post(http, e, k) for e in engines))
        for k in range(n):
            routed.append(await post(http, router, warm + 2 * k))
            direct.append(await post(http, engines[k % len(engines)], warm + 2 * k + 1))
            await asyncio.sleep(gap_s)
    return [x for x in routed if x], [x for x in direct if x]


def cold_costs(model: str, calls: int = 60) -> dict[str, float]:
    """In this process, alone: p50 microseconds of the router's routing_key for `Hi` right after the previous call,
    after sleeping, and after spinning 40 ms (the code and its data go cold while time passes, idle or not)."""
    from ragserve.tokenizer import PromptTokenizer
    from ragserve_router.engines import ModelSpec
    from ragserve_router.prompt import Tokenizers

    tokenizers = Tokenizers(state=None)
    tokenizers.add("fp", PromptTokenizer.from_dir(model))
    spec, body = ModelSpec("m", 16, "fp"), {"model": "m", "prompt": "Hi", "max_tokens": 1}

    async def p50(before) -> float:
        took = []
        for _ in range(calls):
            await before()
            t0 = time.perf_counter()
            await tokenizers.routing_key(spec, "m", body, False, 45)
            took.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(took)

    async def spin() -> None:
        end = time.perf_counter() + 0.04
        while time.perf_counter() < end:
            pass

    def idle(ms: float):
        return lambda: asyncio.sleep(ms / 1000)

    async def cold() -> dict[str, float]:
        out = {f"idle {ms:g} ms": await p50(idle(ms)) for ms in (0, 1, 10, 40)}
        out["spinning 40 ms"] = await p50(spin)
        return out

    return asyncio.run(cold())


def one(name: str, gap_ms: float, args, logs: Path) -> dict:
    from router_scale import warm_up
    from scale_procs import start_router

    out = logs / f"phases-{name}-{time.monotonic_ns()}.json"
    wrapper = logs / "phases-python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} --launch "$@"\n')
    wrapper.chmod(0o755)
    os.environ["PHASES_OUT"] = str(out)
    python = str(wrapper) if name.startswith("ragserve-") else None
    router, fleet, url, urls = start_router(name, args.engines, args.model, 4096, logs, python=python)
    rag = None
    if args.contexts:
        from router_long_prompts import long_requests  # its sims prefill 2M tokens/s

        rag = long_requests(args.contexts + 2 * args.requests, args.prompt_chars, args.contexts)
    try:
        asyncio.run(warm_up(url, urls))
        run0, wait0 = schedstat(router.popen.pid)
        routed, direct = asyncio.run(sequential(url, urls, args.requests, gap_ms / 1000, rag))
        run1, wait1 = schedstat(router.popen.pid)
    finally:
        router.stop()
        fleet.stop()
    row = {
        "router": name,
        "gap_ms": gap_ms,
        "added_p50_ms": 1000 * (statistics.median(routed) - statistics.median(direct)),
        "cpu_ms_per_req": (run1 - run0) / 1e6 / args.requests,
        "wait_ms_per_req": (wait1 - wait0) / 1e6 / args.requests,
    }
    if out.exists():
        row["phases_us"] = json.loads(out.read_text())
    return row


def median_rows(rows: list[dict]) -> list[dict]:
    keyed: dict[tuple, list[dict]] = {}
    for r in rows:
        keyed.setdefault((r["router"], r["gap_ms"]), []).append(r)
    out = []
    for (name, gap), rs in keyed.items():
        m = {"router": name, "gap_ms": gap, "repeats": len(rs)}
        m |= medians(rs, ("added_p50_ms", "cpu_ms_per_req", "wait_ms_per_req"))
        if all("phases_us" in r for r in rs):
            m["phases_us"] = {k: statistics.median(r["phases_us"][k] for r in rs) for k in rs[0]["phases_us"]}
        out.append(m)
    return out


def markdown(report: dict) -> str:
    lines = [
        "# Inside the router hop: phases and scheduling",
        "",
        f"Command: `{report['command']}` at {report['commit']}, {report['date']}; {report['requests']} "
        + ("RAG chat" if report.get("contexts") else "`Hi`")
        + " requests a run, "
        f"median of {report['repeats']} interleaved repeats. Phases in microseconds (medians; marks: time since the "
        "request's first byte).",
        "",
        "| router | idle gap ms | added p50 ms | CPU ms / req | waiting for a core ms / req | "
        + " | ".join(COLUMNS)
        + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(COLUMNS),
    ]
    for r in report["rows"]:
        ph = r.get("phases_us", {})
        cells = [f"{ph[k]:.0f}" if k in ph else "-" for k in COLUMNS]
        lines.append(
            f"| {r['router']} | {r['gap_ms']:g} | {r['added_p50_ms']:.2f} | {r['cpu_ms_per_req']:.2f} | "
            f"{r['wait_ms_per_req']:.2f} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "The router's routing_key for `Hi`, in one process alone, p50 us after what came before each call:",
        "",
    ]
    lines += [f"- {k}: {v:.1f} us" for k, v in report["cold_us"].items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    if sys.argv[1:2] == ["--launch"]:
        launch()
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--gaps-ms", type=lambda s: [float(x) for x in s.split(",")], default=[40.0, 0.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--routers", type=lambda s: s.split(","), default=["ragserve-kv_aware", "smg-cache_aware"])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--contexts", type=int, default=0, help="RAG chats over N contexts instead of `Hi` (0: `Hi`)")
    p.add_argument("--prompt-chars", type=int, default=12000, help="each RAG context's size")
    p.add_argument("--model", default=None, help="default: the tiny test model (its tokenizer)")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    if args.model is None:
        from tests.helpers.tiny_models import tiny_model

        args.model = str(tiny_model("llama"))
    logs = Path(tempfile.mkdtemp(prefix="ragserve-router-phases-"))
    rows = []
    for rep in range(args.repeats):
        for name in rotated(args.routers, rep):
            for gap in args.gaps_ms:
                rows.append(one(name, gap, args, logs))
                print(json.dumps(rows[-1]), flush=True)
    report = {
        **provenance("router_phases.py"),
        "requests": args.requests,
        "contexts": args.contexts,
        "repeats": args.repeats,
        "rows": median_rows(rows),
        "cold_us": cold_costs(args.model),
        "runs": rows,
    }
    write(args.out, "router_phases" + (f"-{args.tag}" if args.tag else ""), report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
