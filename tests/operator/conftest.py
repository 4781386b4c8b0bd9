"""An in-memory Kubernetes API (kmock) on loopback, and the operator as a real subprocess against it.

kmock's emulator stores objects and streams watch events but is no API server; KubeSim adds the few
server behaviours the operator relies on: uid / creationTimestamp / generation / resourceVersion,
generation bumps on spec changes, generateName, the namespace from the URL, and listing the
cluster-scoped namespaces.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import kmock
import pytest
import pytest_asyncio
from kmock._internal import dicts as kmock_dicts
from kmock._internal import parsing as kmock_parsing

from tests.helpers.net import free_ports as _free_ports
from tests.helpers.process import Proc, start, until_async
from tests.helpers.ragserve_cr import NS, RAGSERVES

_parse_path = kmock_parsing.parse_path


def _parse_path_fixed(path: str) -> kmock_parsing.ParsedPath:
    # kmock reads /api/v1/namespaces as "namespace <missing>": it is the cluster-scoped list of namespaces
    if path.rstrip("/") == "/api/v1/namespaces":
        return kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _parse_path(path)


class KubeSim(kmock.KubernetesEmulator):
    namespace = NS
    _version = 0

    def obj(self, resource: str | kmock.resource, name: str, namespace: str = NS) -> dict | None:
        """The stored object (e.g. obj("apps/v1/deployments", "x")), None if absent or deleted."""
        key = (kmock.resource(resource), namespace, name)
        return None if key not in self.objects or self.objects[key].deleted else self.objects[key].raw

    def events(self) -> list[dict]:
        return [o.raw for (r, _, _), o in self.objects.items() if r == "v1/events" and not o.deleted]

    async def call(self, method: str, path: str, body: dict | None = None) -> dict:
        async with self.request(method, path, json=body) as response:
            assert response.status < 300, await response.text()
            return await response.json()

    async def _handle(self, request: kmock.Request):
        data = request.data
        if request.resource is not None and request.action == kmock.action.UPDATE and isinstance(data, list):
            # a JSON patch (kopf's, guarded by a "test" of resourceVersion): 422 on a stale version, as the
            # API server answers, else apply it and bump the version
            self._check_version(request, data)
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_version()})
        elif request.resource is not None and isinstance(data, dict):
            if request.action in (kmock.action.CREATE, kmock.action.UPDATE):
                data.setdefault("metadata", {})["resourceVersion"] = self._next_version()
            if request.action == kmock.action.CREATE:
                meta = data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:6]
                if request.namespace:
                    meta.setdefault("namespace", request.namespace)
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).isoformat())
            elif request.action == kmock.action.UPDATE and request.subresource is None and "spec" in data:
                self._bump_generation(request, data)
        return await super()._handle(request)

    def _check_version(self, request: kmock.Request, ops: list) -> None:
        live = self.obj(request.resource, request.name, request.namespace) or {}
        current = live.get("metadata", {}).get("resourceVersion")
        for op in ops:
            if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion" and op["value"] != current:
                raise kmock.KubernetesError(status=422, reason="Invalid", message="resourceVersion changed")

    def _next_version(self) -> str:
        KubeSim._version += 1
        return str(KubeSim._version)

    def _bump_generation(self, request: kmock.Request, data: dict) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return
        live = self.objects[key].raw
        merged = kmock_dicts.patch_dict(copy.deepcopy(live), data)
        if merged.get("spec") != live.get("spec"):
            data.setdefault("metadata", {})["generation"] = live.get("metadata", {}).get("generation", 1) + 1


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


@pytest_asyncio.fixture
async def kube(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeSim]:
    monkeypatch.setattr(kmock_parsing, "parse_path", _parse_path_fixed)
    async with KubeSim() as sim, kmock.Server(sim):
        sim.resources.load_bundled()
        verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
        sim.resources[RAGSERVES] = kmock.ResourceInfo(
            kind="RAGServe", singular="ragserve", namespaced=True, subresources={"status"}, verbs=verbs
        )
        sim.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
            kind="ScaledObject", singular="scaledobject", namespaced=True, verbs=verbs
        )
        async with sim.post("/api/v1/namespaces", json={"metadata": {"name": NS}}) as response:
            assert response.status < 300
        yield sim


def start_operator(sim: KubeSim, tmp_path: Path, port: int) -> Proc:
    config = kubeconfig(str(sim.url).rstrip("/"), tmp_path / "kubeconfig.yaml")
    args = [
        "operator",
        "--namespace",
        NS,
        "--kubeconfig",
        str(config),
        "--liveness",
        f"http://127.0.0.1:{port}/healthz",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGSERVE_") and k != "KUBECONFIG"}
    return start("operator", [sys.executable, "-m", "ragserve.cli", *args], tmp_path / "operator.log", env=env)


@pytest_asyncio.fixture
async def run_operator(kube: KubeSim, tmp_path: Path, port: int) -> AsyncIterator[Callable]:
    """Start the operator (stopping the previous one first); every process is stopped at teardown, without
    blocking the loop: kmock serves the operator's last requests meanwhile."""
    procs: list[Proc] = []

    async def run() -> subprocess.Popen:
        for old in procs:
            await old.stop_async()
        kube._requests.clear()  # so the readiness check below sees this process's watches
        proc = start_operator(kube, tmp_path, port)
        procs.append(proc)
        await until_async(lambda: _alive(proc, port), timeout=60, what="operator liveness endpoint")
        # kmock's watches ignore resourceVersion (events between a list and its watch are lost): wait for them
        await until_async(lambda: _watching(kube), timeout=60, what="the operator's watch streams")
        return proc.popen

    try:
        yield run
    finally:
        for proc in procs:
            await proc.stop_async()
        print((tmp_path / "operator.log").read_text()[-20000:])


@pytest_asyncio.fixture
async def operator(run_operator: Callable) -> subprocess.Popen:
    return await run_operator()


WATCHED = ("ragserves", "deployments", "statefulsets", "services", "configmaps")


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
