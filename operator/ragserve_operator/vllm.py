"""runtime: vllm engine pools: a StatefulSet of vLLM pods behind a headless Service (stable DNS names), whose
command line is ragserve.vllm_command's, and the router's --external-engine values for them: the chart's
templates/engine/vllm.yaml, built from a RAGServe (tests/operator/test_vllm_pools.py compares the two)."""

from __future__ import annotations

from ragserve.vllm_command import VllmPod, external_engines, vllm_command
from ragserve_operator.names import Owner
from ragserve_operator.pods import CONTAINER_SECURITY, SCRATCH_ENV, SCRATCH_MOUNTS, pod_template, resources
from ragserve_operator.spec import RAGServeSpec, VllmPool

STARTUP_TIMEOUT_S = 1800  # model download + load + CUDA graphs (the chart's startupTimeoutSeconds)
CACHE_ENV = [
    {"name": "HF_HOME", "value": "/cache/huggingface"},
    {"name": "VLLM_CACHE_ROOT", "value": "/cache/vllm"},
    {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"},
]
HEALTH = {"path": "/health", "port": "http"}


def vllm_name(owner: Owner, pool: VllmPool) -> str:
    return owner.child("vllm", pool.name)


def vllm_pod(pool: VllmPool) -> VllmPod:
    v = pool.vllm
    return VllmPod(
        model=pool.model,
        port=v["port"],
        served_model_name=pool.raw.get("servedModelName") or "",
        block_size=v["blockSize"],
        gpus=pool.raw["gpus"],
        events_port=v["eventsPort"],
        replay_port=v["replayPort"],
        extra_args=tuple(v.get("extraArgs", [])),
    )


def ports(pool: VllmPool) -> list[tuple[str, int]]:
    v = pool.vllm
    return [("http", v["port"]), ("events", v["eventsPort"]), ("replay", v["replayPort"])]


def probes() -> dict:
    return {
        "startupProbe": {"httpGet": HEALTH, "periodSeconds": 10, "failureThreshold": (STARTUP_TIMEOUT_S + 9) // 10},
        "livenessProbe": {"httpGet": HEALTH, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "readinessProbe": {"httpGet": HEALTH, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2},
    }


def model_volume(pool: VllmPool) -> tuple[list[dict], list[dict]]:
    """The modelPVC, read-only (the model path is given to vllm as is)."""
    pvc = pool.raw.get("modelPVC")
    if not pvc:
        return [], []
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True}}
    mount = {"name": "model", "mountPath": pvc["mountPath"], "readOnly": True}
    return [volume], [{**mount, "subPath": pvc["subPath"]} if pvc.get("subPath") else mount]


def vllm_container(pool: VllmPool) -> dict:
    raw, gpus = pool.raw, {pool.raw["gpuResourceName"]: str(pool.raw["gpus"])}
    _, model_mounts = model_volume(pool)
    return {
        "name": "vllm",
        "image": pool.image.ref(""),
        "imagePullPolicy": pool.image.pull_policy,
        "command": ["vllm"],
        "args": vllm_command(vllm_pod(pool)),
        "env": SCRATCH_ENV + CACHE_ENV + list(raw.get("env", [])),
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports(pool)],
        **probes(),
        "resources": resources(raw.get("resources"), gpus),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": SCRATCH_MOUNTS + [{"name": "dshm", "mountPath": "/dev/shm"}] + model_mounts,
    }


def vllm_statefulset(owner: Owner, spec: RAGServeSpec, pool: VllmPool) -> dict:
    name = vllm_name(owner, pool)
    volumes, _ = model_volume(pool)
    pod = {
        "part": pool.raw,
        "containers": [vllm_container(pool)],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}, *volumes],
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 120,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": owner.metadata(name, "vllm", pool.name),
        "spec": {
            "serviceName": name,
            "replicas": pool.replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": owner.selector("vllm", pool.name)},
            "template": pod_template(owner, spec, "vllm", pool.name, pod),
        },
    }


def vllm_service(owner: Owner, pool: VllmPool) -> dict:
    """Headless, not-ready addresses published: each pod's DNS name resolves before it is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(vllm_name(owner, pool), "vllm", pool.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": owner.selector("vllm", pool.name),
            "ports": [
                {"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in ports(pool)
            ],
        },
    }


def router_external_engines(owner: Owner, spec: RAGServeSpec) -> list[str]:
    """One --external-engine per replica of every vllm pool, by its pod's stable DNS name."""
    out = []
    for pool in spec.vllm_pools:
        name = vllm_name(owner, pool)
        out += external_engines(name, owner.host(name), pool.replicas, vllm_pod(pool))
    return out


def external_block_size(spec: RAGServeSpec) -> int | None:
    """The vllm pools' one block size (the spec's rules keep it one), None without any."""
    return spec.vllm_pools[0].vllm["blockSize"] if spec.vllm_pools else None
