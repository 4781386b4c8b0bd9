"""Fault-injection suite: real router, engine, cachestore and redis-server processes on loopback ports.

The processes come from the router tests' Cluster (tests/router/conftest.py); engines are real `ragserve
engine` processes on the tiny test model unless a fault needs the stand-in.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import httpx
import pytest

from tests.helpers.net import free_port
from tests.helpers.process import until as wait_until
from tests.router.conftest import Cluster, Server, metrics, model_dir, until  # noqa: F401 (fixtures)


@pytest.fixture
def cluster(tmp_path, model_dir):  # noqa: F811
    c = Cluster(tmp_path, model_dir)
    yield c
    c.stop_all()


T = TypeVar("T")


def under_load(
    call: Callable[[int, int], T], clients: int, disrupt: Callable[[], None], *, warmup: int, after: int
) -> list[T]:
    """`clients` threads each loop `call(client, n)` (n: that client's call count) until stopped. After
    `warmup` calls in all, `disrupt()` runs; once `after` more calls are done the load stops. Returns every
    call's result; an exception in any call fails the test."""
    stop, done = threading.Event(), [0]

    def loop(i: int) -> list[T]:
        results: list[T] = []
        while not stop.is_set():
            results.append(call(i, len(results)))
            done[0] += 1
        return results

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(loop, i) for i in range(clients)]
        try:
            wait_until(lambda: done[0] >= warmup, timeout=60, what="load running")
            disrupt()
            before = done[0]
            wait_until(lambda: done[0] >= before + after, timeout=60, what="load after the disruption")
        finally:
            stop.set()
        return [r for f in futures for r in f.result()]


def ready(router: Server) -> dict:
    return httpx.get(router.url + "/ready", timeout=5).json()


def start_engines(cluster: Cluster, router: Server, ids: list[str], *flags: str) -> list[Server]:
    """Real `ragserve engine` processes (tiny model, CPU) registered with the router, with these engine ids."""
    procs = []
    for engine_id in ids:
        port = free_port()
        argv = [sys.executable, "-m", "ragserve.cli", "engine", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--model", str(cluster.model_dir), "--served-model-name", "tiny", "--device", "cpu"]
        argv += ["--router", router.grpc, "--advertise-url", f"http://127.0.0.1:{port}", "--engine-id", engine_id]
        procs.append(cluster._spawn(engine_id, [*argv, *flags], port))
    for proc in procs:
        cluster.wait_http(proc, timeout=300)
    return procs
