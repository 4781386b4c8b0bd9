"""The router: a Deployment running `ragserve router` and its Service (HTTP API + gRPC registry)."""

from __future__ import annotations

from ragserve.command_line import arg, tls_flags
from ragserve_operator.mounts import Mounts, cachestore_client, registry_token, serving_tls
from ragserve_operator.names import Owner
from ragserve_operator.pods import container, http_probe, pod_template, redis_args, redis_url_env, secret_env
from ragserve_operator.spec import RAGServeSpec

API_KEYS_DIR = "/etc/ragserve/api-keys"


def router_secrets(spec: RAGServeSpec) -> Mounts:
    """Registry TLS and token, the cachestore's CA / client certificate / token (for store lookups), API keys."""
    r, out = spec.router, Mounts()
    serving_tls(r["tls"], out)
    token = registry_token(spec)
    out.add(token)
    # without a token or mutual TLS anyone in the cluster may register an engine: said explicitly, as the router asks
    if not token.args and not (r["tls"]["enabled"] and r["tls"]["clientAuth"]):
        out.args.append("--registry-allow-unauthenticated")
    store, store_tls, store_token = cachestore_client(spec)
    out.add(store).args += tls_flags("cachestore", store_tls) + arg("cachestore_token_file", store_token)
    if secret := r.get("apiKeySecret"):
        out.secret("api-keys", secret["name"], API_KEYS_DIR)
        out.args += ["--api-keys-file", f"{API_KEYS_DIR}/{secret['key']}"]
    return out


def router_args(owner: Owner, spec: RAGServeSpec) -> list[str]:
    r = spec.router
    args = ["router", "--host", "0.0.0.0", "--port", str(r["port"]), "--grpc-port", str(r["grpcPort"])]
    args += ["--policy", r["policy"]] + redis_args(owner, spec, db=0)
    if r.get("maxBodyBytes"):
        args += ["--max-body-bytes", str(r["maxBodyBytes"])]
    return args + router_secrets(spec).args


def router_deployment(owner: Owner, spec: RAGServeSpec) -> dict:
    r = spec.router
    secrets = router_secrets(spec)
    volumes, mounts = secrets.volumes, secrets.mounts
    router = container(
        "router",
        spec.image,
        router_args(owner, spec),
        r,
        env=redis_url_env(spec) + secret_env("RAGSERVE_ENGINE_API_KEY", spec.engine_api_key),
        mounts=mounts,
        ports=[
            {"name": "http", "containerPort": r["port"], "protocol": "TCP"},
            {"name": "grpc", "containerPort": r["grpcPort"], "protocol": "TCP"},
        ],
        startupProbe=http_probe("/health", 2, 60),
        livenessProbe=http_probe("/health", 10, 3, timeout=5),
        readinessProbe=http_probe("/ready", 5, 2),
    )
    pod = {
        "part": r,
        "containers": [router],
        "volumes": volumes,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 60,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owner.metadata(owner.child("router"), "router"),
        "spec": {
            "replicas": r["replicas"],
            "selector": {"matchLabels": owner.selector("router")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": pod_template(owner, spec, "router", None, pod),
        },
    }


def router_service(owner: Owner, spec: RAGServeSpec) -> dict:
    """The OpenAI API, of the type the spec asks for."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(owner.child("router"), "router"),
        "spec": {
            "type": spec.router["serviceType"],
            "selector": owner.selector("router"),
            "ports": [{"name": "http", "port": spec.router["port"], "targetPort": "http", "protocol": "TCP"}],
        },
    }


def registry_service(owner: Owner, spec: RAGServeSpec) -> dict:
    """The gRPC registry engines register on: cluster-internal whatever the API Service's type."""
    port = {"name": "grpc", "port": spec.router["grpcPort"], "targetPort": "grpc", "protocol": "TCP"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owner.metadata(owner.child("router-registry"), "router"),
        "spec": {"type": "ClusterIP", "selector": owner.selector("router"), "ports": [{**port, "appProtocol": "grpc"}]},
    }
