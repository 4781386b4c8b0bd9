"""What `ragserve up` starts: one dataclass of settings, and the command line of every child."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass, field, fields

from ragserve.engine_args import EngineConfig
from ragserve.logs import LOG_LEVELS
from ragserve.model_source import DEFAULT_MODEL
from ragserve.stack.process import ChildSpec

LOOPBACK = "127.0.0.1"
TOKEN_FILE = "registry-token"  # up passes the files write_token() made in its temporary directory
STORE_TOKEN_FILE = "cachestore-token"
# engine flags `ragserve up` sets itself, per engine
ENGINE_OWN = {"model", "served_model_name"}


def router_policies() -> tuple[str, ...]:
    """The router's registered policy names; none where the router is not installed (an engine image): `up`
    cannot run there, but every other command must still parse."""
    try:
        from ragserve_router.policies import POLICIES
    except ModuleNotFoundError as exc:
        if exc.name != "ragserve_router":
            raise
        return ()
    return tuple(POLICIES)


POLICIES = router_policies()


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
class StackConfig:
    engines: int = 2
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    host: str = LOOPBACK  # the router's bind address; everything else stays on loopback
    port: int = 8080  # router HTTP; 0 picks a free port
    policy: str = "kv_aware"
    redis: str = "auto"  # auto | off | redis://URL
    cachestore: bool = True
    cachestore_memory: int = 1024**3
    engine_flags: list[str] = field(default_factory=list)  # passed to every engine
    engine_threads: int = 0  # torch threads per engine; 0: the host's cores shared out (engine_threads())
    router_flags: list[str] = field(default_factory=list)
    log_level: str = "info"
    ready_timeout: float = 600.0
    grace: float = 15.0

    def __post_init__(self) -> None:
        checks = [
            (bool(POLICIES), "ragserve up starts a router: install ragserve-router"),
            (self.engines >= 1, f"--engines must be >= 1, got {self.engines}"),
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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StackConfig:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["cachestore"] = not args.no_cachestore
        values["engine_flags"] = engine_flags(args) + _flag_list(args.engine_arg)
        values["router_flags"] = _flag_list(args.router_arg)
        return cls(**values)

    @property
    def redis_server(self) -> str | None:
        """Path of redis-server when this stack should start one."""
        return shutil.which("redis-server") if self.redis == "auto" else None


def _flag_list(value: list[str] | str | None) -> list[str]:
    """--engine-arg values; from the environment they arrive as one shell-quoted string."""
    if isinstance(value, str):
        return shlex.split(value)
    return list(value or [])


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given to `ragserve up` that differ from the engine's defaults, as argv."""
    out: list[str] = []
    for f in fields(EngineConfig):
        if f.name in ENGINE_OWN or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


@dataclass
class Ports:
    router_http: int
    router_grpc: int
    cachestore: int
    cachestore_metrics: int
    redis: int
    engines: list[int]

    @classmethod
    def pick(cls, cfg: StackConfig) -> Ports:
        router_grpc, cachestore, cachestore_metrics, redis, *engines = free_ports(4 + cfg.engines)
        router_http = cfg.port
        while not router_http or router_http in engines + [router_grpc, cachestore, cachestore_metrics, redis]:
            router_http = free_port(cfg.host)
        return cls(router_http, router_grpc, cachestore, cachestore_metrics, redis, engines)


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
    argv = ragserve("cachestore", "--host", LOOPBACK, "--port", str(ports.cachestore))
    argv += ["--auth-token-file", token_file]
    argv += ["--metrics-port", str(ports.cachestore_metrics), "--memory", str(cfg.cachestore_memory)]
    argv += ["--log-level", cfg.log_level.upper()]
    if redis_url:  # a tier below RAM, as large as RAM
        argv += ["--redis", redis_url, "--redis-capacity", str(cfg.cachestore_memory)]
    address = f"{LOOPBACK}:{ports.cachestore}"
    return ChildSpec("cachestore", argv, f"grpc://{address}", address)


def router_spec(
    cfg: StackConfig,
    ports: Ports,
    redis_url: str | None,
    token_file: str = TOKEN_FILE,
    store_token: str = STORE_TOKEN_FILE,
) -> ChildSpec:
    argv = ragserve("router", "--host", cfg.host, "--port", str(ports.router_http))
    argv += ["--grpc-port", str(ports.router_grpc), "--policy", cfg.policy, "--log-level", cfg.log_level]
    argv += ["--registry-token-file", token_file]
    if cfg.cachestore:  # the router's own Lookups (store-aware routing) carry the store's token
        argv += ["--cachestore-token-file", store_token]
    argv += ["--drain-timeout", "5"]
    if redis_url:
        argv += ["--redis", redis_url]
    url = f"http://{_connect_host(cfg.host)}:{ports.router_http}"
    return ChildSpec("router", argv + cfg.router_flags, url + "/ready", url)


def engine_spec(
    cfg: StackConfig, ports: Ports, index: int, token_file: str = TOKEN_FILE, store_token: str = STORE_TOKEN_FILE
) -> ChildSpec:
    port = ports.engines[index]
    url = f"http://{LOOPBACK}:{port}"
    argv = ragserve("engine", "--host", LOOPBACK, "--port", str(port), "--model", cfg.model)
    if cfg.served_model_name:
        argv += ["--served-model-name", cfg.served_model_name]
    argv += ["--engine-id", f"engine-{index}", "--router", f"{LOOPBACK}:{ports.router_grpc}"]
    argv += ["--registry-token-file", token_file]
    argv += ["--advertise-url", url, "--drain-timeout", "5", "--log-level", cfg.log_level]
    if cfg.cachestore:
        argv += ["--cachestore", f"{LOOPBACK}:{ports.cachestore}", "--cachestore-token-file", store_token]
    env = {"OMP_NUM_THREADS": str(threads)} if (threads := engine_threads(cfg)) else {}
    return ChildSpec(f"engine-{index}", argv + cfg.engine_flags, url + "/ready", url, env)


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
