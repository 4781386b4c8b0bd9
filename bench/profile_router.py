"""Where the router's CPU goes under bench/router_hop.py's load: py-spy (--gil) on a ragserve router in front of
--engines sims while the added-latency steps run; self and cumulative samples per function, as text.

    pip install py-spy   # benchmark only
    flock /tmp/cpu.lock .venv/bin/python bench/profile_router.py --out bench/results/profile-router-hop-before.txt
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_scale import added_latency, warm_up  # noqa: E402
from scale_procs import start_router, stat_cpu  # noqa: E402


def frame_name(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'func (dir/file.py)'."""
    func, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    return f"{func} ({'/'.join(Path(path).parts[-2:])})"


def thread_cpu(pid: int) -> dict[str, list[float]]:
    """User and system CPU seconds of each thread name of process `pid` (threads of one name summed)."""
    out: dict[str, list[float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name, user, system = stat_cpu(task / "stat")
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        cpu = out.setdefault(name, [0.0, 0.0])
        cpu[0] += user
        cpu[1] += system
    return out


def cpu_split(before: dict[str, list[float]], after: dict[str, list[float]], requests: int) -> str:
    """'user u / sys s ms; by thread: name u+s, ...' per request (py-spy --gil samples wall time: a write that
    wakes the reader counts while the router waits for a core, which CPU time does not)."""
    zero = [0.0, 0.0]
    d = {k: [(a - b) * 1000 / requests for a, b in zip(v, before.get(k, zero), strict=True)] for k, v in after.items()}
    user, sys_ = sum(v[0] for v in d.values()), sum(v[1] for v in d.values())
    threads = ", ".join(f"{k} {u + s:.2f}" for k, (u, s) in sorted(d.items(), key=lambda kv: -sum(kv[1])) if u + s)
    return f"user {user:.2f} / sys {sys_:.2f} ms; by thread: {threads}"


def summarize(raw: Path, top: int) -> tuple[int, list[str]]:
    own: collections.Counter[str] = collections.Counter()
    cum: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";") if " (" in f]
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            cum[f] += n
    lines = [f"total {total}", "--- self"]
    lines += [f"{n:6d} {100 * n / total:5.1f}% {f}" for f, n in own.most_common(top)]
    lines += ["--- cum"] + [f"{n:6d} {100 * n / total:5.1f}% {f}" for f, n in cum.most_common(2 * top)]
    return total, lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[25, 50])
    p.add_argument("--step-s", type=float, default=8.0)
    p.add_argument("--router", default="ragserve-kv_aware")
    p.add_argument("--rate-hz", type=int, default=250)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--note", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from tests.helpers.tiny_models import tiny_model

    logs = Path(tempfile.mkdtemp(prefix="ragserve-router-profile-"))
    router, fleet, url, urls = start_router(args.router, args.engines, str(tiny_model("llama")), 1024, logs)
    raw = logs / "router.raw"
    try:
        asyncio.run(warm_up(url, urls))
        spy_bin = str(Path(sys.executable).parent / "py-spy")
        argv = [spy_bin, "record", "--gil", "--format", "raw", "-r", str(args.rate_hz), "-o", str(raw)]
        spy = subprocess.Popen([*argv, "-p", str(router.popen.pid), "--nonblocking"])
        time.sleep(1.0)
        cpu0, threads0 = router.cpu_s(), thread_cpu(router.popen.pid)
        requests = sum(asyncio.run(added_latency(url, urls, r, args.step_s))["requests"] for r in args.rates)
        cpu_ms = 1000 * (router.cpu_s() - cpu0) / requests
        split = cpu_split(threads0, thread_cpu(router.popen.pid), requests)
        spy.send_signal(2)
        spy.wait(timeout=60)
    finally:
        router.stop()
        fleet.stop()
    total, lines = summarize(raw, args.top)
    head = (f"# py-spy --gil {args.rate_hz} Hz of {args.router}, {args.engines} sims, added-latency steps "
            f"{args.rates} req/s x {args.step_s:g} s (bench/profile_router.py). {args.note}\n"
            f"# router CPU {cpu_ms:.2f} ms / request over {requests} router requests (+ as many direct): "
            f"{split}\n")  # fmt: skip
    Path(args.out).write_text(head + "\n".join(lines) + "\n")
    print(head + "\n".join(lines[:60]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
