"""An in-memory Kubernetes API (kmock) on loopback, and the operator as a real subprocess against it.

kmock's emulator stores objects and streams watch events but is no API server; KubeSim adds the
server behaviours the operator relies on: uid / creationTimestamp / generation / resourceVersion,
generation bumps on spec changes, generateName, the namespace from the URL, listing the cluster-scoped
namespaces, server-side apply with field ownership (server_side_apply.py: managedFields on every write,
apply patches, conflicts) and the `scale` subresource of custom resources that declare one.
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

import aiohttp.web
import kmock
import pytest
import pytest_asyncio
from kmock._internal import dicts as kmock_dicts
from kmock._internal import parsing as kmock_parsing

from ragserve_operator.crd import pool_crd
from ragserve_operator.spec import POOL_KIND
from tests.helpers.net import free_ports as _free_ports
from tests.helpers.process import Proc, start, until_async
from tests.helpers.ragserve_cr import NS, POOLS, RAGSERVES
from tests.operator import server_side_apply as ssa

_parse_path = kmock_parsing.parse_path
APPLY_PATCH = "application/apply-patch+yaml"


def _parse_path_fixed(path: str) -> kmock_parsing.ParsedPath:
    # kmock reads /api/v1/namespaces as "namespace <missing>": it is the cluster-scoped list of namespaces
    if path.rstrip("/") == "/api/v1/namespaces":
        return kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces")
    return _parse_path(path)


class KubeSim(kmock.KubernetesEmulator):
    namespace = NS
    _version = 0
    scale_paths: dict = {}  # resource -> the CRD's scale subresource (specReplicasPath, ...)

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
        if request.resource is not None and request.subresource == "scale":
            return await self._serve_scale(request)
        if request.resource is not None and request.action == kmock.action.UPDATE and _is_apply(request):
            return await self._serve_apply(request)
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
        if request.resource is not None and request.subresource is None:
            self._record_update(request)
        return await super()._handle(request)

    def _record_update(self, request: kmock.Request) -> None:
        """managedFields after a create, merge patch or JSON patch: its manager owns what it changed."""
        data, manager = request.data, _manager(request)
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            data["metadata"]["managedFields"] = ssa.update(None, copy.deepcopy(data), manager)["metadata"][
                "managedFields"
            ]
            return
        live = self.obj(request.resource, request.name, request.namespace) if request.name else None
        if request.action != kmock.action.UPDATE or live is None or not isinstance(data, dict | list):
            return
        new = kmock_dicts.patch_dict(copy.deepcopy(live), data)
        fields = ssa.update(live, copy.deepcopy(dict(new)), manager)["metadata"]["managedFields"]
        if isinstance(data, dict):
            data.setdefault("metadata", {})["managedFields"] = fields
        else:
            data.append({"op": "add", "path": "/metadata/managedFields", "value": fields})

    async def _serve_apply(self, request: kmock.Request) -> aiohttp.web.Response:
        """PATCH with application/apply-patch+yaml: create or merge, as the manager's whole intent."""
        manager = request.params.get("fieldManager")
        if not manager or not isinstance(request.data, dict):
            return _status(422, "Invalid", "fieldManager is required for apply patches")
        live = self.obj(request.resource, request.name, request.namespace)
        try:
            new = ssa.apply(live, request.data, manager, force=request.params.get("force") == "true")
        except ssa.Conflict as exc:
            return aiohttp.web.json_response(exc.status(), status=409)
        return aiohttp.web.json_response(await self._store(request, live, new))

    async def _serve_scale(self, request: kmock.Request) -> aiohttp.web.Response:
        """The `scale` subresource: an autoscaling/v1 Scale view of the paths the CRD declares."""
        paths = self.scale_paths.get(request.resource)
        live = self.obj(request.resource, request.name, request.namespace)
        if paths is None or live is None:
            return _status(404, "NotFound", f"{request.resource} {request.name} has no scale subresource")
        if request.action == kmock.action.UPDATE or request.method.upper() == "PUT":
            replicas = ((request.data or {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return _status(422, "Invalid", "spec.replicas: must be a non-negative integer")
            new = copy.deepcopy(live)
            _set(new, paths["specReplicasPath"], replicas)
            live = await self._store(request, live, ssa.update(live, new, _manager(request)))
        return aiohttp.web.json_response(
            {
                "apiVersion": "autoscaling/v1",
                "kind": "Scale",
                "metadata": {k: live["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion")},
                "spec": {"replicas": _get(live, paths["specReplicasPath"])},
                "status": {
                    "replicas": _get(live, paths["statusReplicasPath"]) or 0,
                    "selector": _get(live, paths.get("labelSelectorPath", "")) or "",
                },
            }
        )

    async def _store(self, request: kmock.Request, live: dict | None, new: dict) -> dict:
        """Write `new` (created when `live` is None) and stream the event; a write that changes nothing
        is no write (same resourceVersion, no event), as on the API server."""
        if live is not None and new == live:
            return live
        meta = new.setdefault("metadata", {})
        meta["resourceVersion"] = self._next_version()
        if live is None:
            meta.update(name=request.name, namespace=request.namespace, uid=str(uuid.uuid4()), generation=1)
            meta["creationTimestamp"] = datetime.datetime.now(datetime.UTC).isoformat()
        elif new.get("spec") != live.get("spec"):
            meta["generation"] = live["metadata"].get("generation", 1) + 1
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects:
                self.objects[key] = new
            elif live is None:
                self.objects[key].create(new)
            else:
                self.objects[key].patch([{"op": "replace", "path": "", "value": new}])
            raw = self.objects[key].raw
            await self._buses[request.resource].put({"type": "ADDED" if live is None else "MODIFIED", "object": raw})
        return raw

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


def _is_apply(request: kmock.Request) -> bool:
    headers = {k.lower(): v for k, v in request.headers.items()}
    return headers.get("content-type", "").split(";")[0].strip() == APPLY_PATCH


def _manager(request: kmock.Request) -> str:
    """?fieldManager=, else the client's name from its User-Agent (the API server's default)."""
    agent = {k.lower(): v for k, v in request.headers.items()}.get("user-agent", "unknown")
    return request.params.get("fieldManager") or agent.split("/")[0]


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message}
    return aiohttp.web.json_response({**body, "code": code}, status=code)


def _get(obj: dict, path: str) -> object:
    for key in path.strip(".").split("."):
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _set(obj: dict, path: str, value: object) -> None:
    *parents, last = path.strip(".").split(".")
    for key in parents:
        obj = obj.setdefault(key, {})
    obj[last] = value


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
        sim.resources[POOLS] = kmock.ResourceInfo(
            kind=POOL_KIND, singular=POOL_KIND.lower(), namespaced=True, subresources={"status", "scale"}, verbs=verbs
        )
        sim.scale_paths = {kmock.resource(POOLS): pool_crd()["spec"]["versions"][0]["subresources"]["scale"]}
        sim.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
            kind="ScaledObject", singular="scaledobject", namespaced=True, verbs=verbs
        )
        async with sim.post("/api/v1/namespaces", json={"metadata": {"name": NS}}) as response:
            assert response.status < 300
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
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGSERVE_") and k != "KUBECONFIG"}
    return start("operator", [sys.executable, "-m", "ragserve.cli", *args], tmp_path / "operator.log", env=env)


@pytest_asyncio.fixture
async def run_operator(kube: KubeSim, tmp_path: Path, port: int, metrics_port: int) -> AsyncIterator[Callable]:
    """Start the operator (stopping the previous one first); every process is stopped at teardown, without
    blocking the loop: kmock serves the operator's last requests meanwhile."""
    procs: list[Proc] = []

    async def run() -> subprocess.Popen:
        for old in procs:
            await old.stop_async()
        kube._requests.clear()  # so the readiness check below sees this process's watches
        proc = start_operator(kube, tmp_path, port, metrics_port)
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
