"""Names, labels, owner references and in-cluster addresses of a RAGServe's children.

Labels and names follow the Helm chart's, so dashboards and NetworkPolicies work for both."""

from __future__ import annotations

from dataclasses import dataclass

from ragserve_operator.spec import GROUP, KIND, VERSION

MANAGED_BY = "ragserve-operator"
POOL_LABEL = "ragserve.dev/pool"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
COMPONENT_LABEL = "app.kubernetes.io/component"

REDIS_PORT = 6379


@dataclass(frozen=True)
class Owner:
    """The RAGServe a child belongs to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: dict) -> Owner:
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta.get("uid", ""))

    def child(self, component: str, pool: str | None = None) -> str:
        return f"{self.name}-{component}" + (f"-{pool}" if pool else "")

    def selector(self, component: str, pool: str | None = None) -> dict[str, str]:
        out = {
            "app.kubernetes.io/name": "ragserve",
            INSTANCE_LABEL: self.name,
            COMPONENT_LABEL: component,
        }
        if pool:
            out[POOL_LABEL] = pool
        return out

    def labels(self, component: str, pool: str | None = None) -> dict[str, str]:
        return {**self.selector(component, pool), MANAGED_BY_LABEL: MANAGED_BY, "app.kubernetes.io/part-of": "ragserve"}

    def metadata(self, name: str, component: str, pool: str | None = None) -> dict:
        return {
            "name": name,
            "namespace": self.namespace,
            "labels": self.labels(component, pool),
            "ownerReferences": [self.reference()],
        }

    def reference(self) -> dict:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def owns(self, obj: dict) -> bool:
        refs = obj.get("metadata", {}).get("ownerReferences") or []
        return any(r.get("kind") == KIND and r.get("uid") == self.uid and r.get("name") == self.name for r in refs)

    def host(self, service: str) -> str:
        return f"{service}.{self.namespace}.svc"


def owner_of(obj: dict) -> tuple[str, str] | None:
    """(namespace, name) of the RAGServe that controls a child, if any."""
    meta = obj.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            return meta.get("namespace", ""), ref["name"]
    return None
