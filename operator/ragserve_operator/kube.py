"""A small generic client for the few kinds the operator manages: get, list, create, merge-patch, delete.

Built on the `kubernetes` package's ApiClient (auth, TLS, kubeconfig / in-cluster config)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config

from ragserve_operator.spec import GROUP, PLURAL, VERSION

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
    "RAGServe": Kind(f"{GROUP}/{VERSION}", PLURAL),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


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

    def _call(self, method: str, path: str, body: Any = None, query: list | None = None, patch: bool = False) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json" if patch else "application/json"
        request = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.api.call_api(*request, _request_timeout=TIMEOUT_S)
        response.read()
        if not 200 <= response.status < 300:
            raise KubeError(response.status, _message(response.data))
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

    def create(self, obj: dict) -> dict:
        return self._call("POST", self.path(obj["kind"], obj["metadata"]["namespace"]), body=obj)

    def patch(self, kind: str, namespace: str, name: str, body: dict, sub: str | None = None) -> dict:
        return self._call("PATCH", self.path(kind, namespace, name, sub), body=body, patch=True)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._call("DELETE", self.path(kind, namespace, name), body={"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status != 404:
                raise


def _message(data: bytes | None) -> str:
    try:
        return json.loads(data or b"{}").get("message") or "no message"
    except ValueError:
        return (data or b"")[:200].decode(errors="replace")
