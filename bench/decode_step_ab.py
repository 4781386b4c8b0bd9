"""Steady-state decode step A/B between source trees (issue 37): the served inter-token latency per batch size.

    python bench/decode_step_ab.py --model PATH main=/tmp/ab/main dyn=/tmp/ab/dyn ... --threads 1 2

Each variant (NAME=SRC: a tree such as `git archive`'s, run through PYTHONPATH; SRC '.' is this checkout) gets
its own compile cache, filled by one start per thread count first. Then, per repeat, per thread count, the
variants' warm starts run one after another, each probed as bench/cold_start.py does until no graph is pending
and the last rounds are steady; the result is the median over repeats of each start's steady milliseconds.
Each start is its own process: the compile thread, the step thread and the HTTP loop as in a pod.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from cold_start import RESULTS, run_once  # bench/cold_start.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="NAME=SRC (SRC '.': this checkout)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", help="a directory kept between runs (caches already warm are reused)")
    ap.add_argument("--out", default=str(RESULTS / "decode-step-ab"))
    args = ap.parse_args()
    variants = [(n, None if s == "." else s) for n, s in (v.split("=", 1) for v in args.variants)]
    work = Path(args.work or tempfile.mkdtemp(prefix="decode-step-ab-"))
    for name, src in variants:  # warm every cache first (each thread count: main's key holds it)
        for threads in args.threads:
            if not (work / f"{name}-{threads}.warmed").exists():
                run_once(args, name, src, work / name, threads, work / f"{name}-warmup-{threads}.log")
                (work / f"{name}-{threads}.warmed").touch()
    runs: dict[str, list] = {}
    for rep in range(args.repeats):
        for threads in args.threads:
            for name, src in variants:
                r = run_once(args, name, src, work / name, threads, work / f"{name}-{threads}-{rep}.log")
                runs.setdefault(f"{name}@{threads}", []).append(r)
                print(name, threads, rep, json.dumps(r["steady_ms"]), r["gauges"], flush=True)
    out = Path(args.out)  # runs of the same command line accumulate: repeats can be split across invocations
    saved = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    same = saved.setdefault(" ".join(sys.argv[1:]), {})
    for key, rs in runs.items():
        same.setdefault(key, []).extend(rs)
    if not runs:  # only warmed the caches
        return
    out.with_suffix(".json").write_text(json.dumps(saved, indent=1))
    tables = [f"`python bench/decode_step_ab.py {cmd}`\n\n" + table(args.sizes, rs) for cmd, rs in saved.items()]
    out.with_suffix(".md").write_text("\n".join(tables))
    print(table(args.sizes, same))


def table(sizes: list[int], runs: dict[str, list]) -> str:
    lines = ["| variant | threads | runs | steady ms at " + "/".join(map(str, sizes)) + " (median) | per run |",
             "|---|---|---|---|---|"]  # fmt: skip
    for key, rs in runs.items():
        name, threads = key.split("@")
        ms = [{int(b): v for b, v in r["steady_ms"].items()} for r in rs]  # through JSON: string keys
        med = "/".join(f"{statistics.median(m[b] for m in ms):.2f}" for b in sizes)
        each = "; ".join("/".join(f"{m[b]:.1f}" for b in sizes) for m in ms)
        lines.append(f"| {name} | {threads} | {len(rs)} | {med} | {each} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
