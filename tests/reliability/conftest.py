"""Fault-injection suite: real router, engine, cachestore and redis-server processes on loopback ports.

The processes come from the router tests' Cluster (tests/router/conftest.py); engines are real `ragserve
engine` processes on the tiny test model unless a fault needs the stand-in.
"""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.helpers.net import free_port
from tests.router.conftest import Cluster, Server, metrics, model_dir, until  # noqa: F401 (fixtures)


@pytest.fixture
def cluster(tmp_path, model_dir):  # noqa: F811
    c = Cluster(tmp_path, model_dir)
    yield c
    c.stop_all()


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
