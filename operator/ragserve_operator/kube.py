"""A small generic client for the few kinds the operator manages: get, list, server-side apply,
merge-patch (status, /scale), delete.

Built on the `kubernetes` package's ApiClient (auth, TLS, kubeconfig / in-cluster config)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config

from ragserve_operator.spec import GROUP, PLURAL, POOL_KIND, POOL_PLURAL, VERSION

TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Kind:
    api_version: str
    plural: str

    @property
    def prefix(self) -> str:
        return ("/api/" if "/" not in self.api_version else "/apis/") + self.api_version


KINDS: dict[str, Kind] = {
    "Deployment": Kind("apps/v1", "deployments"),
    "StatefulSet": Kind("apps/v1", "statefulsets"),
    "Service": Kind("v1", "services"),
    "ConfigMap": Kind("v1", "configmaps"),
    "Pod": Kind("v1", "pods"),
    "HorizontalPodAutoscaler": Kind("autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": Kind("keda.sh/v1alpha1", "scaledobjects"),
    "InferencePool": Kind("inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": Kind("gateway.networking.k8s.io/v1", "httproutes"),
    "RAGServe": Kind(f"{GROUP}/{VERSION}", PLURAL),
    POOL_KIND: Kind(f"{GROUP}/{VERSION}", POOL_PLURAL),
}
FIELD_MANAGER = "ragserve-operator"  # owns every field of the children it applies
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str, causes: list[dict] | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.causes = causes or []  # the Status' details.causes (an apply conflict: field + manager)


def load_config(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster config when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def _call(self, method: str, path: str, body: Any = None, query: list | None = None, content: str = "") -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content or "application/json"  # an apply patch is sent as JSON (JSON is YAML)
        request = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.api.call_api(*request, _request_timeout=TIMEOUT_S)
        response.read()
        if not 200 <= response.status < 300:
            raise KubeError(response.status, *_message(response.data))
        return json.loads(response.data) if response.data else None

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        k = KINDS[kind]
        return "/".join([f"{k.prefix}/namespaces", namespace, k.plural] + [p for p in (name, sub) if p])

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._call("GET", self.path(kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        items = self._call("GET", self.path(kind, namespace), query=[("labelSelector", selector)])["items"]
        # filter here too, so a server that ignores labelSelector gives the same answer
        return [i for i in items if labels.items() <= (i.get("metadata", {}).get("labels") or {}).items()]

    def apply(self, obj: dict, force: bool, manager: str = FIELD_MANAGER) -> dict:
        """Server-side apply: `obj` is everything `manager` wants set; fields it set before and leaves out
        now are removed, other managers' fields stay. Without force, a field another manager set to another
        value is a 409 whose causes name it."""
        path = self.path(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        query = [("fieldManager", manager), ("force", "true" if force else "false")]
        return self._call("PATCH", path, body=obj, query=query, content=APPLY)

    def create(self, obj: dict, manager: str = FIELD_MANAGER) -> dict:
        """A plain create (an Update in managedFields: later applies by the same manager leave its fields be)."""
        path = self.path(obj["kind"], obj["metadata"]["namespace"])
        return self._call("POST", path, body=obj, query=[("fieldManager", manager)])

    def patch(
        self, kind: str, namespace: str, name: str, body: dict, sub: str | None = None, manager: str = FIELD_MANAGER
    ) -> dict:
        """A merge patch (status, a /scale write): an Update by `manager`."""
        path = self.path(kind, namespace, name, sub)
        return self._call("PATCH", path, body=body, query=[("fieldManager", manager)], content=MERGE)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._call("DELETE", self.path(kind, namespace, name), body={"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status != 404:
                raise


def _message(data: bytes | None) -> tuple[str, list[dict]]:
    try:
        status = json.loads(data or b"{}")
        return status.get("message") or "no message", (status.get("details") or {}).get("causes") or []
    except (ValueError, AttributeError):
        return (data or b"")[:200].decode(errors="replace"), []
