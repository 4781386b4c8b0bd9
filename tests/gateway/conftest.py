"""Endpoint picker fixtures: the router test fixtures (tests/router/conftest.py: real router and engine processes
on loopback ports), plus a router serving the ext_proc protocol and an Envoy-like client for it."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from tests.helpers import envoy
from tests.helpers.net import free_port
from tests.router.conftest import Cluster, Server, metrics, model_dir, until  # noqa: F401 (fixtures)

ENGINE_FLAGS = ("--num-gpu-blocks", "1024", "--max-model-len", "4096")


@dataclass
class Picker:
    """A router with --epp-port, and the Envoy-like client of its ext_proc port."""

    router: Server
    epp_port: int
    envoy: envoy.Envoy

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.epp_port}"


def epp_router(cluster: Cluster, *flags: str, tls: bool = True, name: str = "epp-router") -> Picker:
    port = free_port()
    tls_flags = () if tls else ("--epp-plaintext",)
    router = cluster.router("--epp-port", str(port), *tls_flags, *flags, name=name)
    return Picker(router, port, envoy.Envoy(f"127.0.0.1:{port}", tls=tls))


def endpoint(engine: Server) -> str:
    return f"127.0.0.1:{engine.port}"


def registered(router: Server) -> int:
    return httpx.get(router.url + "/ready", timeout=5).json()["engines"]


@pytest.fixture(scope="module")
def gateway_cluster(tmp_path_factory, model_dir):  # noqa: F811 (the imported fixture)
    c = Cluster(tmp_path_factory.mktemp("gateway"), model_dir)
    yield c
    c.stop_all()
