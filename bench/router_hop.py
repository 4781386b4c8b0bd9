"""The router hop at equal load: added latency of ragserve's kv_aware against smg's cache_aware (and, with
--baseline-src, the kv_aware router of another tree: before / after a change; with --router-python, the same
kv_aware router under another interpreter, e.g. a PGO + LTO build as in the python:3.11-slim image), on
`ragserve sim-engine`s. The sims and the load generator always run on this interpreter.

Every repeat starts each router afresh on a fresh fleet (--engines sims), warms its connections up, then runs
bench/router_scale.py's added-latency step at each --rates (short completions alternating router / direct;
added = router p50 - direct p50, and the same for p99). Routers are interleaved within each repeat; the
table gives the median over --repeats. Everything, the load generator included, shares this machine's cores.

    pip install smg==1.13.0   # benchmark only
    git archive REV router | tar -x -C /tmp/base   # optional: the router before a change
    flock /tmp/cpu.lock .venv/bin/python bench/router_hop.py --baseline-src /tmp/base/router --tag after-perf
    ... --router-python /tmp/dvenv/bin/python --router-python-tag py-pgo-lto   # + ragserve-kv_aware@py-pgo-lto
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import medians, rotated  # noqa: E402
from router_scale import added_latency, warm_up  # noqa: E402
from scale_procs import start_router  # noqa: E402

BASELINE = "ragserve-kv_aware@baseline"
OTHER_PYTHON = "ragserve-kv_aware@"  # + --router-python-tag: the kv_aware router under --router-python
# what each ragserve row's interpreter is: version, configure arguments, whether libpython is a shared library
INTERPRETER = (
    "import json, sys, sysconfig; maps = open('/proc/self/maps').read(); "
    "print(json.dumps({'executable': sys.executable, 'version': sys.version.split()[0], "
    "'config_args': sysconfig.get_config_var('CONFIG_ARGS'), 'libpython_shared': 'libpython' in maps}))"
)


def router_python(name: str, args) -> str:
    """The interpreter that runs router `name` (a ragserve one)."""
    other = args.router_python and name == OTHER_PYTHON + args.router_python_tag
    return args.router_python if other else sys.executable


def interpreters(names: list[str], args) -> dict[str, dict]:
    """Per ragserve row: its interpreter, as that interpreter describes itself (other rows: native binaries)."""
    rows = {}
    for name in names:
        if not name.startswith("ragserve-"):
            rows[name] = {"native": True}
            continue
        out = subprocess.run([router_python(name, args), "-c", INTERPRETER], capture_output=True, text=True, check=True)
        rows[name] = json.loads(out.stdout)
    return rows


def one(name: str, args, logs: Path) -> list[dict]:
    src = args.baseline_src if name == BASELINE else None
    python = router_python(name, args) if name.startswith("ragserve-") else None
    router, fleet, url, urls = start_router(
        name.split("@")[0], args.engines, args.model, 1024, logs, router_src=src, python=python
    )
    try:
        asyncio.run(warm_up(url, urls))
        cpu0 = router.cpu_s()
        steps = [asyncio.run(added_latency(url, urls, rate, args.step_s)) for rate in args.rates]
        cpu = router.cpu_s() - cpu0
        for s in steps:
            s["cpu_ms_per_req"] = 1000 * cpu / sum(x["requests"] for x in steps)
        return steps
    finally:
        router.stop()
        fleet.stop()


def median_rows(runs: dict[str, list[list[dict]]], rates: list[float]) -> list[dict]:
    rows = []
    for name, repeats in runs.items():
        for i, rate in enumerate(rates):
            steps = [r[i] for r in repeats]
            row = {"router": name, "rate": rate, "repeats": len(steps), "errors": sum(s["errors"] for s in steps)}
            row |= medians(steps, ("added_p50_ms", "added_p99_ms", "router_p50_ms", "direct_p50_ms", "cpu_ms_per_req"))
            row["added_p50_each"] = [round(s["added_p50_ms"], 2) for s in steps]
            rows.append(row)
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# Router hop at equal load",
        "",
        f"Command: `{report['command']}` at {report['commit']}, {report['date']}. {report['engines']} sims; "
        f"median of {report['repeats']} interleaved repeats ({report['step_s']:g} s a step).",
        "",
        "| router | req/s | added p50 ms | added p99 ms | router p50 / direct p50 ms | router CPU ms / req "
        "| added p50 each repeat | errors |",
        "|---|---:|---:|---:|---|---:|---|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['router']} | {r['rate']:g} | {r['added_p50_ms']:.2f} | {r['added_p99_ms']:.2f} | "
            f"{r['router_p50_ms']:.2f} / {r['direct_p50_ms']:.2f} | {r['cpu_ms_per_req']:.2f} | "
            f"{', '.join(map(str, r['added_p50_each']))} | {r['errors']} |"
        )
    lines += ["", "Interpreters (the sims and the load generator run on the first):", ""]
    for name, py in report["interpreters"].items():
        if py.get("native"):
            lines.append(f"- {name}: a native binary (no interpreter)")
            continue
        shared = "shared" if py["libpython_shared"] else "static"
        lines.append(
            f"- {name}: `{py['executable']}` {py['version']} ({shared} libpython), CONFIG_ARGS `{py['config_args']}`"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[25, 50])
    p.add_argument("--step-s", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--routers", type=lambda s: s.split(","), default=["ragserve-kv_aware", "smg-cache_aware"])
    p.add_argument("--baseline-src", default=None, help="a router/ directory to run as " + BASELINE)
    p.add_argument("--router-python", default=None, help="an interpreter to run the kv_aware router under as well")
    p.add_argument("--router-python-tag", default="other-python", help="its row: " + OTHER_PYTHON + "TAG")
    p.add_argument("--model", default=None, help="default: the tiny test model (its tokenizer)")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    if args.model is None:
        from tests.helpers.tiny_models import tiny_model

        args.model = str(tiny_model("llama"))
    names = [*args.routers, *([BASELINE] if args.baseline_src else [])]
    names += [OTHER_PYTHON + args.router_python_tag] if args.router_python else []
    logs = Path(tempfile.mkdtemp(prefix="ragserve-router-hop-"))
    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in rotated(names, rep):
            runs[name].append(one(name, args, logs))
            print(name, rep, [round(s["added_p50_ms"], 2) for s in runs[name][-1]], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "command": "python bench/router_hop.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "engines": args.engines,
        "repeats": args.repeats,
        "step_s": args.step_s,
        "interpreters": interpreters(names, args),
        "rows": median_rows(runs, args.rates),
        "runs": runs,
    }
    stem = "router_hop" + (f"-{args.tag}" if args.tag else "")
    out = Path(args.out)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
