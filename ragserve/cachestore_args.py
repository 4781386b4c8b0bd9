"""`ragserve cachestore` settings, written once: CacheStoreConfig's fields are also the CLI flags
(ragserve.flags.option), their RAGSERVE_* variables and, for the settings a RAGServe CR sets (spec=True),
the CRD's cachestore properties. Torch- and grpc-free, so `ragserve --help`, the operator and the
chart tests read it cheaply. Sizes are given as text ('4GiB', as --help shows them) and are bytes once built.
"""

from __future__ import annotations

import argparse
from dataclasses import Field, dataclass

from ragserve.flags import (
    GRPC_MAX_MESSAGE,
    PORT_SCHEMA,
    FromArgs,
    add_options,
    option,
    parse_bytes,
    positive_int,
    spec_fields,
)
from ragserve.logs import LOG_LEVELS

CACHESTORE_PORT = 50061
CACHESTORE_METRICS_PORT = 9090
MAX_MESSAGE_BYTES = GRPC_MAX_MESSAGE  # the largest gRPC message, on the store and on its clients
DEFAULT_MAX_MESSAGE_BYTES = parse_bytes(MAX_MESSAGE_BYTES)
DEFAULT_MAX_BLOCKS_PER_CALL = 8192
GROUPS = ("server", "tiers", "security and limits")
SIZES = ("memory", "disk", "redis_capacity", "max_message_bytes")


@dataclass
class CacheStoreConfig(FromArgs):
    host: str = option("0.0.0.0", "address to bind", "server")
    port: int = option(CACHESTORE_PORT, "gRPC port", "server", type=int, spec=True, schema=PORT_SCHEMA)
    metrics_port: int = option(CACHESTORE_METRICS_PORT, "HTTP port for /metrics (0: off)", "server", type=int)
    workers: int = option(16, "gRPC worker threads", "server", type=positive_int)
    memory: int = option("4GiB", "RAM tier byte budget", "tiers", type=parse_bytes, spec=True)
    disk_dir: str | None = option(None, "directory of the disk tier (off when unset)", "tiers")
    disk: int = option("50GiB", "disk tier byte budget", "tiers", type=parse_bytes)
    redis: str | None = option(None, "redis://... URL of the optional Redis tier", "tiers")
    redis_capacity: int = option("4GiB", "Redis tier byte budget", "tiers", type=parse_bytes)
    redis_prefix: str = option("ragserve:kv:", "Redis key prefix (distinct per replica)", "tiers")
    tls_cert: str | None = option(None, "server certificate (PEM); enables TLS", "security and limits")
    tls_key: str | None = option(None, "server private key (PEM)", "security and limits")
    tls_client_ca: str | None = option(
        None, "CA (PEM) that client certificates must chain to: mutual TLS", "security and limits"
    )
    auth_token_file: str | None = option(
        None, "file with the shared token clients send as Bearer", "security and limits"
    )
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, "largest gRPC message", "security and limits", type=parse_bytes)
    max_blocks_per_call: int = option(
        DEFAULT_MAX_BLOCKS_PER_CALL, "most blocks in one call", "security and limits", type=positive_int
    )
    log_level: str = option("info", "log level", "security and limits", type=str.lower, choices=LOG_LEVELS)
    otlp_traces_endpoint: str | None = option(
        None, "OTLP/gRPC collector for traces (off when unset)", "security and limits"
    )

    def __post_init__(self) -> None:
        for name in SIZES:
            setattr(self, name, parse_bytes(getattr(self, name)))
        self.check_choices()
        checks = [
            (bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key go together"),
            (not self.tls_client_ca or bool(self.tls_cert), "--tls-client-ca (mutual TLS) needs --tls-cert/--tls-key"),
            (0 <= self.port < 65536 and 0 <= self.metrics_port < 65536, "ports must be in 0..65535"),
            (self.memory >= 0 and self.disk >= 0 and self.redis_capacity >= 0, "tier sizes must be >= 0"),
            (self.max_message_bytes >= 1024**2, "--max-message-bytes must be at least 1MiB"),
            (self.max_blocks_per_call > 0 and self.workers > 0, "--max-blocks-per-call and --workers must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def add_cachestore_arguments(parser: argparse.ArgumentParser) -> None:
    """`ragserve cachestore`'s flags."""
    add_options(parser, (CacheStoreConfig,), GROUPS)


def spec_options() -> list[tuple[str, Field]]:
    """(camelCase key, field) of every cachestore setting a RAGServe CR sets, in field order."""
    return spec_fields(CacheStoreConfig)
