"""Engine pools: one Deployment and one headless Service per pool, running `ragserve engine`."""

from __future__ import annotations

import re

from ragserve_operator.names import ENGINE_PORT, Owner
from ragserve_operator.pods import container, pod_template, secret_env
from ragserve_operator.spec import Pool, RAGServeSpec

STARTUP_TIMEOUT_S = 1800  # model download + load + warm-up


def flag(key: str) -> str:
    """camelCase CRD key -> the engine's CLI flag (blockSize -> --block-size)."""
    return "--" + re.sub(r"(?<!^)(?=[A-Z])", "-", key).lower()


def engine_flags(pool: Pool) -> list[str]:
    out: list[str] = []
    for key, value in pool.engine_flags.items():
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag(key) if value else "--no-" + flag(key)[2:])
        else:
            out += [flag(key), str(value)]
    return out


def cachestore_addresses(owner: Owner, spec: RAGServeSpec) -> list[str]:
    """Every cachestore pod by its stable DNS name (the client shards over them)."""
    cs = spec.cachestore
    if not cs["enabled"]:
        return []
    sts, headless = owner.child("cachestore"), owner.host(owner.child("cachestore-headless"))
    return [f"{sts}-{i}.{headless}:{cs['port']}" for i in range(cs["replicas"])]


def model_path(pool: Pool) -> str:
    """A relative model path with a model PVC lives under its mount; anything else is passed as is."""
    pvc = pool.raw.get("modelPVC")
    if pvc and not pool.model.startswith("/"):
        return f"{pvc['mountPath'].rstrip('/')}/{pool.model}"
    return pool.model


def engine_args(owner: Owner, spec: RAGServeSpec, pool: Pool) -> list[str]:
    args = ["engine", "--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--model", model_path(pool)]
    if pool.raw.get("servedModelName"):
        args += ["--served-model-name", pool.raw["servedModelName"]]
    args += engine_flags(pool)
    args += ["--router", f"{owner.host(owner.child('router-registry'))}:{spec.router['grpcPort']}"]
    args += ["--advertise-url", f"http://$(POD_IP):{ENGINE_PORT}"]
    if addresses := cachestore_addresses(owner, spec):
        args += ["--cachestore", ",".join(addresses)]
    if pool.raw.get("maxBodyBytes"):
        args += ["--max-body-bytes", str(pool.raw["maxBodyBytes"])]
    return args


def pool_replicas(spec: RAGServeSpec, pool: Pool, current: int | None) -> int | None:
    """Replicas to write: the spec's without autoscaling; with it, the live value kept within min/max
    (the autoscaler owns it), or None (leave it to the HPA) once the HPA / KEDA manages the pool."""
    raw, mode = pool.raw, spec.autoscaling["mode"]
    if mode == "none":
        return raw["replicas"]
    if current is None:
        return raw["minReplicas"]
    if mode == "operator":
        return min(max(current, raw["minReplicas"]), raw["maxReplicas"])
    return None


def engine_deployment(owner: Owner, spec: RAGServeSpec, pool: Pool, replicas: int | None) -> dict:
    name, raw = owner.child("engine", pool.name), pool.raw
    gpus = raw["gpus"]
    volumes, mounts = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}], []
    mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    if pvc := raw.get("modelPVC"):
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True}})
        mount = {"name": "model", "mountPath": pvc["mountPath"], "readOnly": True}
        mounts.append({**mount, "subPath": pvc["subPath"]} if pvc.get("subPath") else mount)
    engine = container(
        "engine",
        pool.image,
        engine_args(owner, spec, pool),
        raw,
        env=[
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"},
            {"name": "HF_HOME", "value": "/cache/huggingface"},
            *secret_env("RAGSERVE_API_KEY", spec.engine_api_key),
        ],
        limits={raw["gpuResourceName"]: str(gpus)} if gpus else None,
        mounts=mounts,
        ports=[{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        startupProbe={
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": STARTUP_TIMEOUT_S // 5,
        },
        livenessProbe={"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        readinessProbe={"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
    )
    pod = {
        "part": raw,
        "containers": [engine],
        "volumes": volumes,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 120,
    }
    # a GPU pool cannot surge (no spare GPUs): replace one pod at a time instead
    rolling = {"maxSurge": 0, "maxUnavailable": 1} if gpus else {"maxSurge": 1, "maxUnavailable": 0}
    body = {
        "selector": {"matchLabels": owner.selector("engine", pool.name)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
        "template": pod_template(owner, spec, "engine", pool.name, pod),
    }
    if replicas is not None:
        body = {"replicas": replicas, **body}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owner.metadata(name, "engine", pool.name),
        "spec": body,
    }


def engine_service(owner: Owner, pool: Pool) -> dict:
    """Headless: one DNS record per ready engine pod (metrics scraping, discovery)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(owner.child("engine", pool.name), "engine", pool.name),
        "spec": {
            "clusterIP": "None",
            "selector": owner.selector("engine", pool.name),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }
