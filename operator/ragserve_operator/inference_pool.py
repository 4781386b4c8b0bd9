"""Gateway API Inference Extension (spec.gateway.inferencePool): the RAGServe's ragserve engine pods as an
InferencePool whose Endpoint Picker is the router (ext_proc on eppPort), the EPP Service, and an HTTPRoute from
a Gateway the user names to the pool; the chart's templates/gateway/inferencepool.yaml renders the same."""

from __future__ import annotations

from ragserve.engine_args import ENGINE_PORT
from ragserve_operator.mounts import Mounts
from ragserve_operator.names import Owner
from ragserve_operator.pods import router_grpc_service
from ragserve_operator.spec import RAGServeSpec

INFERENCE_API = "inference.networking.k8s.io/v1"
GATEWAY_API = "gateway.networking.k8s.io/v1"
EPP_TLS_DIR = "/etc/ragserve/epp-tls"


def settings(spec: RAGServeSpec) -> dict | None:
    """spec.gateway.inferencePool when enabled, else None."""
    pool = spec.gateway["inferencePool"]
    return pool if pool["enabled"] else None


def epp_launch(spec: RAGServeSpec, mounts: Mounts) -> dict:
    """RouterLaunch's epp_* settings (and the certificate Secret mounted, with tls.mode secret)."""
    pool = settings(spec)
    if pool is None:
        return {}
    mode = pool["tls"]["mode"]
    if mode == "secret":
        mounts.secret("epp-tls", pool["tls"]["secretName"], EPP_TLS_DIR)
    files = (f"{EPP_TLS_DIR}/tls.crt", f"{EPP_TLS_DIR}/tls.key") if mode == "secret" else (None, None)
    return {
        "epp_port": pool["eppPort"],
        "epp_plaintext": mode == "plaintext",
        "epp_cert_file": files[0],
        "epp_key_file": files[1],
    }


def epp_ports(spec: RAGServeSpec) -> list[dict]:
    """The router container's EPP port, when the feature is on."""
    pool = settings(spec)
    return [] if pool is None else [{"name": "epp", "containerPort": pool["eppPort"], "protocol": "TCP"}]


def inference_pool(owner: Owner, pool: dict) -> dict:
    meta = owner.metadata(owner.child("inference-pool"), "inference-pool")
    if pool.get("annotations"):
        meta["annotations"] = pool["annotations"]
    picker = {"name": owner.child("epp"), "port": {"number": pool["eppPort"]}, "failureMode": pool["failureMode"]}
    return {
        "apiVersion": INFERENCE_API,
        "kind": "InferencePool",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": owner.selector("engine")},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {"group": "", "kind": "Service", **picker},
        },
    }


def epp_service(owner: Owner, pool: dict) -> dict:
    """The router's Endpoint Picker: gRPC (ext_proc), TLS unless tls.mode is plaintext (then h2c)."""
    app_protocol = "kubernetes.io/h2c" if pool["tls"]["mode"] == "plaintext" else "grpc"
    port = {"name": "epp", "port": pool["eppPort"], "targetPort": "epp"}
    return router_grpc_service(owner, owner.child("epp"), port, app_protocol)


def http_route(owner: Owner, pool: dict) -> dict:
    route = pool["httpRoute"]
    meta = owner.metadata(owner.child("inference-pool"), "inference-pool")
    if route.get("annotations"):
        meta["annotations"] = route["annotations"]
    backend = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": owner.child("inference-pool")}
    rule: dict = {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}], "backendRefs": [backend]}
    if route["requestTimeout"]:
        rule["timeouts"] = {"request": route["requestTimeout"]}
    spec: dict = {"parentRefs": route["parentRefs"]}
    if route.get("hostnames"):
        spec["hostnames"] = route["hostnames"]
    return {"apiVersion": GATEWAY_API, "kind": "HTTPRoute", "metadata": meta, "spec": {**spec, "rules": [rule]}}


def inference_children(owner: Owner, spec: RAGServeSpec) -> list[dict]:
    pool = settings(spec)
    if pool is None:
        return []
    out = [inference_pool(owner, pool), epp_service(owner, pool)]
    return out + ([http_route(owner, pool)] if pool["httpRoute"]["enabled"] else [])
