"""A router, a cachestore and tiny-model engines, every one exporting OTLP traces to a receiver in this process."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.engine_server import start_engine
from tests.helpers.net import free_port
from tests.helpers.otlp import Receiver
from tests.helpers.process import start, until, wait_http


@contextmanager
def traced_stack(
    tmp: Path, router_flags: Sequence[str], engines: Sequence[tuple[bool, Sequence[str]]]
) -> Iterator[tuple[Receiver, str, list]]:
    """engines: (registers with the router, its own flags) each. Yields the receiver, the router's URL and the
    engines once the registering ones are healthy behind the router; stops every process after."""
    with Receiver() as receiver:
        otlp = ("--otlp-traces-endpoint", receiver.endpoint)
        store = CacheStoreProcess(tmp / "cachestore.log", free_port(), *otlp)
        http_port, grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(http_port)]
        argv += ["--grpc-port", str(grpc_port), "--registry-allow-unauthenticated", *router_flags, *otlp]
        router = start("router", argv, tmp / "router.log")
        common = ("--num-gpu-blocks", "256", "--cachestore", store.address, *otlp)
        registry = ("--router", f"127.0.0.1:{grpc_port}")
        procs = [start_engine(tmp, *common, *(registry if reg else ()), *flags) for reg, flags in engines]
        try:
            store.wait_serving()
            for engine in procs:
                engine.wait_ready()
            url = f"http://127.0.0.1:{http_port}"
            wait_http(url + "/health", proc=router)
            healthy = sum(reg for reg, _ in engines)
            until(lambda: httpx.get(url + "/ready").json()["healthy_engines"] == healthy, what="engines registered")
            yield receiver, url, procs
        finally:
            for proc in (*procs, router, store):
                proc.stop()
