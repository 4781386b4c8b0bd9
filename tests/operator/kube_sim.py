"""An in-memory Kubernetes API server for the operator tests: kmock's emulator plus the API server
behaviours the operator meets on a real cluster.

kmock stores objects and streams watch events but is no API server; KubeSim adds: uid /
creationTimestamp / generation / resourceVersion, generation bumps on spec changes, generateName, the
namespace from the URL, listing the cluster-scoped namespaces, server-side apply with field ownership
(server_side_apply.py), the `scale` subresource of custom resources that declare one, and:

- the `status` subresource: where a resource has one, writes to the main resource leave status as it
  is and writes to /status change only status (a create keeps the status it is given: the tests create
  ready pods, playing the kubelet);
- optimistic concurrency: a PUT or merge patch carrying a stale metadata.resourceVersion is a 409
  Conflict, a JSON patch whose "test" of it fails a 422 (what the API server answers kopf);
- garbage collection by ownerReferences, background propagation: once an object is gone, every object
  whose owners are all gone is deleted too, transitively (finalizers respected), and a dependent with
  other owners left loses the reference; an object written while none of its owners exists (a write
  racing the owner's deletion) is collected too. propagationPolicy Orphan keeps the dependents; Foreground is
  treated as Background. Collected at once, where the real collector runs shortly after.
- `calls`: every (verb, group, resource/subresource) a client other than the test itself made, for the
  RBAC checks (tests/operator/rbac.py).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import uuid

import aiohttp.web
import kmock
from kmock._internal import dicts as kmock_dicts

from tests.helpers.ragserve_cr import NS
from tests.operator import server_side_apply as ssa

APPLY_PATCH = "application/apply-patch+yaml"
TEST_CLIENT = "kmock/"  # the tests' own requests (sim.request: User-Agent "kmock/0.8 aiohttp/...")


class KubeSim(kmock.KubernetesEmulator):
    namespace = NS
    _version = 0
    scale_paths: dict = {}  # resource -> the CRD's scale subresource (specReplicasPath, ...)

    @property
    def calls(self) -> set[tuple[str, str, str]]:
        if "_calls" not in self.__dict__:
            self.__dict__["_calls"] = set()
        return self.__dict__["_calls"]

    def obj(self, resource: str | kmock.resource, name: str, namespace: str = NS) -> dict | None:
        """The stored object (e.g. obj("apps/v1/deployments", "x")), None if absent or deleted."""
        key = (kmock.resource(resource), namespace, name)
        return None if key not in self.objects or self.objects[key].deleted else self.objects[key].raw

    def live(self) -> list[tuple[str, str]]:
        """(resource, name) of every object stored in the test namespace."""
        return [(str(r), n) for (r, ns, n), o in self.objects.items() if ns == NS and not o.deleted]

    def events(self) -> list[dict]:
        return [o.raw for (r, _, _), o in self.objects.items() if r == "v1/events" and not o.deleted]

    async def call(self, method: str, path: str, body: dict | list | None = None) -> dict:
        async with self.request(method, path, json=body) as response:
            assert response.status < 300, await response.text()
            return await response.json()

    async def _handle(self, request: kmock.Request):
        if request.resource is None:
            return await super()._handle(request)
        self._record_call(request)
        if request.subresource == "scale":
            return await self._serve_scale(request)
        if stale := self._stale(request):
            return stale
        if request.name and request.method.upper() == "PUT":
            return await self._serve_put(request)
        if request.action == kmock.action.UPDATE and _is_apply(request):
            return await self._serve_apply(request)
        data = request.data
        if request.action == kmock.action.UPDATE and self._has_status(request.resource):
            _only_status(data) if request.subresource == "status" else _without_status(data)
        if request.action == kmock.action.UPDATE and isinstance(data, list):
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_version()})
        elif isinstance(data, dict) and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            data.setdefault("metadata", {})["resourceVersion"] = self._next_version()
            if request.action == kmock.action.CREATE:
                self._fill_create(request, data["metadata"])
            elif request.subresource is None and "spec" in data:
                self._bump_generation(request, data)
        if request.subresource is None:
            self._record_update(request)
        uid = self._uid(request)
        response = await super()._handle(request)
        if uid and self.obj(request.resource, request.name, request.namespace) is None and not _orphans(request):
            # shielded: the collector's work must not end half-way when the client's request is cancelled
            await asyncio.shield(self._collect({uid}))
        elif request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            await asyncio.shield(self._collect(self._dangling(request)))
        return response

    def _dangling(self, request: kmock.Request) -> set[str]:
        """The owner uids of the object just written, if none of its owners exists (a write racing its
        owner's deletion): the collector deletes such a dependent, as the real one does on seeing it."""
        data = request.data if isinstance(request.data, dict) else {}
        name = request.name or (data.get("metadata") or {}).get("name")
        live = self.obj(request.resource, name, request.namespace) if name else None
        refs = {r.get("uid") for r in (live or {}).get("metadata", {}).get("ownerReferences") or []}
        if not refs:
            return set()
        uids = {o.raw["metadata"].get("uid") for o in self.objects.values() if not o.deleted}
        return set() if refs & uids else refs

    # status subresource, resourceVersion, PUT

    def _has_status(self, resource: kmock.resource) -> bool:
        try:
            return "status" in self.resources[resource].subresources
        except KeyError:
            return False

    def _stale(self, request: kmock.Request) -> aiohttp.web.Response | None:
        """409 for a PUT / merge patch with an old resourceVersion, 422 for a JSON patch's failed test."""
        if not request.name or request.action not in (kmock.action.UPDATE, None) or _is_apply(request):
            return None
        live = self.obj(request.resource, request.name, request.namespace)
        current = ((live or {}).get("metadata") or {}).get("resourceVersion")
        data = request.data
        if isinstance(data, list):
            tests = [
                op["value"] for op in data if op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion"
            ]
            if any(v != current for v in tests):
                return _status(422, "Invalid", "resourceVersion changed")
            return None
        sent = ((data or {}).get("metadata") or {}).get("resourceVersion") if isinstance(data, dict) else None
        if live is not None and sent and sent != current:
            what = f'{request.resource.plural}.{request.resource.group or "core"} "{request.name}"'
            message = (
                f"Operation cannot be fulfilled on {what}: the object has been modified;"
                " please apply your changes to the latest version and try again"
            )
            return _status(409, "Conflict", message)
        return None

    async def _serve_put(self, request: kmock.Request) -> aiohttp.web.Response:
        """PUT replaces the object (its status kept where status is a subresource) or, on /status, only status."""
        live = self.obj(request.resource, request.name, request.namespace)
        if live is None or not isinstance(request.data, dict):
            return _status(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        new, has_status = copy.deepcopy(request.data), self._has_status(request.resource)
        if request.subresource == "status":
            new = {**copy.deepcopy(live), "status": new.get("status")}
        elif has_status:
            new.pop("status", None)
            if "status" in live:
                new["status"] = copy.deepcopy(live["status"])
        meta = new.setdefault("metadata", {})
        for key in ("uid", "creationTimestamp", "generation", "managedFields", "deletionTimestamp"):
            if key in live["metadata"]:
                meta[key] = live["metadata"][key]
            else:
                meta.pop(key, None)
        if request.subresource is None:
            new = ssa.update(live, new, _manager(request))
        return aiohttp.web.json_response(await self._store(request, live, new))

    # garbage collection

    def _uid(self, request: kmock.Request) -> str | None:
        """The uid of the object a delete / update targets (collected after it if that removes it)."""
        if request.action not in (kmock.action.DELETE, kmock.action.UPDATE) or not request.name:
            return None
        live = self.obj(request.resource, request.name, request.namespace)
        return (live or {}).get("metadata", {}).get("uid")

    async def _collect(self, gone: set[str]) -> None:
        """Delete the dependents of the objects `gone` (uids) whose owners are all gone, transitively."""
        while gone:
            uids = {o.raw["metadata"].get("uid") for o in self.objects.values() if not o.deleted}
            found: set[str] = set()
            async with self._lock:
                for key, obj in list(self.objects.items()):
                    refs = [] if obj.deleted else obj.raw["metadata"].get("ownerReferences") or []
                    if not any(r.get("uid") in gone for r in refs):
                        continue
                    left = [r for r in refs if r.get("uid") in uids]
                    if left:  # other owners remain: only the reference goes
                        obj.patch({"metadata": {"ownerReferences": left}})
                        await self._buses[key[0]].put({"type": "MODIFIED", "object": obj.raw})
                    elif obj.raw["metadata"].get("finalizers"):
                        now = datetime.datetime.now(datetime.UTC).isoformat()
                        if not obj.raw["metadata"].get("deletionTimestamp"):
                            obj.patch({"metadata": {"deletionTimestamp": now}})
                            await self._buses[key[0]].put({"type": "MODIFIED", "object": obj.raw})
                    else:
                        found.add(obj.raw["metadata"]["uid"])
                        raw = obj.raw
                        obj.delete()
                        await self._buses[key[0]].put({"type": "DELETED", "object": raw})
            gone = found

    # what clients call (for RBAC)

    def _record_call(self, request: kmock.Request, verb: str | None = None) -> None:
        agent = {k.lower(): v for k, v in request.headers.items()}.get("user-agent", "")
        if agent.startswith(TEST_CLIENT) or not request.resource.plural:  # (discovery: any authenticated user)
            return
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        self.calls.add((verb or _verb(request), request.resource.group or "", resource))

    # server-side apply, scale, create / update bookkeeping

    def _fill_create(self, request: kmock.Request, meta: dict) -> None:
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:6]
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).isoformat())

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
        config = dict(request.data)
        if self._has_status(request.resource):
            config.pop("status", None)
        live = self.obj(request.resource, request.name, request.namespace)
        if live is None:  # an apply that creates needs `create` too
            self._record_call(request, verb="create")
        try:
            new = ssa.apply(live, config, manager, force=request.params.get("force") == "true")
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
        await asyncio.shield(self._collect(self._dangling(request)))
        return raw

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


def _only_status(data: dict | list | None) -> None:
    """A write to /status: everything but status (and the resourceVersion guard) is dropped."""
    if isinstance(data, dict):
        for key in [k for k in data if k not in ("status", "metadata")]:
            del data[key]
        if "metadata" in data:
            data["metadata"] = {k: v for k, v in data["metadata"].items() if k == "resourceVersion"}
    elif isinstance(data, list):
        data[:] = [op for op in data if op.get("op") == "test" or _is_status_path(op.get("path", ""))]


def _without_status(data: dict | list | None) -> None:
    """A write to the main resource of a kind with a status subresource: its status part is dropped."""
    if isinstance(data, dict):
        data.pop("status", None)
    elif isinstance(data, list):
        data[:] = [op for op in data if not _is_status_path(op.get("path", ""))]


def _is_status_path(path: str) -> bool:
    return path == "/status" or path.startswith("/status/")


def _orphans(request: kmock.Request) -> bool:
    body = request.data if isinstance(request.data, dict) else {}
    return (body.get("propagationPolicy") or request.params.get("propagationPolicy")) == "Orphan"


def _verb(request: kmock.Request) -> str:
    method = request.method.upper()
    if method == "GET":
        return "watch" if request.params.get("watch") in ("true", "1") else "get" if request.name else "list"
    if method == "DELETE":
        return "delete" if request.name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


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
