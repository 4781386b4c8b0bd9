"""Pod-template pieces every component shares (the chart's defaults: non-root, read-only root fs)."""

from __future__ import annotations

from ragserve import __version__
from ragserve_operator.names import Owner
from ragserve_operator.spec import Image, RAGServeSpec

POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
# Writable scratch for a read-only root filesystem: /tmp and /cache.
SCRATCH_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "RAGSERVE_CACHE_DIR", "value": "/cache/ragserve"},
    {"name": "XDG_CACHE_HOME", "value": "/cache"},
]
SCRATCH_MOUNTS = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": "/cache"}]
SCRATCH_VOLUMES = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]


def http_probe(path: str, period: int, failures: int, timeout: int = 3, https: bool = False) -> dict:
    return {
        "httpGet": {"path": path, "port": "http", **({"scheme": "HTTPS"} if https else {})},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def resources(raw: dict | None, extra_limits: dict[str, str] | None = None) -> dict:
    """Quantities as strings (what the API server returns), so drift checks compare like with like."""
    out = {kind: {k: str(v) for k, v in (raw or {}).get(kind, {}).items()} for kind in ("requests", "limits")}
    if extra_limits:
        out["limits"].update(extra_limits)
        out["requests"].update(extra_limits)
    return {k: v for k, v in out.items() if v}


def container(
    name: str,
    image: Image,
    args: list[str],
    part: dict,
    env: list[dict] | None = None,
    limits: dict[str, str] | None = None,
    mounts: list[dict] | None = None,
    **fields,
) -> dict:
    """A ragserve container: `ragserve <args>` with the scratch mounts and the part's env/resources."""
    return {
        "name": name,
        "image": image.ref(__version__),
        "imagePullPolicy": image.pull_policy,
        "command": ["ragserve"],
        "args": args + list(part.get("extraArgs", [])),
        "env": (env or []) + SCRATCH_ENV + list(part.get("env", [])),
        "resources": resources(part.get("resources"), limits),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": SCRATCH_MOUNTS + (mounts or []),
        **fields,
    }


def pod_template(owner: Owner, spec: RAGServeSpec, component: str, pool: str | None, pod: dict) -> dict:
    """A pod template: selector labels, security context, scheduling from the part's settings."""
    part = pod.pop("part")
    out = {
        "enableServiceLinks": False,  # Service env vars (<SVC>_PORT, ...) would read as RAGSERVE_* flags
        "securityContext": POD_SECURITY,
        "volumes": SCRATCH_VOLUMES + pod.pop("volumes", []),
        **pod,
    }
    if spec.image_pull_secrets:
        out["imagePullSecrets"] = spec.image_pull_secrets
    for key in ("nodeSelector", "tolerations"):
        if part.get(key):
            out[key] = part[key]
    return {"metadata": {"labels": owner.selector(component, pool)}, "spec": out}


def redis_url_env(spec: RAGServeSpec) -> list[dict]:
    """RAGSERVE_REDIS from a Secret (a URL with a password stays out of the pod spec)."""
    if spec.redis["mode"] != "external" or spec.redis.get("url"):
        return []
    return secret_env("RAGSERVE_REDIS", spec.redis.get("urlSecret"))


def secret_env(name: str, ref: dict | None) -> list[dict]:
    """An env var from a Secret key ({name, key}), or nothing."""
    if not ref:
        return []
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}]


def redis_url(owner: Owner, spec: RAGServeSpec, db: int) -> str | None:
    """The --redis URL of router (db 0) and cachestore (db 1); a URL in a Secret comes as RAGSERVE_REDIS instead."""
    if spec.redis["mode"] == "inCluster":
        return f"redis://{owner.host(owner.child('redis'))}:6379/{db}"
    if spec.redis["mode"] == "external":
        return spec.redis.get("url") or None
    return None


def router_grpc_service(owner: Owner, name: str, port: dict, app_protocol: str) -> dict:
    """A cluster-internal Service on one gRPC port of the router pods (its registry, its Endpoint Picker)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(name, "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": owner.selector("router"),
            "ports": [{**port, "protocol": "TCP", "appProtocol": app_protocol}],
        },
    }
