"""Cachestore fixtures: in-process servers, `ragserve cachestore` subprocesses, a real redis-server, test certificates.

Everything binds 127.0.0.1 on free ports and is stopped by the test that started it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ragserve.cachestore_args import CacheStoreConfig
from ragserve_cachestore.server import CacheStoreServer
from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.net import free_port
from tests.helpers.pki import write_test_pki
from tests.helpers.process import start_redis


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


@pytest.fixture
def cachestore_process(tmp_path_factory):
    """Start `ragserve cachestore` processes: cachestore_process(*flags, port=None) -> CacheStoreProcess (serving)."""
    logs = tmp_path_factory.mktemp("cachestore-logs")
    started: list[CacheStoreProcess] = []

    def run(*args: str, port: int | None = None, wait: bool = True, env: dict | None = None) -> CacheStoreProcess:
        proc = CacheStoreProcess(logs / f"cachestore-{len(started)}.log", port or free_port(), *args, env=env)
        started.append(proc)
        return proc.wait_serving() if wait else proc

    yield run
    for proc in started:
        proc.stop()


@pytest.fixture
def redis_url(tmp_path_factory):
    """A real, throwaway redis-server on a free port (no persistence)."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.stop()


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> dict[str, Path]:
    """PEM files: a CA, a server cert for 127.0.0.1/localhost, a client cert, and a client cert from another CA."""
    return write_test_pki(tmp_path_factory.mktemp("pki"))
