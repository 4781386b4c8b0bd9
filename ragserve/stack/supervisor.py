"""Start, watch and stop a local stack: Redis (optional), cachestore, router, N engines.

A child that exits on its own, before or after the stack is ready, stops the whole stack:
`ragserve up` reports it with the child's last log lines and exits 1 (no restarts: a crash
on a laptop is a bug to see, not to hide).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time

from ragserve.stack import health
from ragserve.stack.config import StackConfig
from ragserve.stack.process import Child, ChildSpec, LogSink, stop_all
from ragserve.stack.spec import (
    Ports,
    cachestore_spec,
    embedding_engine_spec,
    engine_spec,
    redis_spec,
    router_spec,
    write_token,
)

POLL_S = 0.25
PROGRESS_EVERY_S = 10.0


class StackError(RuntimeError):
    """A child failed (exited or never became ready); the message carries its last log lines."""


class Stack:
    def __init__(self, cfg: StackConfig, sink: LogSink | None = None) -> None:
        self.cfg = cfg
        self.sink = sink or LogSink()
        self.ports = Ports.pick(cfg)
        self.children: list[Child] = []
        self.redis_url: str | None = None if cfg.redis in ("auto", "off") else cfg.redis
        self._tmp: str | None = None
        self._stopped = False
        self.prometheus_url: str | None = None
        self._grpc_credentials = grpc_credentials(cfg)  # the cachestore's readiness probe, over TLS with --tls-*

    # -- what users and scripts need --------------------------------------------------------
    @property
    def url(self) -> str:
        return self.child("router").spec.url

    @property
    def embedding_model_name(self) -> str | None:
        """The model name the embedding engines serve (None without any)."""
        return self.cfg.embedding_model if self.cfg.embedding_engines else None

    @property
    def engine_urls(self) -> list[str]:
        return [c.spec.url for c in self.children if c.name.startswith("engine-")]

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def state(self) -> dict:
        return {
            "url": self.url,
            "engines": self.engine_urls,
            "embedding_engines": [c.spec.url for c in self.children if c.name.startswith("embed-")],
            "embedding_model": self.embedding_model_name,
            "cachestore": self.child("cachestore").spec.url if self.cfg.cachestore else None,
            "registry": f"127.0.0.1:{self.ports.router_grpc}",  # the router's gRPC registry (engines register)
            "cachestore_metrics": f"http://127.0.0.1:{self.ports.cachestore_metrics}" if self.cfg.cachestore else None,
            "prometheus": self.prometheus_url,  # ragserve up --monitoring
            "redis": self.redis_url,
            "pids": {c.name: c.pid for c in self.children},
        }

    def say(self, text: str) -> None:
        self.sink.say(f"{self.sink.prefix('up', 7)} {text}")

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, stop: threading.Event | None = None) -> bool:
        """Start everything and wait until ready; False if stop was set meanwhile. Raises StackError."""
        stop = stop or threading.Event()
        env = child_env()
        server = self.cfg.redis_server
        if self.cfg.redis == "auto" and server is None:
            self.say("redis-server not found: router state stays in memory (--redis off)")
        self._tmp = tempfile.mkdtemp(prefix="ragserve-up-")
        token = write_token(self._tmp, "registry-token")  # engines register with it; nobody else can
        store_token = write_token(self._tmp, "cachestore-token")  # engines and router use the store; nobody else
        if server:
            os.mkdir(data := os.path.join(self._tmp, "redis"))
            redis = self._spawn(redis_spec(server, self.ports.redis, data, self.cfg.log_level), env)
            if not self._wait([redis], stop):
                return False
            self.redis_url = redis.spec.url
        first = [router_spec(self.cfg, self.ports, self.redis_url, token, store_token)]
        if self.cfg.cachestore:
            first.insert(0, cachestore_spec(self.cfg, self.ports, self.redis_url, store_token))
        started = [self._spawn(spec, env) for spec in first]
        started += [
            self._spawn(engine_spec(self.cfg, self.ports, i, token, store_token), env) for i in range(self.cfg.engines)
        ]
        started += [
            self._spawn(embedding_engine_spec(self.cfg, self.ports, i, token), env)
            for i in range(self.cfg.embedding_engines)
        ]
        return self._wait(started, stop) and self._wait_registered(stop)

    def _spawn(self, spec: ChildSpec, env: dict[str, str]) -> Child:
        child = Child(spec, self.sink, index=len(self.children))
        self.children.append(child)
        child.start(env)
        self.say(f"started {spec.name} (pid {child.pid})")
        return child

    def _wait(self, pending: list[Child], stop: threading.Event) -> bool:
        pending = list(pending)
        t0 = last_report = time.monotonic()
        while pending:
            self.check_alive()
            for child in list(pending):
                if health.check(child.spec.probe, timeout=1.0, credentials=self._grpc_credentials):
                    pending.remove(child)
                    self.say(f"{child.name} ready in {time.monotonic() - child.started_at:.1f}s: {child.spec.url}")
            now = time.monotonic()
            if pending and now - t0 > self.cfg.ready_timeout:
                names = ", ".join(c.name for c in pending)
                raise StackError(f"not ready after {self.cfg.ready_timeout:.0f}s: {names}")
            if pending and now - last_report >= PROGRESS_EVERY_S:
                last_report = now
                self.say(f"waiting for {', '.join(c.name for c in pending)} ({now - t0:.0f}s)")
            if pending and stop.wait(POLL_S):
                return False
        return True

    def _wait_registered(self, stop: threading.Event) -> bool:
        """Engines are ready once loaded; the router must also have them registered and healthy."""
        t0 = time.monotonic()
        while True:
            self.check_alive()
            status, body = health.http_get(self.url + "/ready")
            wanted = self.cfg.engines + self.cfg.embedding_engines
            if status == 200 and body.get("healthy_engines", 0) >= wanted:
                self.say(f"router has {body['healthy_engines']}/{wanted} engines registered and healthy")
                return True
            if time.monotonic() - t0 > self.cfg.ready_timeout:
                raise StackError(f"router sees {body.get('healthy_engines', 0)}/{wanted} healthy engines")
            if stop.wait(POLL_S):
                return False

    def check_alive(self, ignore: tuple[Child, ...] = ()) -> None:
        """Raise StackError if a child has exited."""
        for child in self.children:
            code = child.poll()
            if code is not None and child not in ignore:
                child.wait(1)  # let the log pump drain
                tail = "\n".join(f"    {line}" for line in list(child.tail)[-15:])
                raise StackError(f"{child.name} (pid {child.pid}) exited with code {code}; last lines:\n{tail}")

    def watch(self, stop: threading.Event) -> None:
        """Return when stop is set; raise StackError when a child exits on its own."""
        while not stop.wait(POLL_S):
            self.check_alive()

    def stop(self) -> None:
        """Stop engines first (they deregister), then router, cachestore, Redis."""
        if self._stopped:
            return
        self._stopped = True
        running = [c for c in self.children if c.poll() is None]
        if running:
            self.say(f"stopping {', '.join(c.name for c in running)}")
        engines = [c for c in running if c.name.startswith(("engine-", "embed-"))]
        stop_all(engines, self.cfg.grace, self.say)
        stop_all([c for c in running if c not in engines], self.cfg.grace, self.say)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def kill(self) -> None:
        """Second Ctrl-C: no more grace."""
        for child in self.children:
            child.signal(signal.SIGKILL)

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def grpc_credentials(cfg: StackConfig):
    """grpc.ChannelCredentials presenting the stack's certificate (mutual TLS), None without --tls-*."""
    if not cfg.tls_cert:
        return None
    from ragserve.tls import channel_credentials

    files = cfg.client_tls
    return channel_credentials(files.ca, files.cert, files.key)


def child_env() -> dict[str, str]:
    """Our environment without RAGSERVE_* flags (they configure `ragserve up`, which passes flags explicitly);
    RAGSERVE_CACHE_DIR, a place and no flag, stays, so children build and find their caches where we would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGSERVE_") or k == "RAGSERVE_CACHE_DIR"}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env
