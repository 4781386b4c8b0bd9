"""Processes for bench/router_scale.py: a `ragserve sim-engine --count N` fleet and the router under test
(`ragserve router`, `smg launch`, `vllm-router`), each on free loopback ports, with its CPU time from /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.net import free_port  # noqa: E402

MODEL = "tiny"
# GPU-like simulated speeds (an H100 serving a ~1B model, roughly): the hop is what is measured, not the engine
SIM_COST = ("--prefill-tokens-per-s", "20000", "--decode-base-s", "0.008", "--decode-seq-s", "0.0001")
ROUTERS = ("ragserve-kv_aware", "ragserve-round_robin", "smg-cache_aware", "vllm-router-cache_aware")
STORE_SUFFIX = "+cachestore"  # e.g. ragserve-round_robin+cachestore: real engines sharing a `ragserve cachestore`


def stat_cpu(stat: Path) -> tuple[str, float, float]:
    """(name, user, system CPU seconds) from a /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat file."""
    text = stat.read_text()
    fields, tick = text.rsplit(")", 1)[1].split(), os.sysconf("SC_CLK_TCK")
    return text[text.index("(") + 1 : text.rindex(")")], int(fields[11]) / tick, int(fields[12]) / tick


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (children included once reaped: none here)."""
    _, user, system = stat_cpu(Path(f"/proc/{pid}/stat"))
    return user + system


@dataclass
class Proc:
    popen: subprocess.Popen
    log: Path

    def cpu_s(self) -> float:
        return cpu_s(self.popen.pid)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@dataclass
class Procs:
    """Several processes stopped together (a fleet of real engines)."""

    procs: list[Proc]

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def spawn(name: str, argv: list[str], logs: Path, env: dict | None = None) -> Proc:
    log = logs / f"{name}-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        return Proc(popen, log)


def wait_until(check, what: str, proc: Proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise SystemExit(f"{what}: the process exited; see {proc.log}:\n{proc.log.read_text()[-2000:]}")
        try:
            if check():
                return
        except (httpx.HTTPError, ValueError, OSError):
            pass
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what} (see {proc.log})")


def start_fleet(model: str, count: int, num_blocks: int, logs: Path, registry: str | None) -> tuple[Proc, list[str]]:
    urls_file = logs / f"urls-{time.monotonic_ns()}.json"
    argv = [sys.executable, "-m", "ragserve.cli", "sim-engine", "--model", model, "--served-model-name", MODEL]
    argv += ["--host", "127.0.0.1", "--free-ports", "--count", str(count), "--engine-id", "sim"]
    argv += ["--num-gpu-blocks", str(num_blocks), "--urls-file", str(urls_file), *SIM_COST]
    argv += ["--router", registry] if registry else []
    proc = spawn(f"sims-{count}", argv, logs)
    wait_until(urls_file.exists, f"{count} sim engines", proc)
    return proc, list(json.loads(urls_file.read_text()).values())


def start_cachestore(logs: Path) -> tuple[Proc, str]:
    """A `ragserve cachestore` (RAM tier only) on a free loopback port, serving: (Proc, HOST:PORT)."""
    from ragserve.stack.health import grpc_serving

    address = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "ragserve.cli", "cachestore", "--host", "127.0.0.1", "--port", address.split(":")[1]]
    proc = spawn("cachestore", [*argv, "--metrics-port", "0", "--memory", "1GiB", "--log-level", "warning"], logs)
    wait_until(lambda: grpc_serving(address), "cachestore serving", proc)
    return proc, address


def start_real_fleet(
    model: str,
    count: int,
    num_blocks: int,
    logs: Path,
    registry: str | None,
    cachestore: bool = False,
    engine_args: Sequence[str] = (),
):
    """`count` real `ragserve engine` processes (one torch thread each, with `engine_args` added), sharing a
    cachestore if asked, ready: (Procs, URLs)."""
    procs, urls = [], []
    store_proc, store = start_cachestore(logs) if cachestore else (None, None)
    for i in range(count):
        port = free_port()
        urls.append(f"http://127.0.0.1:{port}")
        argv = [sys.executable, "-m", "ragserve.cli", "engine", "--model", model, "--served-model-name", MODEL]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--num-gpu-blocks", str(num_blocks)]
        argv += ["--engine-id", f"real-{i}", "--log-level", "warning"]
        argv += ["--router", registry, "--advertise-url", urls[-1]] if registry else []
        argv += ["--cachestore", store] if store else []
        argv += engine_args
        procs.append(spawn(f"engine-{i}", argv, logs, {"OMP_NUM_THREADS": "1"}))
    for proc, url in zip(procs, urls, strict=True):
        wait_until(lambda url=url: httpx.get(url + "/ready").status_code == 200, "real engine ready", proc, 600)
    return Procs(procs + [store_proc] if store_proc else procs), urls  # the store stops after its engines


def probe(url: str) -> bool:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    return httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200


def start_router(
    name: str,
    count: int,
    model: str,
    num_blocks: int,
    logs: Path,
    profile: bool = False,
    real: bool = False,
    router_src: str | None = None,
    python: str | None = None,
    engine_args: Sequence[str] = (),
):
    """The fleet (sims, or real engines) and the router `name` (one of ROUTERS) in front of it: (router, fleet,
    router URL, engine URLs). router_src: a ragserve router package from another tree (a `router/` directory,
    e.g. an older commit's, `git archive REV router | tar -x -C DIR`) ahead of the installed one. python: the
    interpreter that runs a ragserve router (default: this one; the fleet always runs on this one).
    A name ending in STORE_SUFFIX (real engines only) gives the engines a shared cachestore; engine_args: more
    flags for every real engine."""
    cachestore = name.endswith(STORE_SUFFIX)
    if cachestore and not real:
        raise SystemExit(f"{name}: a cachestore only with --real (sim engines do not fetch)")
    fleet_of = partial(start_real_fleet, cachestore=cachestore, engine_args=engine_args) if real else start_fleet
    name = name.removesuffix(STORE_SUFFIX)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if name.startswith("ragserve-"):
        grpc_port = free_port()
        prof = ["-m", "cProfile", "-o", str(logs / f"{name}-{count}.prof")] if profile else []
        argv = [python or sys.executable, *prof, "-m", "ragserve.cli", "router", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--grpc-port", str(grpc_port), "--policy", name.split("-", 1)[1]]
        argv += ["--log-level", "warning"]
        path = os.pathsep.join(filter(None, [router_src, os.environ.get("PYTHONPATH")]))  # the rest as given
        env = {"PYTHONPATH": path} if path else None
        router = spawn(name, [*argv, "--registry-allow-unauthenticated"], logs, env)
        fleet, urls = fleet_of(model, count, num_blocks, logs, f"127.0.0.1:{grpc_port}")
        wait_until(lambda: httpx.get(url + "/ready").json().get("healthy_engines") == count, f"{name} fleet", router)
        return router, fleet, url, urls
    fleet, urls = fleet_of(model, count, num_blocks, logs, None)
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware"]
    common += ["--prometheus-port", str(free_port())]
    binary = Path(sys.executable).parent
    if name.startswith("smg"):
        argv = [str(binary / "smg"), "launch", *common, "--log-level", "warn", "--disable-tokenizer-autoload"]
    else:
        argv = [str(binary / "vllm-router"), *common, "--log-level", "warning"]
    router = spawn(name, argv, logs)
    wait_until(lambda: probe(url), f"{name} serving", router)
    return router, fleet, url, urls
