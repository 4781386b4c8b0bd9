"""`ragserve up`'s settings: one dataclass, built from up's flags. The tracing endpoint, log level and TLS
material are given once and reach every child (with --tls-ca/--tls-cert/--tls-key the router's registry and the
cachestore serve mutual TLS, and engines and router connect with the same files); --engine-arg/--router-arg/
--cachestore-arg pass a component's own flags through, checked against that component's parser before anything
starts."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import shutil
from dataclasses import dataclass, field, fields
from typing import Any

from ragserve.command_line import ServingTLS, TLSFiles, arg, bool_flag
from ragserve.engine_args import EngineConfig
from ragserve.flags import default_of, parse_bytes
from ragserve.logs import LOG_LEVELS
from ragserve.model_source import DEFAULT_EMBED_MODEL, DEFAULT_MODEL
from ragserve.router_args import DEFAULT_POLICY, POLICIES, ROUTER_PORT
from ragserve.stack.passthrough import check_flags

LOOPBACK = "127.0.0.1"
# engine flags `ragserve up` sets itself, per engine (the embedding engines' task and model: --embedding-*)
ENGINE_OWN = {"model", "served_model_name", "task", "pooling_type"}


@dataclass
class StackConfig:
    engines: int = 2
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    embedding_engines: int = 1  # `ragserve engine --task embed` processes: /v1/embeddings, /v1/rerank, /v1/score
    embedding_model: str = DEFAULT_EMBED_MODEL
    host: str = LOOPBACK  # the router's bind address; everything else stays on loopback
    port: int = ROUTER_PORT  # router HTTP; 0 picks a free port
    policy: str = DEFAULT_POLICY
    redis: str = "auto"  # auto | off | redis://URL
    cachestore: bool = True
    cachestore_memory: int = "1GiB"  # bytes once built
    engine_flags: list[str] = field(default_factory=list)  # passed to every engine
    engine_threads: int = 0  # torch threads per engine; 0: the host's cores shared out (engine_threads())
    # engines pose as unmodified vLLM pods: no registration, vLLM KV events on ZMQ, which the router follows
    # (--external-engine per engine, --tokenizer the model, --external-block-size the engines' --block-size)
    external_engines: bool = False
    router_flags: list[str] = field(default_factory=list)
    cachestore_flags: list[str] = field(default_factory=list)
    log_level: str = "info"  # this and the tracing endpoint reach every child
    otlp_traces_endpoint: str | None = None
    tls_ca: str | None = None  # with cert and key: mutual TLS on every gRPC link (registry, cachestore)
    tls_cert: str | None = None  # the servers' certificate and every client's (SAN 127.0.0.1, both key usages)
    tls_key: str | None = None
    ready_timeout: float = 600.0
    grace: float = 15.0

    def __post_init__(self) -> None:
        self.cachestore_memory = parse_bytes(self.cachestore_memory)
        checks = [
            (
                importlib.util.find_spec("ragserve_router") is not None,
                "ragserve up starts a router: install ragserve-router",
            ),
            (self.engines >= 1, f"--engines must be >= 1, got {self.engines}"),
            (self.embedding_engines >= 0, f"--embedding-engines must be >= 0, got {self.embedding_engines}"),
            (self.policy in POLICIES, f"--policy must be one of {', '.join(POLICIES)}"),
            (
                self.redis in ("auto", "off") or self.redis.startswith(("redis://", "rediss://", "unix://")),
                f"--redis must be auto, off or a redis:// URL, got {self.redis!r}",
            ),
            (0 <= self.port < 65536, f"--port must be in 0..65535, got {self.port}"),
            (self.log_level in LOG_LEVELS, f"--log-level must be one of {LOG_LEVELS}"),
            (self.ready_timeout > 0 and self.grace >= 0, "--ready-timeout must be > 0 and --grace >= 0"),
            (self.engine_threads >= 0, f"--engine-threads must be >= 0, got {self.engine_threads}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._check_tls()
        check_flags("engine", self.engine_flags)
        check_flags("router", self.router_flags)
        check_flags("cachestore", self.cachestore_flags)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StackConfig:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["cachestore"] = not args.no_cachestore
        values["engine_flags"] = engine_flags(args) + _flag_list(args.engine_arg)
        values["router_flags"] = _flag_list(args.router_arg)
        values["cachestore_flags"] = _flag_list(args.cachestore_arg)
        return cls(**values)

    def _check_tls(self) -> None:
        """All three TLS files or none, each a readable PEM file, together good for mutual TLS on loopback."""
        files = {"--tls-ca": self.tls_ca, "--tls-cert": self.tls_cert, "--tls-key": self.tls_key}
        if not any(files.values()):
            return
        if not all(files.values()):
            missing = ", ".join(flag for flag, path in files.items() if not path)
            raise ValueError(f"--tls-ca, --tls-cert and --tls-key go together (mutual TLS): missing {missing}")
        from ragserve.stack.health import mutual_tls_with_itself  # imports grpc: only when TLS is asked for
        from ragserve.tls import read_pem

        for flag, path in files.items():
            if b"-----BEGIN " not in read_pem(path, flag):
                raise ValueError(f"{flag} {path} is not a PEM file")
        if not mutual_tls_with_itself(self.tls_ca, self.tls_cert, self.tls_key):
            raise ValueError(
                f"--tls-cert {self.tls_cert} with --tls-key {self.tls_key} does not pass mutual TLS with itself on "
                f"127.0.0.1 under --tls-ca {self.tls_ca}: the CA must sign it, the key match it, its SAN cover "
                "127.0.0.1 and its key usage allow both serverAuth and clientAuth (or be absent)"
            )

    @property
    def serving_tls(self) -> ServingTLS:
        """The registry's and the cachestore's TLS: clients must present a certificate signed by the CA."""
        return ServingTLS(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def client_tls(self) -> TLSFiles:
        """What engines and the router connect with: verify the servers against the CA, present the certificate."""
        return TLSFiles(self.tls_ca, self.tls_cert, self.tls_key)

    @property
    def redis_server(self) -> str | None:
        """Path of redis-server when this stack should start one."""
        return shutil.which("redis-server") if self.redis == "auto" else None


def default(name: str) -> Any:
    """A StackConfig default, for `ragserve up`'s flag of that name."""
    return default_of(next(f for f in fields(StackConfig) if f.name == name))


def _flag_list(value: list[str] | str | None) -> list[str]:
    """--engine-arg values; from the environment they arrive as one shell-quoted string."""
    if isinstance(value, str):
        return shlex.split(value)
    return list(value or [])


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given to `ragserve up` that differ from the engine's defaults, as argv."""
    out: list[str] = []
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        if f.name in ENGINE_OWN or not hasattr(args, f.name) or value == default_of(f):
            continue
        out += bool_flag(f.name, value) if isinstance(value, bool) else arg(f.name, value)
    return out
