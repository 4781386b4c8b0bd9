"""The manifests a RAGServe turns into: valid Kubernetes objects whose containers run exactly the
`ragserve` commands of the local stack (the real CLI parser accepts every container's args)."""

from __future__ import annotations

import argparse

import jsonschema
import kubernetes_validate
import pytest

from ragserve.cli import build_parser
from ragserve_operator.children import desired_children
from ragserve_operator.crd import pool_crd
from ragserve_operator.names import Owner
from ragserve_operator.pools import DECLARED, scale_to
from ragserve_operator.spec import POOL_KIND, parse_spec
from tests.helpers import gateway_api
from tests.operator.test_vllm_pools import SPEC as VLLM_MIXED

OWNER = Owner("demo", "ns1", "4b1c2a0e-0000-4000-8000-000000000001")
FULL = {
    "engines": [
        {"name": "small", "model": "smollm2-135m", "engine": {"enablePrefixCaching": False, "kvCacheMemory": "1GiB"}},
        {"name": "big", "model": "llama", "gpus": 2, "modelPVC": {"claimName": "models"}, "maxBodyBytes": 1000000},
    ],
    "router": {"replicas": 2, "apiKeySecret": {"name": "keys"}, "maxBodyBytes": 2000000, "policy": "prefix"},
    "cachestore": {"replicas": 3, "disk": "20GiB", "storageClassName": "fast", "redisTier": True},
    "redis": {"mode": "inCluster"},
    "imagePullSecrets": [{"name": "regcred"}],
    "engineApiKeySecret": {"name": "engine-key"},
}
SPECS = {
    "minimal": {"engines": [{"name": "a", "model": "smollm2-135m"}]},
    "vllm-mixed": VLLM_MIXED,  # a ragserve and a runtime: vllm pool (tests/operator/test_vllm_pools.py)
    "full": FULL,
    "external-redis-secret": {
        "engines": [{"name": "a", "model": "m"}],
        "router": {"replicas": 3},
        "cachestore": {"redisTier": True, "disk": "1GiB"},
        "redis": {"mode": "external", "urlSecret": {"name": "redis", "key": "u"}},
    },
    "hpa": {**FULL, "autoscaling": {"mode": "hpa", "targetRunningRequests": 8}},
    "keda": {**FULL, "autoscaling": {"mode": "keda"}},
    "pd-hpa": {
        "engines": [{"name": "p", "model": "m", "role": "prefill"}, {"name": "d", "model": "m", "role": "decode"}],
        "autoscaling": {"mode": "hpa", "targetRunningRequests": 8, "targetQueuedPrefillTokens": 2048},
    },
    "pd-keda": {
        "engines": [{"name": "p", "model": "m", "role": "prefill"}, {"name": "d", "model": "m", "role": "decode"}],
        "autoscaling": {"mode": "keda", "targetQueuedPrefillTokens": 2048},
    },
    "no-cachestore": {"engines": [{"name": "a", "model": "m"}], "cachestore": {"enabled": False}},
    "embedding-pool": {
        "engines": [{"name": "a", "model": "m"}, {"name": "embed", "model": "all-minilm-l6-v2", "task": "embed"}]
    },
    "prefill-decode": {
        "engines": [{"name": "p", "model": "m", "role": "prefill"}, {"name": "d", "model": "m", "role": "decode"}]
    },
    "decode-behind-the-picker": {
        "engines": [
            {"name": "p", "model": "m", "role": "prefill"},
            {"name": "d", "model": "m", "role": "decode", "prefiller": {"allow": ["10.0.0.0/8", "fd00::/8"]}},
            {"name": "e", "model": "m", "role": "decode", "prefiller": {"allow": ["10.1.2.3"], "timeout": 7.5}},
        ]
    },
    "secure": {
        "engines": [{"name": "a", "model": "m"}],
        "router": {"registryAuth": {"tokenSecret": {"name": "registry"}}},
        "cachestore": {
            "tls": {"enabled": True, "secretName": "store-tls", "clientAuth": True, "engineClientSecret": "engine-tls"},
            "auth": {"existingSecret": "store-token"},
        },
    },
    "inference-pool": {
        "engines": [{"name": "a", "model": "m"}],
        "gateway": {"inferencePool": {"enabled": True, "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}]}}},
    },
    "registry-mtls": {
        "engines": [{"name": "a", "model": "m"}],
        "router": {
            "tls": {"enabled": True, "secretName": "router-tls", "clientAuth": True, "engineClientSecret": "eng"}
        },
    },
    "https-api": {
        "engines": [{"name": "a", "model": "m"}],
        "router": {"httpTls": {"enabled": True, "secretName": "api"}},
    },
    "engine-https": {
        "engines": [
            {"name": "m", "model": "m", "httpTls": {"enabled": True, "secretName": "eng-tls", "clientAuth": True}},
            {"name": "h", "model": "m", "httpTls": {"enabled": True, "secretName": "eng-tls"}},
            {"name": "p", "model": "m"},
        ],
        "router": {"engineTls": {"caSecret": "eng-ca", "clientSecret": "router-client"}},
    },
    "router-groups": {
        "engines": [{"name": "a", "model": "m"}],
        "router": {
            "flowControl": {
                "maxInflightPerEngine": 4,
                "queueSize": 0,
                "queueTimeout": 2.5,
                "saturationKvUsage": 0.9,
                "criticalReservePerEngine": 1,
                "enginePriority": True,
            },
            "tenantQuotas": {"header": "X-Tenant", "tokensPerMinute": 60000, "maxConcurrent": 8, "fairShare": True},
            "breaker": {"failures": 5, "cooldown": 1.5, "probes": 2},
            "retry": {"maxAttempts": 4, "backoff": 0.1, "backoffMax": 1.5, "jitter": 1},
            "health": {"probeInterval": 0.5, "failureThreshold": 3, "successThreshold": 2},
            "tenantQuotasSecret": {"name": "tenant-quotas"},
            "adminKeySecret": {"name": "router-admin", "key": "k"},
        },
    },
}


def children(name: str) -> list[dict]:
    spec = parse_spec(SPECS[name], OWNER.name)
    return desired_children(OWNER, spec, {pool.name: 1 for pool in spec.pools})


def by_name(objs: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def containers(objs: list[dict]):
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            for c in obj["spec"]["template"]["spec"]["containers"]:
                yield obj, c


def parse(container: dict) -> argparse.Namespace:
    """The container's command line through the real `ragserve` parser, with $(VAR)s as the kubelet expands them."""
    assert container["command"] == ["ragserve"]
    values = {"POD_IP": "10.0.0.7", "POD_NAME": "demo-cachestore-0"}
    args = [
        a.replace("$(POD_IP)", values["POD_IP"]).replace("$(POD_NAME)", values["POD_NAME"]) for a in container["args"]
    ]
    parser = build_parser()
    assert args[0] in parser._subparsers._group_actions[0].choices, f"`ragserve {args[0]}` is not a CLI subcommand"
    return parser.parse_args(args)


@pytest.mark.parametrize("name", SPECS)
def test_children_are_valid_kubernetes_objects(name: str):
    objs = children(name)
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names))
    for obj in objs:
        assert obj["metadata"]["ownerReferences"] == [OWNER.reference()]
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "ragserve-operator"
        if obj["kind"] == POOL_KIND:  # ours: the CRD's schema
            schema = pool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            jsonschema.Draft4Validator(schema).validate(obj)
            continue
        if obj["kind"] == "ScaledObject":  # a KEDA CRD: not in the Kubernetes schemas
            continue
        if obj["kind"] in ("InferencePool", "HTTPRoute"):  # the upstream CRDs' schemas and CEL rules
            assert gateway_api.problems(obj) == [], obj
            continue
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


@pytest.mark.parametrize("name", SPECS)
def test_router_and_cachestore_containers_run_the_real_cli(name: str):
    checked = set()
    for _, container in containers(children(name)):
        if container["name"] in ("router", "cachestore"):
            args = parse(container)
            assert args.command == container["name"]
            checked.add(args.command)
    assert "router" in checked


def test_router_flags_follow_the_spec():
    objs = children("full")
    args = parse(by_name(objs, "Deployment", "demo-router")["spec"]["template"]["spec"]["containers"][0])
    assert (args.host, args.port, args.grpc_port, args.policy) == ("0.0.0.0", 8080, 50051, "prefix")
    assert args.redis == "redis://demo-redis.ns1.svc:6379/0"
    assert args.api_keys_file == "/etc/ragserve/api-keys/api-keys"
    assert args.max_body_bytes == 2000000
    pod = by_name(objs, "Deployment", "demo-router")["spec"]["template"]["spec"]
    assert pod["volumes"][-1]["secret"]["secretName"] == "keys" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["enableServiceLinks"] is False
    registry = by_name(objs, "Service", "demo-router-registry")["spec"]
    assert registry["type"] == "ClusterIP" and registry["ports"][0]["port"] == 50051


def test_router_flow_control_quota_breaker_retry_and_health_settings_follow_the_spec():
    """spec.router's grouped settings reach the router's command line (parsed by the real CLI); unset ones stay out."""
    args = parse(
        by_name(children("router-groups"), "Deployment", "demo-router")["spec"]["template"]["spec"]["containers"][0]
    )
    got = {
        k: getattr(args, k) for k in ("max_inflight_per_engine", "queue_size", "queue_timeout", "saturation_kv_usage")
    }
    assert got == {"max_inflight_per_engine": 4, "queue_size": 0, "queue_timeout": 2.5, "saturation_kv_usage": 0.9}
    assert (args.tenant_header, args.tenant_tokens_per_minute, args.tenant_max_concurrent) == ("X-Tenant", 60000, 8)
    assert (args.critical_reserve_per_engine, args.engine_priority, args.tenant_fair_share) == (1, True, True)
    assert (args.breaker_failures, args.breaker_cooldown, args.breaker_probes) == (5, 1.5, 2)
    assert (args.max_attempts, args.retry_backoff, args.retry_backoff_max, args.retry_jitter) == (4, 0.1, 1.5, 1.0)
    assert (args.probe_interval, args.health_failure_threshold, args.health_success_threshold) == (0.5, 3, 2)
    assert args.tenant_quotas_file == "/etc/ragserve/tenant-quotas/quotas"  # the Secret's key, mounted there
    pod = by_name(children("router-groups"), "Deployment", "demo-router")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tenant-quotas")
    assert volume["secret"]["secretName"] == "tenant-quotas"
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tenant-quotas")
    assert mount == {"name": "tenant-quotas", "mountPath": "/etc/ragserve/tenant-quotas", "readOnly": True}
    assert args.admin_api_key_file == "/etc/ragserve/admin-key/k"
    volume = next(v for v in pod["volumes"] if v["name"] == "admin-key")
    assert volume["secret"]["secretName"] == "router-admin"
    minimal = by_name(children("minimal"), "Deployment", "demo-router")["spec"]["template"]["spec"]["containers"][0]
    unset = {"--queue-size", "--breaker-failures", "--retry-jitter", "--tenant-quotas-file", "--admin-api-key-file"}
    assert not unset & set(minimal["args"])


def test_router_https_api_from_its_secret():
    pod = by_name(children("https-api"), "Deployment", "demo-router")["spec"]["template"]["spec"]
    router = pod["containers"][0]
    args = parse(router)
    assert (args.tls_cert_file, args.tls_key_file) == (
        "/etc/ragserve/http-tls/tls.crt",
        "/etc/ragserve/http-tls/tls.key",
    )
    assert mounted(pod, router, args.tls_cert_file)["secretName"] == "api"
    assert {router[p]["httpGet"].get("scheme") for p in ("startupProbe", "livenessProbe", "readinessProbe")} == {
        "HTTPS"
    }
    plain = by_name(children("minimal"), "Deployment", "demo-router")["spec"]["template"]["spec"]["containers"][0]
    assert "scheme" not in plain["readinessProbe"]["httpGet"] and "--tls-cert-file" not in plain["args"]


def test_cachestore_flags_follow_the_spec():
    objs = children("full")
    sts = by_name(objs, "StatefulSet", "demo-cachestore")
    args = parse(sts["spec"]["template"]["spec"]["containers"][0])
    assert (args.port, args.disk_dir, args.metrics_port) == (50061, "/data", 9090)
    assert args.redis == "redis://demo-redis.ns1.svc:6379/1"
    assert args.redis_prefix == "ragserve-kv:demo-cachestore-0:"
    assert sts["spec"]["serviceName"] == "demo-cachestore-headless" and sts["spec"]["replicas"] == 3
    claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "fast" and claim["resources"]["requests"]["storage"] == "22Gi"
    headless = by_name(objs, "Service", "demo-cachestore-headless")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True


def test_engine_containers_run_the_real_cli():
    objs = children("full")
    small = by_name(objs, "Deployment", "demo-engine-small")["spec"]["template"]["spec"]
    args = parse(small["containers"][0])
    assert (args.command, args.port, args.model, args.block_size) == ("engine", 8000, "smollm2-135m", 16)
    assert args.enable_prefix_caching is False and args.kv_cache_memory == 1024**3
    assert args.router == "demo-router-registry.ns1.svc:50051"
    assert args.advertise_url == "http://10.0.0.7:8000"
    assert args.cachestore.split(",") == [
        f"demo-cachestore-{i}.demo-cachestore-headless.ns1.svc:50061" for i in range(3)
    ]
    big = by_name(objs, "Deployment", "demo-engine-big")["spec"]["template"]["spec"]
    assert parse(big["containers"][0]).model == "/models/llama"


def test_engine_roles():
    objs = children("prefill-decode")
    for pool, role in (("p", "prefill"), ("d", "decode")):
        args = parse(by_name(objs, "Deployment", f"demo-engine-{pool}")["spec"]["template"]["spec"]["containers"][0])
        assert (args.role, bool(args.cachestore)) == (role, True)
    assert (
        parse(
            by_name(children("full"), "Deployment", "demo-engine-small")["spec"]["template"]["spec"]["containers"][0]
        ).role
        == "both"
    )


def test_decode_pools_prefiller_flags():
    """spec.engines[].prefiller: what the decode engine parses as --prefiller-allow / --prefiller-timeout; the prefill
    pool gets neither (the engine's defaults)."""
    objs = children("decode-behind-the-picker")
    args = {p: parse(by_name(objs, "Deployment", f"demo-engine-{p}")["spec"]["template"]["spec"]["containers"][0])
            for p in "pde"}  # fmt: skip
    assert (args["d"].prefiller_allow, args["d"].prefiller_timeout) == (["10.0.0.0/8", "fd00::/8"], 120.0)
    assert (args["e"].prefiller_allow, args["e"].prefiller_timeout) == (["10.1.2.3"], 7.5)
    assert (args["p"].prefiller_allow, args["p"].prefiller_timeout) == ([], 120.0)


def test_engine_pods():
    objs = children("full")
    big = by_name(objs, "Deployment", "demo-engine-big")
    pod = big["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    assert engine["args"][engine["args"].index("--max-body-bytes") + 1] == "1000000"
    assert big["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}  # no spare GPUs
    small = by_name(objs, "Deployment", "demo-engine-small")
    assert small["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert small["spec"]["template"]["metadata"]["labels"]["ragserve.dev/pool"] == "small"
    assert engine["image"] == "ghcr.io/ragserve/ragserve-engine:0.1.0"


def test_engine_torch_threads_follow_the_cpu_request():
    """OMP_NUM_THREADS from the pod's CPU request (the kubelet rounds it up), unless env sets it."""
    threads = {"resourceFieldRef": {"containerName": "engine", "resource": "requests.cpu", "divisor": "1"}}
    own = [{"name": "OMP_NUM_THREADS", "value": "3"}]
    pools = [
        {"name": "a", "model": "m", "resources": {"requests": {"cpu": "1500m"}}},
        {"name": "b", "model": "m", "resources": {"requests": {"cpu": "2"}}, "env": own},
        {"name": "c", "model": "m"},
    ]
    spec = parse_spec({"engines": pools}, OWNER.name)
    objs = desired_children(OWNER, spec, {pool.name: 1 for pool in spec.pools})
    env = {}
    for pool in "abc":
        engine = by_name(objs, "Deployment", f"demo-engine-{pool}")["spec"]["template"]["spec"]["containers"][0]
        env[pool] = [e for e in engine["env"] if e["name"] == "OMP_NUM_THREADS"]
    assert env["a"] == [{"name": "OMP_NUM_THREADS", "valueFrom": threads}]
    assert env["b"] == own
    assert env["c"] == []  # no CPU request: torch picks


def test_engine_compile_cache_pvc():
    """compileCachePVC: the pool's engines keep compiled graphs and C++ ops on a shared claim (docs/kernels.md);
    without it they stay in the pod's /cache scratch."""
    pools = [{"name": "a", "model": "m", "compileCachePVC": {"claimName": "graphs"}}, {"name": "b", "model": "m"}]
    spec = parse_spec({"engines": pools}, OWNER.name)
    objs = desired_children(OWNER, spec, {pool.name: 1 for pool in spec.pools})
    a = by_name(objs, "Deployment", "demo-engine-a")["spec"]["template"]["spec"]
    assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "graphs"}} in a["volumes"]
    mounts = [m for m in a["containers"][0]["volumeMounts"] if m["name"] == "compile-cache"]
    assert mounts == [
        {"name": "compile-cache", "mountPath": "/cache/ragserve/inductor", "subPath": "inductor"},
        {"name": "compile-cache", "mountPath": "/cache/ragserve/extensions", "subPath": "extensions"},
    ]
    b = by_name(objs, "Deployment", "demo-engine-b")["spec"]["template"]["spec"]
    assert all(v["name"] != "compile-cache" for v in b["volumes"])


def test_engine_api_key_from_a_secret():
    """Engines require it (--api-key via RAGSERVE_API_KEY); the router sends it (--engine-api-key)."""
    expected = {"secretKeyRef": {"name": "engine-key", "key": "api-key"}}
    for obj, container in containers(children("full")):
        env = {e["name"]: e.get("valueFrom") for e in container.get("env", [])}
        wanted = {"engine": "RAGSERVE_API_KEY", "router": "RAGSERVE_ENGINE_API_KEY"}.get(container["name"])
        if wanted:
            assert env[wanted] == expected, obj["metadata"]["name"]
    assert "RAGSERVE_API_KEY" not in str(children("minimal"))


def test_secret_redis_url_goes_through_env():
    objs = children("external-redis-secret")
    for _, container in containers(objs):
        env = {e["name"]: e for e in container["env"]}
        if container["name"] in ("router", "cachestore"):
            assert env["RAGSERVE_REDIS"]["valueFrom"]["secretKeyRef"] == {"name": "redis", "key": "u"}
            assert "--redis" not in container["args"]
    assert not [o for o in objs if o["metadata"]["name"] == "demo-redis"]


POOL_REF = {"apiVersion": "ragserve.dev/v1alpha1", "kind": "RAGServeEnginePool"}


def test_pools():
    """One RAGServeEnginePool per pool, the pool's Deployment sized by it; replicas is never applied."""
    spec = parse_spec(FULL, OWNER.name)
    objs = desired_children(OWNER, spec, {"small": 3, "big": 2})
    small = by_name(objs, POOL_KIND, "demo-engine-small")
    assert small["spec"] == {
        "model": "smollm2-135m",
        "minReplicas": 1,
        "maxReplicas": 4,
        "deployment": "demo-engine-small",
    }
    assert small["metadata"]["annotations"] == {DECLARED: "1"}
    assert small["metadata"]["labels"]["ragserve.dev/pool"] == "small"
    assert by_name(objs, "Deployment", "demo-engine-small")["spec"]["replicas"] == 3
    assert by_name(objs, "Deployment", "demo-engine-big")["spec"]["replicas"] == 2


def test_hpa_mode():
    objs = children("hpa")
    hpa = by_name(objs, "HorizontalPodAutoscaler", "demo-engine-small")["spec"]
    assert hpa["scaleTargetRef"] == POOL_REF | {"name": "demo-engine-small"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["metrics"]}
    assert targets == {
        "vllm_num_requests_waiting": "4",
        "vllm_num_requests_running": "8",
        "vllm_kv_cache_usage_perc": "800m",
    }
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_keda_mode():
    scaled = by_name(children("keda"), "ScaledObject", "demo-engine-big")["spec"]
    assert scaled["scaleTargetRef"] == POOL_REF | {"name": "demo-engine-big"}
    queries = {t["name"]: (t["metricType"], t["metadata"]["query"]) for t in scaled["triggers"]}
    pods = 'namespace="ns1",pod=~"demo-engine-big-[a-z0-9]+-[a-z0-9]{5}"'
    assert queries["vllm-num-requests-waiting"] == ("AverageValue", f"sum(vllm:num_requests_waiting{{{pods}}})")
    assert queries["vllm-kv-cache-usage-perc"] == ("Value", f"avg(vllm:kv_cache_usage_perc{{{pods}}})")


def test_prefill_and_decode_pools_scale_on_their_own_signals():
    """A prefill pool's HPA / ScaledObject reads waiting requests and queued prefill tokens, a decode pool's waiting
    and running requests and KV usage, whatever else the RAGServe's autoscaling sets."""
    hpas = {n: by_name(children("pd-hpa"), "HorizontalPodAutoscaler", f"demo-engine-{n}")["spec"] for n in "pd"}
    names = {n: [m["pods"]["metric"]["name"] for m in hpa["metrics"]] for n, hpa in hpas.items()}
    assert names == {
        "p": ["vllm_num_requests_waiting", "ragserve_num_queued_prefill_tokens"],
        "d": ["vllm_num_requests_waiting", "vllm_num_requests_running", "vllm_kv_cache_usage_perc"],
    }
    assert hpas["p"]["metrics"][1]["pods"]["target"]["averageValue"] == "2048"
    objs = children("pd-keda")
    triggers = {n: by_name(objs, "ScaledObject", f"demo-engine-{n}")["spec"]["triggers"] for n in "pd"}
    queries = {n: [(t["metricType"], t["metadata"]["query"].split("{")[0]) for t in ts] for n, ts in triggers.items()}
    assert queries == {
        "p": [
            ("AverageValue", "sum(vllm:num_requests_waiting"),
            ("AverageValue", "sum(ragserve:num_queued_prefill_tokens"),
        ],
        "d": [("AverageValue", "sum(vllm:num_requests_waiting"), ("Value", "avg(vllm:kv_cache_usage_perc")],
    }


def mounted(pod: dict, container: dict, path: str) -> dict:
    """The Secret volume mounted at the directory of `path`."""
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True
    return next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]


def test_cachestore_tls_mtls_and_token():
    """The chart's cachestore.tls / cachestore.auth: both ends get their files from the Secrets and flags for them."""
    objs = children("secure")
    store_pod = by_name(objs, "StatefulSet", "demo-cachestore")["spec"]["template"]["spec"]
    store = store_pod["containers"][0]
    args = parse(store)
    assert mounted(store_pod, store, args.tls_cert)["secretName"] == "store-tls"
    assert (args.tls_cert, args.tls_key) == ("/etc/ragserve/tls/tls.crt", "/etc/ragserve/tls/tls.key")
    assert args.tls_client_ca == "/etc/ragserve/tls/ca.crt"
    assert mounted(store_pod, store, args.auth_token_file)["secretName"] == "store-token"
    assert args.auth_token_file == "/etc/ragserve/auth/token"
    assert store["readinessProbe"]["tcpSocket"] == {"port": "grpc"}  # a gRPC probe cannot speak TLS

    engine_pod = by_name(objs, "Deployment", "demo-engine-a")["spec"]["template"]["spec"]
    engine = engine_pod["containers"][0]
    args = parse(engine)
    assert mounted(engine_pod, engine, args.cachestore_tls_ca) == {
        "secretName": "store-tls",
        "defaultMode": 0o440,
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    assert mounted(engine_pod, engine, args.cachestore_tls_cert)["secretName"] == "engine-tls"
    assert args.cachestore_tls_key.endswith("/tls.key") and args.cachestore_tls_cert.endswith("/tls.crt")
    assert mounted(engine_pod, engine, args.cachestore_token_file)["secretName"] == "store-token"


def test_registry_token_for_router_and_engines():
    objs = children("secure")
    for name in ("demo-router", "demo-engine-a"):
        pod = by_name(objs, "Deployment", name)["spec"]["template"]["spec"]
        args = parse(pod["containers"][0])
        assert args.registry_token_file == "/etc/ragserve/registry-token/token"
        assert mounted(pod, pod["containers"][0], args.registry_token_file)["secretName"] == "registry"
    router = parse(
        by_name(children("minimal"), "Deployment", "demo-router")["spec"]["template"]["spec"]["containers"][0]
    )
    assert router.registry_token_file is None and router.registry_allow_unauthenticated is True


def test_router_store_lookups_get_the_cachestore_tls_and_token():
    """The router looks blocks up in the cachestore for store-aware routing, so it is one of the store's clients."""
    pod = by_name(children("secure"), "Deployment", "demo-router")["spec"]["template"]["spec"]
    router, args = pod["containers"][0], parse(pod["containers"][0])
    assert mounted(pod, router, args.cachestore_tls_ca)["secretName"] == "store-tls"
    assert mounted(pod, router, args.cachestore_tls_cert)["secretName"] == "engine-tls"
    assert mounted(pod, router, args.cachestore_token_file)["secretName"] == "store-token"


def test_registry_mutual_tls_for_router_and_engines():
    """The chart's router.tls: the router serves the registry with its certificate and requires the engines'; mTLS
    authenticates engines, so the router is not told to accept unauthenticated registrations."""
    objs = children("registry-mtls")
    router_pod = by_name(objs, "Deployment", "demo-router")["spec"]["template"]["spec"]
    router = router_pod["containers"][0]
    args = parse(router)
    assert mounted(router_pod, router, args.tls_cert)["secretName"] == "router-tls"
    assert (args.tls_key, args.tls_client_ca) == ("/etc/ragserve/tls/tls.key", "/etc/ragserve/tls/ca.crt")
    assert args.registry_allow_unauthenticated is False and args.registry_token_file is None
    engine_pod = by_name(objs, "Deployment", "demo-engine-a")["spec"]["template"]["spec"]
    engine = engine_pod["containers"][0]
    args = parse(engine)
    assert mounted(engine_pod, engine, args.router_tls_ca)["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert mounted(engine_pod, engine, args.router_tls_ca)["secretName"] == "router-tls"
    assert mounted(engine_pod, engine, args.router_tls_cert)["secretName"] == "eng"
    assert args.router_tls_key == "/etc/ragserve/router-client/tls.key"


def test_registry_tls_without_client_certificates_still_needs_a_token():
    """Server-only TLS authenticates the router, not the engines: without a token the router is told so."""
    spec = parse_spec(
        {"engines": [{"name": "a", "model": "m"}], "router": {"tls": {"enabled": True, "secretName": "t"}}}
    )
    pod = by_name(desired_children(OWNER, spec, {"a": 1}), "Deployment", "demo-router")["spec"]["template"]["spec"]
    args = parse(pod["containers"][0])
    assert args.tls_cert == "/etc/ragserve/tls/tls.crt" and args.tls_client_ca is None
    assert args.registry_allow_unauthenticated is True


def test_no_cachestore():
    objs = children("no-cachestore")
    assert not [o for o in objs if o["metadata"]["name"].startswith("demo-cachestore")]
    engine = by_name(objs, "Deployment", "demo-engine-a")["spec"]["template"]["spec"]["containers"][0]
    assert "--cachestore" not in engine["args"]


def test_an_embedding_pool_runs_task_embed_without_the_cachestore():
    objs = children("embedding-pool")
    embed = parse(by_name(objs, "Deployment", "demo-engine-embed")["spec"]["template"]["spec"]["containers"][0])
    assert (embed.task, embed.model, embed.cachestore) == ("embed", "all-minilm-l6-v2", None)
    assert embed.router == "demo-router-registry.ns1.svc:50051"  # registered, routed by model like any pool
    generate = parse(by_name(objs, "Deployment", "demo-engine-a")["spec"]["template"]["spec"]["containers"][0])
    assert generate.task == "generate" and generate.cachestore


@pytest.mark.parametrize(
    "mode,current,noted,expected",
    [
        ("none", None, None, 3),  # a new pool: the spec's replicas
        ("none", 5, "3", None),  # scaled by someone else since: theirs stands
        ("none", 5, "2", 3),  # the spec's replicas changed: applied
        ("none", 5, "autoscaled", 3),  # autoscaling switched off: the spec's replicas again
        ("none", 3, "2", None),  # changed, but already there
        ("operator", None, None, 2),  # created at minReplicas
        ("operator", 3, "autoscaled", None),  # the autoscaler's choice is kept
        ("operator", 9, "autoscaled", 4),  # ... within min/max
        ("operator", 1, "autoscaled", 2),
        ("hpa", None, None, 2),
        ("hpa", 3, "3", None),  # the HPA's from then on
        ("keda", 7, "autoscaled", None),
    ],
)
def test_scale_writes_of_the_reconcile(mode: str, current: int | None, noted: str | None, expected: int | None):
    raw = {"engines": [{"name": "a", "model": "m", "replicas": 3, "minReplicas": 2}], "autoscaling": {"mode": mode}}
    spec = parse_spec(raw)
    live = None if noted is None else {"metadata": {"annotations": {DECLARED: noted}}, "spec": {"replicas": current}}
    assert scale_to(spec, spec.pools[0], live) == expected


def test_engine_https_pools_serve_tls_advertise_https_and_the_router_presents_its_client_certificate():
    """engines[].httpTls and router.engineTls (the chart's values of the same names): the real CLI parses each
    container's flags; the files are where the Secrets are mounted; probes and discovery follow the scheme."""
    objs = children("engine-https")
    pods = {p: by_name(objs, "Deployment", f"demo-engine-{p}")["spec"]["template"] for p in ("m", "h", "p")}
    for name, pod in pods.items():
        args, engine = parse(pod["spec"]["containers"][0]), pod["spec"]["containers"][0]
        https, client_auth = name != "p", name == "m"
        assert args.tls_cert_file == ("/etc/ragserve/http-tls/tls.crt" if https else None), name
        assert args.tls_key_file == ("/etc/ragserve/http-tls/tls.key" if https else None), name
        assert args.tls_client_ca_file == ("/etc/ragserve/http-tls/ca.crt" if client_auth else None), name
        assert args.advertise_url == f"{'https' if https else 'http'}://10.0.0.7:8000", name
        assert pod["metadata"].get("annotations", {}).get("ragserve.io/scheme") == ("https" if https else None)
        volume = next((v for v in pod["spec"]["volumes"] if v["name"] == "http-tls"), None)
        assert (volume["secret"]["secretName"] if volume else None) == ("eng-tls" if https else None), name
        mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
        assert mounts.get("http-tls") == ("/etc/ragserve/http-tls" if https else None), name
        ready = engine["readinessProbe"]
        if client_auth:  # the kubelet presents no client certificate
            assert ready["tcpSocket"] == {"port": "http"} and "httpGet" not in ready
        else:
            assert ready["httpGet"].get("scheme", "HTTP") == ("HTTPS" if https else "HTTP"), name
    router = by_name(objs, "Deployment", "demo-router")["spec"]["template"]["spec"]
    args = parse(router["containers"][0])
    assert args.engine_ca_file == "/etc/ragserve/engine-ca/ca.crt"
    assert (args.engine_client_cert_file, args.engine_client_key_file) == (
        "/etc/ragserve/engine-client/tls.crt",
        "/etc/ragserve/engine-client/tls.key",
    )
    volumes = {v["name"]: v["secret"]["secretName"] for v in router["volumes"] if "secret" in v}
    assert volumes["engine-ca"] == "eng-ca" and volumes["engine-client"] == "router-client"
