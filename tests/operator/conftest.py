"""The in-memory Kubernetes API (kube_sim.KubeSim, on loopback) and the operator as a real subprocess
against it.

`kube` + `operator` / `run_operator` give a test its own API and operator. Every call the operator makes
is checked against the chart's RBAC rules when its API closes (rbac.py), and collected for
test_rbac_coverage.py, which runs last and only where the whole directory runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import kmock
import pytest
import pytest_asyncio
from kmock._internal import parsing as kmock_parsing

from ragserve_operator.crd import pool_crd
from ragserve_operator.spec import POOL_KIND
from tests.helpers.net import free_ports as _free_ports
from tests.helpers.process import Proc, start, until_async
from tests.helpers.ragserve_cr import NS, POOLS, RAGSERVES
from tests.operator import rbac
from tests.operator.kube_sim import KubeSim

_parse_path = kmock_parsing.parse_path
GATEWAY_RESOURCES = {
    "inference.networking.k8s.io/v1/inferencepools": "InferencePool",
    "gateway.networking.k8s.io/v1/httproutes": "HTTPRoute",
}


def _parse_path_fixed(path: str) -> kmock_parsing.ParsedPath:
    # kmock reads /api/v1/namespaces as "namespace <missing>": it is the cluster-scoped list of namespaces
    if path.rstrip("/") == "/api/v1/namespaces":
        return kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _parse_path(path)


def kubeconfig(url: str, path: Path) -> Path:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: sim, cluster: {{server: "{url}"}}}}]
users: [{{name: sim, user: {{token: test-token}}}}]
contexts: [{{name: sim, context: {{cluster: sim, user: sim, namespace: {NS}}}}}]
current-context: sim
"""
    )
    return path


@contextlib.asynccontextmanager
async def serving_kube(check: Callable[[set], None] = rbac.check_operator_calls) -> AsyncIterator[KubeSim]:
    """A KubeSim on loopback with the test namespace, the RAGServe kinds, KEDA's ScaledObject, InferencePool and
    HTTPRoute; at the end, every call a client made is checked against the chart's RBAC (the operator's unless
    told)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kmock_parsing, "parse_path", _parse_path_fixed)
        async with KubeSim() as sim, kmock.Server(sim):
            sim.resources.load_bundled()
            verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
            sim.resources[RAGSERVES] = kmock.ResourceInfo(
                kind="RAGServe", singular="ragserve", namespaced=True, subresources={"status"}, verbs=verbs
            )
            sim.resources[POOLS] = kmock.ResourceInfo(
                kind=POOL_KIND,
                singular=POOL_KIND.lower(),
                namespaced=True,
                subresources={"status", "scale"},
                verbs=verbs,
            )
            sim.scale_paths = {kmock.resource(POOLS): pool_crd()["spec"]["versions"][0]["subresources"]["scale"]}
            sim.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
                kind="ScaledObject", singular="scaledobject", namespaced=True, verbs=verbs
            )
            for resource, kind in GATEWAY_RESOURCES.items():  # the upstream CRDs spec.gateway.inferencePool needs
                sim.resources[resource] = kmock.ResourceInfo(
                    kind=kind, singular=kind.lower(), namespaced=True, subresources={"status"}, verbs=verbs
                )
            async with sim.post("/api/v1/namespaces", json={"metadata": {"name": NS}}) as response:
                assert response.status < 300
            yield sim
            check(sim.calls)
            if check is rbac.check_operator_calls:
                rbac.OPERATOR_CALLS.update(sim.calls)


COVERAGE = "test_rbac_coverage.py"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """test_rbac_coverage.py last (after any shuffling), and only when every module here is collected:
    what it checks is what the whole suite's calls used."""
    here = Path(__file__).parent
    coverage = [i for i in items if i.path.name == COVERAGE]
    if not coverage:
        return
    modules = {i.path.name for i in items if i.path.parent == here}
    complete = {p.name for p in here.glob("test_*.py")} <= modules
    items[:] = [i for i in items if i.path.name != COVERAGE] + (coverage if complete else [])
    if not complete:
        config.hook.pytest_deselected(items=coverage)


@pytest_asyncio.fixture
async def kube() -> AsyncIterator[KubeSim]:
    async with serving_kube() as sim:
        yield sim


def start_operator(sim: KubeSim, tmp_path: Path, port: int, metrics_port: int) -> Proc:
    config = kubeconfig(str(sim.url).rstrip("/"), tmp_path / "kubeconfig.yaml")
    args = [
        "operator",
        "--namespace",
        NS,
        "--kubeconfig",
        str(config),
        "--liveness",
        f"http://127.0.0.1:{port}/healthz",
        "--metrics-address",
        f"127.0.0.1:{metrics_port}",
        "--retry-delay",  # a refused apply is retried in 1 s, not 15: the tests wait for the retry
        "1",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGSERVE_") and k != "KUBECONFIG"}
    return start("operator", [sys.executable, "-m", "ragserve.cli", *args], tmp_path / "operator.log", env=env)


@dataclass
class Operators:
    """The operator processes started against one KubeSim: run() stops the last one and starts another."""

    kube: KubeSim
    tmp_path: Path
    port: int
    metrics_port: int
    procs: list[Proc] = field(default_factory=list)

    @property
    def current(self) -> subprocess.Popen:
        return self.procs[-1].popen

    async def run(self) -> subprocess.Popen:
        for old in self.procs:
            await old.stop_async()
        self.kube._requests.clear()  # so the readiness check below sees this process's watches
        proc = start_operator(self.kube, self.tmp_path, self.port, self.metrics_port)
        self.procs.append(proc)
        await until_async(lambda: _alive(proc, self.port), timeout=60, what="operator liveness endpoint")
        # kmock's watches ignore resourceVersion (events between a list and its watch are lost): wait for them
        await until_async(lambda: _watching(self.kube), timeout=60, what="the operator's watch streams")
        return proc.popen

    async def stop(self) -> None:
        """Stop every process without blocking the loop: kmock serves their last requests meanwhile."""
        for proc in self.procs:
            await proc.stop_async()
        print((self.tmp_path / "operator.log").read_text()[-20000:])


@pytest_asyncio.fixture
async def run_operator(kube: KubeSim, tmp_path: Path, port: int, metrics_port: int) -> AsyncIterator[Callable]:
    """Start the operator (stopping the previous one first); every process is stopped at teardown."""
    operators = Operators(kube, tmp_path, port, metrics_port)
    try:
        yield operators.run
    finally:
        await operators.stop()


@pytest_asyncio.fixture
async def operator(run_operator: Callable) -> subprocess.Popen:
    return await run_operator()


WATCHED = ("ragserves", "ragserveenginepools", "deployments", "statefulsets", "services", "configmaps")


def _watching(sim: KubeSim) -> bool:
    watched = {str(r.url.path).rsplit("/", 1)[-1] for r in sim._requests if r.params.get("watch") == "true"}
    return set(WATCHED) <= watched


async def _alive(proc: Proc, port: int) -> bool:
    assert proc.alive(), "operator exited"
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.write(b"GET /healthz HTTP/1.0\r\n\r\n")
    line = await reader.readline()
    writer.close()
    return b" 200 " in line


@pytest.fixture
def metrics_port() -> int:
    """Where the operator under test serves its Prometheus /metrics."""
    return _free_ports(1)[0]


@pytest.fixture
def free_ports() -> Callable[[int], list[int]]:
    return _free_ports


@pytest.fixture
def eventually() -> Callable:
    """await eventually(check, what=..., timeout=...): tests.helpers.process.until_async."""
    return until_async


@pytest.fixture
def engine_pod() -> Callable[[str, str, str, int], dict]:
    return _engine_pod


def _engine_pod(name: str, pool: str, instance: str, port: int) -> dict:
    """A ready engine pod of `pool` in RAGServe `instance`, its HTTP port on loopback (its /metrics is read)."""
    labels = {
        "app.kubernetes.io/name": "ragserve",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": "engine",
        "ragserve.dev/pool": pool,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }
