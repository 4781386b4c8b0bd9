"""`ragserve cachestore`: the shared KV-block store (torch-free)."""

from __future__ import annotations

import argparse
import signal
import threading

from ragserve import tracing
from ragserve.flags import add_flag, parse_bytes, positive_int
from ragserve.logs import LOG_LEVELS, setup_logging

DEFAULT_PORT = 50061


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    add_flag(g, "--host", default="0.0.0.0", help="address to bind")
    add_flag(g, "--port", type=int, default=DEFAULT_PORT, help="gRPC port")
    add_flag(g, "--metrics-port", type=int, default=9090, help="HTTP port for /metrics (0: off)")
    add_flag(g, "--workers", type=positive_int, default=16, help="gRPC worker threads")
    g = parser.add_argument_group("tiers")
    add_flag(g, "--memory", type=parse_bytes, default="4GiB", help="RAM tier byte budget")
    add_flag(g, "--disk-dir", default=None, help="directory of the disk tier (off when unset)")
    add_flag(g, "--disk", type=parse_bytes, default="50GiB", help="disk tier byte budget")
    add_flag(g, "--redis", default=None, help="redis://... URL of the optional Redis tier")
    add_flag(g, "--redis-capacity", type=parse_bytes, default="4GiB", help="Redis tier byte budget")
    add_flag(g, "--redis-prefix", default="ragserve:kv:", help="Redis key prefix (distinct per replica)")
    g = parser.add_argument_group("security and limits")
    add_flag(g, "--tls-cert", default=None, help="server certificate (PEM); enables TLS")
    add_flag(g, "--tls-key", default=None, help="server private key (PEM)")
    add_flag(g, "--tls-client-ca", default=None, help="CA (PEM) that client certificates must chain to: mutual TLS")
    add_flag(g, "--auth-token-file", default=None, help="file with the shared token clients send as Bearer")
    add_flag(g, "--max-message-bytes", type=parse_bytes, default="64MiB", help="largest gRPC message")
    add_flag(g, "--max-blocks-per-call", type=positive_int, default=8192, help="most blocks in one call")
    add_flag(g, "--log-level", default="info", choices=LOG_LEVELS, type=str.lower, help="log level")
    add_flag(g, "--otlp-traces-endpoint", default=None, help="OTLP/gRPC collector for traces (off when unset)")


def run(args: argparse.Namespace) -> int:
    from ragserve_cachestore.server import CacheStoreConfig, CacheStoreServer

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
