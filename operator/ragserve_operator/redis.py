"""In-cluster Redis (redis.mode: inCluster): shared router state and the cachestore's Redis tier.
A single pod without persistence: everything in it can be recomputed."""

from __future__ import annotations

import hashlib

from ragserve_operator.names import REDIS_PORT, Owner
from ragserve_operator.pods import resources
from ragserve_operator.spec import RAGServeSpec

CONFIG_HASH = "ragserve.dev/config-hash"


def redis_conf(spec: RAGServeSpec) -> str:
    return "\n".join(
        [
            "bind 0.0.0.0",
            "protected-mode no",
            f"port {REDIS_PORT}",
            'save ""',
            "appendonly no",
            f"maxmemory {spec.redis['maxMemory']}",
            "maxmemory-policy allkeys-lru",
            "",
        ]
    )


def redis_configmap(owner: Owner, spec: RAGServeSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owner.metadata(owner.child("redis"), "redis"),
        "data": {"redis.conf": redis_conf(spec)},
    }


def redis_deployment(owner: Owner, spec: RAGServeSpec) -> dict:
    conf_hash = hashlib.sha256(redis_conf(spec).encode()).hexdigest()[:16]
    probe = {"tcpSocket": {"port": "redis"}, "periodSeconds": 5, "failureThreshold": 3}
    redis = {
        "name": "redis",
        "image": spec.redis["image"],
        "imagePullPolicy": "IfNotPresent",
        "command": ["redis-server", "/etc/redis/redis.conf"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "periodSeconds": 10},
        "resources": resources(spec.redis.get("resources")),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "config", "mountPath": "/etc/redis"}, {"name": "data", "mountPath": "/data"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owner.metadata(owner.child("redis"), "redis"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": owner.selector("redis")},
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": owner.selector("redis"), "annotations": {CONFIG_HASH: conf_hash}},
                "spec": {
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "runAsGroup": 999, "fsGroup": 999},
                    "containers": [redis],
                    "volumes": [
                        {"name": "config", "configMap": {"name": owner.child("redis")}},
                        {"name": "data", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def redis_service(owner: Owner) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(owner.child("redis"), "redis"),
        "spec": {
            "selector": owner.selector("redis"),
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }
