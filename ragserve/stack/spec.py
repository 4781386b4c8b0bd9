"""What `ragserve up` starts: the ports, and every child's command line from its component's builder
(engine_command, router_command, cachestore_command), for the settings in ragserve.stack.config."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
from dataclasses import dataclass, field

from ragserve.cachestore_command import CacheStoreLaunch, cachestore_command
from ragserve.command_line import TLSFiles
from ragserve.engine_command import EnginePod, engine_command
from ragserve.external_engine import ExternalEngineSpec
from ragserve.model_source import resolve_model
from ragserve.router_command import RouterLaunch, router_command
from ragserve.stack.config import LOOPBACK, StackConfig
from ragserve.stack.passthrough import parser_for
from ragserve.stack.process import ChildSpec
from ragserve.vllm_command import zmq_kv_events_config

TOKEN_FILE = "registry-token"  # up passes the files write_token() made in its temporary directory
STORE_TOKEN_FILE = "cachestore-token"


def free_port(host: str = LOOPBACK) -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """n distinct free ports: all bound at once, so none is handed out twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


@dataclass
class Ports:
    router_http: int
    router_grpc: int
    cachestore: int
    cachestore_metrics: int
    redis: int
    engines: list[int]
    kv_events: list[tuple[int, int]] = field(default_factory=list)  # external engines: (PUB, replay) each
    embedding: list[int] = field(default_factory=list)  # the embedding engines'

    @classmethod
    def pick(cls, cfg: StackConfig) -> Ports:
        events = 2 * cfg.engines if cfg.external_engines else 0
        count = 4 + cfg.engines + cfg.embedding_engines + events
        router_grpc, cachestore, cachestore_metrics, redis, *engines = free_ports(count)
        engines, embedding, rest = (
            engines[: cfg.engines], engines[cfg.engines : cfg.engines + cfg.embedding_engines],
            engines[cfg.engines + cfg.embedding_engines :],
        )  # fmt: skip
        kv_events = list(zip(rest[::2], rest[1::2], strict=True))
        taken = engines + embedding + rest + [router_grpc, cachestore, cachestore_metrics, redis]
        router_http = cfg.port
        while not router_http or router_http in taken:
            router_http = free_port(cfg.host)
        return cls(router_http, router_grpc, cachestore, cachestore_metrics, redis, engines, kv_events, embedding)

    def kv_event_endpoints(self, index: int) -> tuple[str, str]:
        """Engine `index`'s KV-event PUB and replay endpoints (external engines)."""
        pub, replay = self.kv_events[index]
        return f"tcp://{LOOPBACK}:{pub}", f"tcp://{LOOPBACK}:{replay}"


def ragserve(*argv: str) -> list[str]:
    return [sys.executable, "-m", "ragserve.cli", *argv]


def write_token(directory: str, name: str) -> str:
    """A fresh shared secret (the router's registry token, the cachestore's), readable by this user only."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    return path


def redis_spec(server: str, port: int, data_dir: str, log_level: str) -> ChildSpec:
    level = {"debug": "verbose", "info": "notice"}.get(log_level, "warning")
    argv = [server, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
    argv += ["--dir", data_dir, "--loglevel", level]
    return ChildSpec("redis", argv, f"redis://{LOOPBACK}:{port}", f"redis://{LOOPBACK}:{port}/0")


def cachestore_spec(
    cfg: StackConfig, ports: Ports, redis_url: str | None, token_file: str = STORE_TOKEN_FILE
) -> ChildSpec:
    launch = CacheStoreLaunch(
        host=LOOPBACK,
        port=ports.cachestore,
        metrics_port=ports.cachestore_metrics,
        memory=cfg.cachestore_memory,
        log_level=cfg.log_level,
        redis=redis_url,
        redis_capacity=cfg.cachestore_memory if redis_url else None,  # a tier below RAM, as large as RAM
        tls=cfg.serving_tls,  # --tls-*: mutual TLS, clients need a certificate signed by --tls-ca
        auth_token_file=token_file,
        otlp_traces_endpoint=cfg.otlp_traces_endpoint,
        extra_args=tuple(cfg.cachestore_flags),
    )
    address = f"{LOOPBACK}:{ports.cachestore}"
    return ChildSpec("cachestore", ragserve(*cachestore_command(launch)), f"grpc://{address}", address)


def router_spec(
    cfg: StackConfig,
    ports: Ports,
    redis_url: str | None,
    token_file: str = TOKEN_FILE,
    store_token: str = STORE_TOKEN_FILE,
) -> ChildSpec:
    launch = RouterLaunch(
        host=cfg.host,
        port=ports.router_http,
        grpc_port=ports.router_grpc,
        policy=cfg.policy,
        log_level=cfg.log_level,
        redis=redis_url,
        drain_timeout=5,
        tls=cfg.serving_tls,  # the gRPC registry, mutual TLS with --tls-*
        registry_token_file=token_file,
        # the router's own Lookups (store-aware routing) carry the store's token and, with --tls-*, certificate
        cachestore_tls=cfg.client_tls if cfg.cachestore else TLSFiles(),
        cachestore_token_file=store_token if cfg.cachestore else None,
        otlp_traces_endpoint=cfg.otlp_traces_endpoint,
        extra_args=tuple(cfg.router_flags),
        **external_router_settings(cfg, ports),
    )
    url = f"http://{_connect_host(cfg.host)}:{ports.router_http}"
    return ChildSpec("router", ragserve(*router_command(launch)), url + "/ready", url)


def engine_spec(
    cfg: StackConfig, ports: Ports, index: int, token_file: str = TOKEN_FILE, store_token: str = STORE_TOKEN_FILE
) -> ChildSpec:
    port = ports.engines[index]
    url = f"http://{LOOPBACK}:{port}"
    pod = EnginePod(
        model=cfg.model,
        served_model_name=cfg.served_model_name,
        host=LOOPBACK,
        port=port,
        engine_id=f"engine-{index}",
        router=None if cfg.external_engines else f"{LOOPBACK}:{ports.router_grpc}",  # external: no registration
        advertise_url=url,
        registry_token_file=token_file,
        router_tls=cfg.client_tls,
        cachestore=(f"{LOOPBACK}:{ports.cachestore}",) if cfg.cachestore else (),
        cachestore_tls=cfg.client_tls,
        cachestore_token_file=store_token,
        log_level=cfg.log_level,
        drain_timeout=5,
        otlp_traces_endpoint=cfg.otlp_traces_endpoint,
        extra_args=tuple(cfg.engine_flags) + kv_events_flags(cfg, ports, index),
    )
    env = {"OMP_NUM_THREADS": str(threads)} if (threads := engine_threads(cfg)) else {}
    return ChildSpec(f"engine-{index}", ragserve(*engine_command(pod)), url + "/ready", url, env)


def embedding_engine_spec(cfg: StackConfig, ports: Ports, index: int, token_file: str = TOKEN_FILE) -> ChildSpec:
    """An embedding engine (`--task embed`): registered with the router like the others, no cachestore."""
    port = ports.embedding[index]
    url = f"http://{LOOPBACK}:{port}"
    pod = EnginePod(
        model=cfg.embedding_model,
        task="embed",
        host=LOOPBACK,
        port=port,
        engine_id=f"embed-{index}",
        router=f"{LOOPBACK}:{ports.router_grpc}",
        advertise_url=url,
        registry_token_file=token_file,
        router_tls=cfg.client_tls,
        log_level=cfg.log_level,
        drain_timeout=5,
        otlp_traces_endpoint=cfg.otlp_traces_endpoint,
    )
    env = {"OMP_NUM_THREADS": str(threads)} if (threads := engine_threads(cfg)) else {}
    return ChildSpec(f"embed-{index}", ragserve(*engine_command(pod)), url + "/ready", url, env)


def external_router_settings(cfg: StackConfig, ports: Ports) -> dict:
    """RouterLaunch settings that follow external engines: one --external-engine each, the model's tokenizer
    and the engines' block size (empty for registered engines)."""
    if not cfg.external_engines:
        return {}
    specs = []
    for i, port in enumerate(ports.engines):
        pub, replay = ports.kv_event_endpoints(i)
        specs.append(ExternalEngineSpec(f"http://{LOOPBACK}:{port}", pub, replay).value())
    return {
        "external_engines": tuple(specs),
        "tokenizer": str(resolve_model(cfg.model).path),  # what the engines tokenize and template with
        "external_block_size": engine_block_size(cfg),
    }


def kv_events_flags(cfg: StackConfig, ports: Ports, index: int) -> tuple[str, ...]:
    """An external engine's vLLM --kv-events-config, on concrete loopback ports (--kv-events-bind)."""
    if not cfg.external_engines:
        return ()
    config = zmq_kv_events_config(*ports.kv_event_endpoints(index))
    return ("--kv-events-config", json.dumps(config), "--kv-events-bind")


def engine_block_size(cfg: StackConfig) -> int:
    """The engines' KV block size: --block-size among the engine flags, else the engine's default."""
    return parser_for("engine").parse_args(cfg.engine_flags).block_size


def engine_threads(cfg: StackConfig) -> int:
    """Torch threads per engine: --engine-threads, else OMP_NUM_THREADS as set (0: leave it), else this
    host's cores divided among the engines, at least 1. Engines on one host each taking every core
    oversubscribe it: two engines prefilling 2,048 tokens at once took ~9 s with 2 threads each on 2
    cores, ~7 s with 1 (docs/router.md)."""
    if cfg.engine_threads:
        return cfg.engine_threads
    if os.environ.get("OMP_NUM_THREADS"):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // cfg.engines)


def _connect_host(host: str) -> str:
    return LOOPBACK if host in ("0.0.0.0", "", "::") else host
