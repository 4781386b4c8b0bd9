"""Engine pools: one Deployment and one headless Service per pool, running `ragserve engine`."""

from __future__ import annotations

from ragserve.engine_args import ENGINE_PORT
from ragserve.engine_command import EnginePod, engine_command
from ragserve_operator.mounts import Mounts, cachestore_client, registry_tls_client, registry_token, registry_token_file
from ragserve_operator.names import Owner
from ragserve_operator.pods import container, pod_template, secret_env
from ragserve_operator.spec import Pool, RAGServeSpec

HTTP_TLS_DIR = "/etc/ragserve/http-tls"  # engines[].httpTls's Secret (the chart's path)
STARTUP_TIMEOUT_S = 1800  # model download + load + decode-graph compiles (cold: ~60-100 s a size) + warm-up
COMPILE_DIRS = ("inductor", "extensions")  # under RAGSERVE_CACHE_DIR: what compileCachePVC holds


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


def https_files(pool: Pool) -> dict[str, str]:
    """engines[].httpTls: EnginePod's --tls-*-file fields (none when off)."""
    tls = pool.raw["httpTls"]
    if not tls["enabled"]:
        return {}
    files = {"tls_cert_file": f"{HTTP_TLS_DIR}/tls.crt", "tls_key_file": f"{HTTP_TLS_DIR}/tls.key"}
    return files | ({"tls_client_ca_file": f"{HTTP_TLS_DIR}/ca.crt"} if tls["clientAuth"] else {})


def engine_probe(pool: Pool, path: str) -> dict:
    """An HTTP(S) GET of path; the port under httpTls.clientAuth (the kubelet presents no client certificate)."""
    tls = pool.raw["httpTls"]
    if tls["enabled"] and tls["clientAuth"]:
        return {"tcpSocket": {"port": "http"}}
    return {"httpGet": {"path": path, "port": "http", **({"scheme": "HTTPS"} if tls["enabled"] else {})}}


def engine_args(owner: Owner, spec: RAGServeSpec, pool: Pool) -> list[str]:
    """The pool's `ragserve engine` command line (the pool's extraArgs are appended by pods.container)."""
    _, cachestore_tls, cachestore_token = cachestore_client(spec)
    return engine_command(
        EnginePod(
            model=model_path(pool),
            served_model_name=pool.raw.get("servedModelName"),
            task=pool.raw.get("task", "generate"),
            role=pool.raw.get("role", "both"),
            prefiller_allow=tuple(pool.raw.get("prefiller", {}).get("allow", ())),
            prefiller_timeout=pool.raw.get("prefiller", {}).get("timeout"),
            engine=pool.engine_flags,
            port=ENGINE_PORT,
            router=f"{owner.host(owner.child('router-registry'))}:{spec.router['grpcPort']}",
            cachestore=tuple(cachestore_addresses(owner, spec)),
            cachestore_tls=cachestore_tls,
            cachestore_token_file=cachestore_token,
            max_body_bytes=pool.raw.get("maxBodyBytes"),
            registry_token_file=registry_token_file(spec),
            router_tls=registry_tls_client(spec)[1],
            **https_files(pool),
        )
    )


def secret_mounts(spec: RAGServeSpec, pool: Pool) -> Mounts:
    """The Secrets an engine pod reads: the cachestore's and the registry's CA / client certificate, their tokens,
    and its own HTTPS certificate."""
    out = Mounts().add(cachestore_client(spec)[0], registry_tls_client(spec)[0], registry_token(spec))
    if pool.raw["httpTls"]["enabled"]:
        out.secret("http-tls", pool.raw["httpTls"]["secretName"], HTTP_TLS_DIR)
    return out


def threads_env(raw: dict) -> list[dict]:
    """Torch threads = the pod's CPU request rounded up (torch would take every core of the node), unless
    the pool's env sets OMP_NUM_THREADS or there is no CPU request."""
    cpu = ((raw.get("resources") or {}).get("requests") or {}).get("cpu")
    if not cpu or any(e.get("name") == "OMP_NUM_THREADS" for e in raw.get("env", [])):
        return []
    field = {"containerName": "engine", "resource": "requests.cpu", "divisor": "1"}
    return [{"name": "OMP_NUM_THREADS", "valueFrom": {"resourceFieldRef": field}}]


def engine_deployment(owner: Owner, spec: RAGServeSpec, pool: Pool, replicas: int) -> dict:
    """replicas: the pool's (its RAGServeEnginePool's spec.replicas)."""
    name, raw = owner.child("engine", pool.name), pool.raw
    gpus = raw["gpus"]
    secrets = secret_mounts(spec, pool)
    volumes = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}, *secrets.volumes]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}, *secrets.mounts]
    if pvc := raw.get("modelPVC"):
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True}})
        mount = {"name": "model", "mountPath": pvc["mountPath"], "readOnly": True}
        mounts.append({**mount, "subPath": pvc["subPath"]} if pvc.get("subPath") else mount)
    if cache := raw.get("compileCachePVC"):  # compiled graphs shared by the pool's engines (docs/kernels.md)
        volumes.append({"name": "compile-cache", "persistentVolumeClaim": {"claimName": cache["claimName"]}})
        mounts += [{"name": "compile-cache", "mountPath": f"/cache/ragserve/{d}", "subPath": d} for d in COMPILE_DIRS]
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
            *threads_env(raw),
        ],
        limits={raw["gpuResourceName"]: str(gpus)} if gpus else None,
        mounts=mounts,
        ports=[{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        startupProbe={**engine_probe(pool, "/health"), "periodSeconds": 5, "failureThreshold": STARTUP_TIMEOUT_S // 5},
        livenessProbe={**engine_probe(pool, "/health"), "periodSeconds": 10, "failureThreshold": 3},
        readinessProbe={**engine_probe(pool, "/ready"), "periodSeconds": 5, "failureThreshold": 2},
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
        "replicas": replicas,
        "selector": {"matchLabels": owner.selector("engine", pool.name)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
        "template": pod_template(owner, spec, "engine", pool.name, pod),
    }
    if raw["httpTls"]["enabled"]:  # the router's discovery dials the pod over https
        body["template"]["metadata"]["annotations"] = {"ragserve.io/scheme": "https"}
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
