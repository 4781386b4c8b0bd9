"""How long an engine takes to exit after SIGTERM, now and (with --baseline-src) as another tree's engine did.

Each repeat starts an engine on the tiny test model (no router), waits until it is ready, sends one completion,
then SIGTERM, and times the signal to the process's exit. Engines are interleaved within each repeat; the table
gives the median over --repeats.

    git archive REV ragserve engine | tar -x -C /tmp/exitbase   # optional: the engine before a change
    flock /tmp/cpu.lock .venv/bin/python bench/engine_exit.py --repeats 5 --baseline-src /tmp/exitbase
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from cold_start import wait_ready  # noqa: E402
from report import provenance, rotated, write  # noqa: E402

from ragserve.stack.spec import free_port  # noqa: E402
from tests.helpers.tiny_models import tiny_model  # noqa: E402


def one_exit(model: Path, src: str | None) -> float:
    """Seconds from SIGTERM to the exit of a ready engine that has answered one request."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, f"{src}/engine"])} if src else None
    cmd = [sys.executable, "-m", "ragserve.cli", "engine", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--num-gpu-blocks", "64"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, timeout_s=300)
        body = {"model": model.name, "prompt": "hello", "max_tokens": 2}
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        if code != 0:
            raise SystemExit(f"the engine exited {code}")
        return time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-src", default=None, help="a tree with ragserve/ and engine/ to run as `baseline`")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    model = tiny_model("llama")
    engines = {"now": None} | ({"baseline": args.baseline_src} if args.baseline_src else {})
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        for name in rotated(list(engines), rep):
            runs[name].append(one_exit(model, engines[name]))
            print(name, rep, f"{runs[name][-1]:.3f} s", flush=True)
    prov = provenance("engine_exit.py")
    lines = ["# Engine exit after SIGTERM", "", f"Command: `{prov['command']}` at {prov['commit']}, {prov['date']}. "
             f"Tiny test model, median of {args.repeats} interleaved repeats.", "",
             "| engine | SIGTERM to exit s | each repeat |", "|---|---:|---|"]  # fmt: skip
    for name, times in runs.items():
        lines.append(f"| {name} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |")
    stem = "engine_exit" + (f"-{args.tag}" if args.tag else "")
    write(args.out, stem, {**prov, "runs": runs}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
