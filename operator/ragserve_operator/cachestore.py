"""The cachestore: a StatefulSet running `ragserve cachestore` (stable pod names: engines shard over
them by rendezvous hashing) and its headless Service."""

from __future__ import annotations

import math

from ragserve.cachestore_args import CACHESTORE_METRICS_PORT
from ragserve.cachestore_command import CacheStoreLaunch, cachestore_command
from ragserve.flags import parse_bytes
from ragserve_operator.mounts import Mounts, cachestore_server
from ragserve_operator.names import Owner
from ragserve_operator.pods import container, pod_template, redis_url, redis_url_env
from ragserve_operator.spec import RAGServeSpec

DATA_DIR = "/data"
GIB = 1024**3


def disk_quantity(disk: str) -> str:
    """Volume size for a disk budget, with 10% headroom for the filesystem and files in flight."""
    return f"{math.ceil(parse_bytes(disk) * 1.1 / GIB)}Gi"


def cachestore_pod(owner: Owner, spec: RAGServeSpec) -> tuple[CacheStoreLaunch, Mounts]:
    """A cachestore pod's command line settings, and the Secrets it mounts for them."""
    cs = spec.cachestore
    secrets, tls, token = cachestore_server(spec)
    pod = CacheStoreLaunch(
        port=cs["port"],
        metrics_port=CACHESTORE_METRICS_PORT,
        memory=cs["memory"],
        disk_dir=DATA_DIR if cs["disk"] else None,
        disk=cs["disk"] or None,
        redis=redis_url(owner, spec, db=1) if cs["redisTier"] else None,
        redis_prefix="ragserve-kv:$(POD_NAME):" if cs["redisTier"] else None,  # replicas share the Redis
        tls=tls,
        auth_token_file=token,
        max_message_bytes=cs.get("maxMessageBytes"),
    )
    return pod, secrets


def cachestore_statefulset(owner: Owner, spec: RAGServeSpec) -> dict:
    cs = spec.cachestore
    name = owner.child("cachestore")
    pod, secrets = cachestore_pod(owner, spec)
    mounts = [{"name": "data", "mountPath": DATA_DIR}] if cs["disk"] else []
    mounts += secrets.mounts
    volumes, claims = list(secrets.volumes), []
    if cs["disk"] and cs.get("storageClassName"):
        claims.append(
            {
                "metadata": {"name": "data", "labels": owner.selector("cachestore")},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": cs["storageClassName"],
                    "resources": {"requests": {"storage": disk_quantity(cs["disk"])}},
                },
            }
        )
    elif cs["disk"]:
        volumes.append({"name": "data", "emptyDir": {"sizeLimit": disk_quantity(cs["disk"])}})
    # a gRPC probe cannot speak TLS: a TCP connect then, as in the chart
    check = {"tcpSocket": {"port": "grpc"}} if cs["tls"]["enabled"] else {"grpc": {"port": cs["port"]}}
    grpc_probe = {**check, "periodSeconds": 10, "failureThreshold": 3}
    store = container(
        "cachestore",
        spec.image,
        cachestore_command(pod),
        cs,
        env=[{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
        + (redis_url_env(spec) if cs["redisTier"] else []),
        mounts=mounts,
        ports=[
            {"name": "grpc", "containerPort": cs["port"], "protocol": "TCP"},
            {"name": "metrics", "containerPort": CACHESTORE_METRICS_PORT, "protocol": "TCP"},
        ],
        startupProbe={**check, "periodSeconds": 2, "failureThreshold": 150},
        livenessProbe=grpc_probe,
        readinessProbe={**grpc_probe, "periodSeconds": 5},
    )
    pod = {
        "part": cs,
        "containers": [store],
        "volumes": volumes,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 30,
    }
    body = {
        "replicas": cs["replicas"],
        "serviceName": owner.child("cachestore-headless"),
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": owner.selector("cachestore")},
        "template": pod_template(owner, spec, "cachestore", None, pod),
    }
    if claims:
        body["volumeClaimTemplates"] = claims
    metadata = owner.metadata(name, "cachestore")
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata, "spec": body}


def cachestore_service(owner: Owner, spec: RAGServeSpec) -> dict:
    """Headless, publishing not-ready pods too: shard addresses resolve from the start."""
    port = spec.cachestore["port"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(owner.child("cachestore-headless"), "cachestore"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": owner.selector("cachestore"),
            "ports": [
                {"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"},
                {"name": "metrics", "port": CACHESTORE_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }
