"""The router: a Deployment running `ragserve router` and its Service (HTTP API + gRPC registry)."""

from __future__ import annotations

from ragserve.command_line import TLSFiles
from ragserve.router_args import group_settings
from ragserve.router_command import RouterLaunch, router_command
from ragserve_operator.inference_pool import epp_launch, epp_ports
from ragserve_operator.mounts import Mounts, cachestore_client, registry_token, registry_token_file, serving_tls_files
from ragserve_operator.names import Owner
from ragserve_operator.pods import (
    container,
    http_probe,
    pod_template,
    redis_url,
    redis_url_env,
    router_grpc_service,
    secret_env,
)
from ragserve_operator.spec import RAGServeSpec
from ragserve_operator.vllm import external_block_size, router_external_engines

API_KEYS_DIR = "/etc/ragserve/api-keys"
TENANT_QUOTAS_DIR = "/etc/ragserve/tenant-quotas"
ADMIN_KEY_DIR = "/etc/ragserve/admin-key"
HTTP_TLS_DIR = "/etc/ragserve/http-tls"
ENGINE_CA_DIR, ENGINE_CLIENT_DIR = "/etc/ragserve/engine-ca", "/etc/ragserve/engine-client"  # the chart's paths


def router_pod(owner: Owner, spec: RAGServeSpec) -> tuple[RouterLaunch, Mounts]:
    """A router pod's command line settings, and the Secrets it mounts for them: registry TLS and token, the
    cachestore's CA / client certificate / token (for store lookups), API keys, tenant quotas, the admin key."""
    r, mounts = spec.router, Mounts()
    tls = serving_tls_files(r["tls"], mounts)
    token = registry_token_file(spec)
    store, store_tls, store_token = cachestore_client(spec)
    mounts.add(registry_token(spec), store)
    api_keys = None
    if secret := r.get("apiKeySecret"):
        mounts.secret("api-keys", secret["name"], API_KEYS_DIR)
        api_keys = f"{API_KEYS_DIR}/{secret['key']}"
    quotas = None
    if secret := r.get("tenantQuotasSecret"):
        mounts.secret("tenant-quotas", secret["name"], TENANT_QUOTAS_DIR)
        quotas = f"{TENANT_QUOTAS_DIR}/{secret['key']}"
    admin_key = None
    if secret := r.get("adminKeySecret"):
        mounts.secret("admin-key", secret["name"], ADMIN_KEY_DIR)
        admin_key = f"{ADMIN_KEY_DIR}/{secret['key']}"
    mutual_tls = r["tls"]["enabled"] and r["tls"]["clientAuth"]
    https = r["httpTls"]["enabled"]
    if https:
        mounts.secret("http-tls", r["httpTls"]["secretName"], HTTP_TLS_DIR)
    engine_tls = engine_tls_files(r["engineTls"], mounts)
    external = router_external_engines(owner, spec)
    epp = epp_launch(spec, mounts)
    launch = RouterLaunch(
        port=r["port"],
        grpc_port=r["grpcPort"],
        policy=r["policy"],
        redis=redis_url(owner, spec, db=0),
        external_engines=tuple(external),
        tokenizer=r["tokenizer"].get("path") if external else None,
        external_block_size=external_block_size(spec) if external else None,
        max_body_bytes=r.get("maxBodyBytes") or None,
        tls=tls,
        engine_tls=engine_tls,
        tls_cert_file=f"{HTTP_TLS_DIR}/tls.crt" if https else None,
        tls_key_file=f"{HTTP_TLS_DIR}/tls.key" if https else None,
        registry_token_file=token,
        # without a token or mutual TLS anyone in the cluster may register an engine: said explicitly, as asked
        registry_allow_unauthenticated=not token and not mutual_tls,
        cachestore_tls=store_tls,
        cachestore_token_file=store_token,
        api_keys_file=api_keys,
        tenant_quotas_file=quotas,
        admin_api_key_file=admin_key,
        **epp,
        settings=group_settings(r),
    )
    return launch, mounts.add(tokenizer_mount(r["tokenizer"]))


def engine_tls_files(engine_tls: dict, mounts: Mounts) -> TLSFiles:
    """router.engineTls: the CA that verifies https:// engines and the client certificate for their mutual TLS."""
    ca = cert = key = None
    if secret := engine_tls.get("caSecret"):
        mounts.secret("engine-ca", secret, ENGINE_CA_DIR, key="ca.crt")
        ca = f"{ENGINE_CA_DIR}/ca.crt"
    if secret := engine_tls.get("clientSecret"):
        mounts.secret("engine-client", secret, ENGINE_CLIENT_DIR)
        cert, key = f"{ENGINE_CLIENT_DIR}/tls.crt", f"{ENGINE_CLIENT_DIR}/tls.key"
    return TLSFiles(ca, cert, key)


def tokenizer_mount(tokenizer: dict) -> Mounts:
    """The vllm pools' tokenizer PVC, read-only at tokenizer.mountPath (the chart's router.tokenizer.pvc)."""
    pvc = tokenizer.get("pvc")
    if not pvc:
        return Mounts()
    mount = {"name": "tokenizer", "mountPath": tokenizer["mountPath"], "readOnly": True}
    volume = {"name": "tokenizer", "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True}}
    return Mounts([volume], [{**mount, "subPath": pvc["subPath"]} if pvc.get("subPath") else mount])


def router_deployment(owner: Owner, spec: RAGServeSpec) -> dict:
    r = spec.router
    https = r["httpTls"]["enabled"]
    launch, secrets = router_pod(owner, spec)
    volumes, mounts = secrets.volumes, secrets.mounts
    router = container(
        "router",
        spec.image,
        router_command(launch),
        r,
        env=redis_url_env(spec) + secret_env("RAGSERVE_ENGINE_API_KEY", spec.engine_api_key),
        mounts=mounts,
        ports=[
            {"name": "http", "containerPort": r["port"], "protocol": "TCP"},
            {"name": "grpc", "containerPort": r["grpcPort"], "protocol": "TCP"},
            *epp_ports(spec),
        ],
        startupProbe=http_probe("/health", 2, 60, https=https),
        livenessProbe=http_probe("/health", 10, 3, timeout=5, https=https),
        readinessProbe=http_probe("/ready", 5, 2, https=https),
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
    port = {"name": "grpc", "port": spec.router["grpcPort"], "targetPort": "grpc"}
    return router_grpc_service(owner, owner.child("router-registry"), port, "grpc")
