"""Cachestore fixtures: in-process servers, `ragserve cachestore` subprocesses, a real redis-server, test certificates.

Everything binds 127.0.0.1 on free ports and is stopped by the test that started it.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from ragserve_cachestore.server import CacheStoreConfig, CacheStoreServer
from tests.helpers.cachestore import wait_serving
from tests.helpers.net import free_port
from tests.helpers.pki import write_test_pki


@pytest.fixture
def make_server():
    """Start in-process cachestores: make_server(**CacheStoreConfig fields) -> (server, 'host:port')."""
    started: list[CacheStoreServer] = []

    def make(**overrides) -> tuple[CacheStoreServer, str]:
        config = CacheStoreConfig(**{"host": "127.0.0.1", "port": 0, "metrics_port": 0, **overrides})
        server = CacheStoreServer(config)
        started.append(server)
        port = server.start()
        return server, f"127.0.0.1:{port}"

    yield make
    for server in started:
        server.stop(grace=0)


class CacheStoreProcess:
    """A real `ragserve cachestore` subprocess."""

    def __init__(self, port: int, *args: str, env: dict | None = None) -> None:
        self.port, self.address = port, f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "ragserve.cli", "cachestore", "--host", "127.0.0.1", "--port", str(port), *args]
        if "--metrics-port" not in args:
            cmd += ["--metrics-port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def wait_serving(self, credentials: grpc.ChannelCredentials | None = None) -> CacheStoreProcess:
        try:
            wait_serving(self.address, credentials=credentials)
        except TimeoutError:
            self.stop()
            raise AssertionError(f"cachestore did not start:\n{self.proc.stdout.read()}") from None
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def cachestore_process():
    """Start `ragserve cachestore` processes: cachestore_process(*flags, port=None) -> CacheStoreProcess (serving)."""
    started: list[CacheStoreProcess] = []

    def start(*args: str, port: int | None = None, wait: bool = True, env: dict | None = None) -> CacheStoreProcess:
        proc = CacheStoreProcess(port or free_port(), *args, env=env)
        started.append(proc)
        return proc.wait_serving() if wait else proc

    yield start
    for proc in started:
        proc.stop()
        if proc.proc.stdout:
            proc.proc.stdout.close()


@pytest.fixture
def redis_url(tmp_path):
    """A real, throwaway redis-server on a free port (no persistence)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> dict[str, Path]:
    """PEM files: a CA, a server cert for 127.0.0.1/localhost, a client cert, and a client cert from another CA."""
    return write_test_pki(tmp_path_factory.mktemp("pki"))
