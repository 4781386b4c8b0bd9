"""`ragserve cachestore`: the shared KV-block store (torch-free)."""

from __future__ import annotations

import argparse
import signal
import threading

from ragserve import tracing
from ragserve.cachestore_args import add_cachestore_arguments
from ragserve.logs import setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_cachestore_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ragserve.cachestore_args import CacheStoreConfig
    from ragserve_cachestore.server import CacheStoreServer

    setup_logging(args.log_level)
    tracing.setup(args.otlp_traces_endpoint, "ragserve-cachestore")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = CacheStoreServer(CacheStoreConfig.from_args(args))
    port = server.start()
    print(f"ragserve cachestore listening on {args.host}:{port}", flush=True)
    stop.wait()
    server.stop(grace=2.0)
    tracing.shutdown()
    return 0
