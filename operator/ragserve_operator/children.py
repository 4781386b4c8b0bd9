"""Everything one RAGServe owns, as desired manifests (pure: spec in, objects out)."""

from __future__ import annotations

from ragserve_operator.cachestore import cachestore_service, cachestore_statefulset
from ragserve_operator.engines import cachestore_addresses, engine_deployment, engine_service
from ragserve_operator.inference_pool import inference_children
from ragserve_operator.names import Owner
from ragserve_operator.pools import pool_object
from ragserve_operator.redis import redis_configmap, redis_deployment, redis_service
from ragserve_operator.router import registry_service, router_deployment, router_service
from ragserve_operator.scaling.hpa_keda import engine_hpa, engine_scaledobject
from ragserve_operator.spec import POOL_KIND, RAGServeSpec
from ragserve_operator.vllm import vllm_service, vllm_statefulset

# kinds the operator creates, and so may prune
OWNED_KINDS = (
    POOL_KIND,
    "Deployment",
    "StatefulSet",
    "Service",
    "ConfigMap",
    "HorizontalPodAutoscaler",
    "ScaledObject",
    "InferencePool",
    "HTTPRoute",
)


def endpoints_configmap(owner: Owner, spec: RAGServeSpec) -> dict:
    """In-cluster addresses, for apps to `envFrom` (OPENAI_BASE_URL works with the openai SDK as is)."""
    router = owner.host(owner.child("router"))
    data = {
        "OPENAI_BASE_URL": f"http://{router}:{spec.router['port']}/v1",
        "RAGSERVE_ROUTER_URL": f"http://{router}:{spec.router['port']}",
        "RAGSERVE_ROUTER": f"{owner.host(owner.child('router-registry'))}:{spec.router['grpcPort']}",
    }
    if addresses := cachestore_addresses(owner, spec):
        data["RAGSERVE_CACHESTORE"] = ",".join(addresses)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owner.metadata(owner.child("endpoints"), "endpoints"),
        "data": data,
    }


def desired_children(owner: Owner, spec: RAGServeSpec, replicas: dict[str, int]) -> list[dict]:
    """replicas: pool name -> the pool's replicas (its RAGServeEnginePool's spec.replicas)."""
    out = [endpoints_configmap(owner, spec), router_deployment(owner, spec), router_service(owner, spec)]
    out.append(registry_service(owner, spec))
    for pool in spec.pools:
        out.append(pool_object(owner, spec, pool))
        out += [engine_deployment(owner, spec, pool, replicas[pool.name]), engine_service(owner, pool)]
        if spec.autoscaling["mode"] == "hpa":
            out.append(engine_hpa(owner, spec, pool))
        elif spec.autoscaling["mode"] == "keda":
            out.append(engine_scaledobject(owner, spec, pool))
    for vllm in spec.vllm_pools:  # a fixed replica count (the router names every pod): no pool object, no HPA
        out += [vllm_statefulset(owner, spec, vllm), vllm_service(owner, vllm)]
    if spec.cachestore["enabled"]:
        out += [cachestore_statefulset(owner, spec), cachestore_service(owner, spec)]
    if spec.redis["mode"] == "inCluster":
        out += [redis_configmap(owner, spec), redis_deployment(owner, spec), redis_service(owner)]
    return out + inference_children(owner, spec)
