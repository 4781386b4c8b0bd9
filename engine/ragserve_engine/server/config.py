"""Server flags of `ragserve engine` (the engine's own flags live in ragserve_engine.config). Torch-free."""

from __future__ import annotations

import argparse
import os
import socket
import time
from dataclasses import dataclass, fields

from ragserve.config import add_flag, parse_bytes, positive_int

DEFAULT_MAX_BODY_BYTES = 8 * 1024**2


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    router: str | None = None  # registry HOST:PORT
    advertise_url: str | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    engine_id: str = ""
    drain_timeout: float = 60.0
    router_tls_ca: str | None = None
    router_tls_cert: str | None = None
    router_tls_key: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.engine_id:
            self.engine_id = f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
        checks = [
            (0 < self.port < 65536, f"--port must be in 1..65535, got {self.port}"),
            (self.max_body_bytes > 0, "--max-body-bytes must be positive"),
            (self.drain_timeout >= 0, "--drain-timeout must be >= 0"),
            (bool(self.router_tls_cert) == bool(self.router_tls_key), "--router-tls-cert needs --router-tls-key"),
            (not self.router or ":" in self.router, f"--router must be HOST:PORT, got {self.router!r}"),
            (
                not self.advertise_url or self.advertise_url.startswith(("http://", "https://")),
                f"--advertise-url must be an http(s) URL, got {self.advertise_url!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for path in (self.router_tls_ca, self.router_tls_cert, self.router_tls_key):
            if path and not os.path.isfile(path):
                raise FileNotFoundError(f"TLS file {path} does not exist")

    @property
    def url(self) -> str:
        """The OpenAI base URL the router should use for this engine."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    add_flag(g, "--host", default="0.0.0.0", help="HTTP bind address")
    add_flag(g, "--port", type=positive_int, default=8000, help="HTTP port")
    add_flag(g, "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize")
    add_flag(g, "--max-body-bytes", type=parse_bytes, default=DEFAULT_MAX_BODY_BYTES, help="request body limit")
    add_flag(g, "--drain-timeout", type=float, default=60.0, help="seconds running requests get after SIGTERM")
    add_flag(g, "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    g = parser.add_argument_group("cluster")
    add_flag(g, "--router", default=None, help="router gRPC registry HOST:PORT to register with")
    add_flag(g, "--advertise-url", default=None, help="URL the router sends traffic to (default http://HOST:PORT)")
    add_flag(g, "--engine-id", default="", help="unique engine id (default hostname-pid-starttime)")
    add_flag(g, "--router-tls-ca", default=None, help="CA bundle to verify the router's registry (enables TLS)")
    add_flag(g, "--router-tls-cert", default=None, help="client certificate for mutual TLS with the router")
    add_flag(g, "--router-tls-key", default=None, help="client key for mutual TLS with the router")
    # read by EngineConfig: the engine's cachestore connector offloads and fetches KV blocks
    add_flag(g, "--cachestore", default=None, help="shared KV-block store HOST:PORT[,HOST:PORT...]")
    add_flag(g, "--cachestore-tls-ca", default=None, help="CA bundle to verify the cachestore (enables TLS)")
    add_flag(g, "--cachestore-tls-cert", default=None, help="client certificate for mutual TLS with the cachestore")
    add_flag(g, "--cachestore-tls-key", default=None, help="client key for mutual TLS with the cachestore")
    add_flag(g, "--cachestore-token-file", default=None, help="file holding the cachestore's shared token")
