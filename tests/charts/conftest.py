"""The Helm chart rendered for named value sets (scenarios), with helm-python-sdk: no helm binary, no cluster.

Tests that take a `scenario` argument run once per value set below.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from tests.helpers import process
from tests.helpers.net import free_port

CHART = Path(__file__).resolve().parents[2] / "charts" / "ragserve"
RELEASE, NAMESPACE = "rs", "ai"

GPU_POOL = {
    "name": "llama",
    "model": "llama-3-8b-instruct",
    "servedModelName": "llama-3-8b",
    "gpus": 1,
    "image": {"tag": "0.1.0-cuda"},
    "modelSource": {"type": "pvc", "pvc": {"claimName": "models", "subPath": "llama"}},
    "engine": {
        "dtype": "bfloat16",
        "device": "cuda",
        "blockSize": 32,
        "kvCacheDtype": "fp8",
        "attentionBackend": "triton",
        "gpuMemoryUtilization": 0.92,
        "maxModelLen": 8192,
        "maxNumSeqs": 128,
        "maxNumBatchedTokens": 8192,
        "preemptionMode": "swap",
        "swapSpace": 4,
        "schedulingPolicy": "priority",
        "enablePrefixCaching": True,
    },
    "resources": {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "runtimeClassName": "nvidia",
    "shmSize": "8Gi",
    "maxBodyBytes": 4194304,
}

SCENARIOS: dict[str, dict] = {
    "default": {},
    "gpu-pool": {"engines": [GPU_POOL]},
    "two-pools": {
        "engines": [
            {"name": "small", "model": "smollm2-135m", "replicas": 2, "pdb": {"enabled": True}},
            {
                "name": "big",
                "model": "/models/qwen3/model.gguf",
                "gpus": 2,
                "modelSource": {"type": "hostPath", "hostPath": {"path": "/mnt/models"}},
                "engine": {"numGpuBlocks": 4096, "kvCacheMemory": "20GiB", "enablePrefixCaching": False},
            },
            {
                "name": "baked",
                "model": "mistral-7b",
                "modelSource": {"type": "image", "image": {"repository": "registry.local/models/mistral", "tag": "v1"}},
            },
        ],
        "cachestore": {"replicas": 3, "disk": {"persistence": {"enabled": False, "size": "20Gi"}}},
    },
    "keda": {
        "engines": [
            {
                **GPU_POOL,
                "autoscaling": {
                    "mode": "keda",
                    "minReplicas": 1,
                    "maxReplicas": 8,
                    "targetGPUUtilization": 75,
                    "scaleDownStabilizationSeconds": 600,
                },
            }
        ],
    },
    "hpa": {
        "redis": {"enabled": True},
        "router": {"autoscaling": {"enabled": True, "targetRequestsPerSecond": 50}},
        "engineDefaults": {"autoscaling": {"mode": "hpa", "maxReplicas": 6, "targetKVCacheUsage": 0.75}},
        "cachestore": {"redisTier": True},
    },
    "tls": {
        "router": {
            "tls": {
                "enabled": True,
                "secretName": "router-tls",
                "clientAuth": True,
                "engineClientSecret": "engine-client-tls",
            },
            "apiKeys": {"existingSecret": "client-keys", "key": "keys"},
            "maxBodyBytes": 1048576,
        },
        "cachestore": {
            "tls": {
                "enabled": True,
                "secretName": "cachestore-tls",
                "clientAuth": True,
                "engineClientSecret": "engine-cachestore-client",
            },
            "auth": {"existingSecret": "cachestore-token"},
            "maxMessageBytes": 33554432,
        },
        "engineApiKey": {"existingSecret": "engine-key"},
    },
    "external-redis": {
        "redis": {"external": {"url": "redis://redis.shared.svc:6379/3"}},
        "router": {"replicas": 3, "kubernetesDiscovery": {"enabled": True}},
        "cachestore": {"redisTier": True},
    },
    "external-redis-secret": {
        "redis": {"external": {"existingSecret": "redis-url", "key": "url"}},
        "router": {"replicas": 2},
    },
    "ingress": {
        "router": {
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
                "hosts": [{"host": "llm.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"}]}],
                "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
            },
            "service": {"type": "LoadBalancer"},
            "httpRoute": {
                "enabled": True,
                "parentRefs": [{"name": "gw", "namespace": "infra"}],
                "hostnames": ["llm.example.com"],
            },
        },
        "networkPolicy": {
            "routerFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
        },
    },
    "monitoring": {
        "monitoring": {
            "monitors": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "prometheusRule": {"enabled": True},
            "grafanaDashboard": {"enabled": True},
        },
    },
    "vllm-mixed": {
        "router": {"tokenizer": {"path": "/tokenizer/llama", "pvc": {"claimName": "models", "subPath": "llama"}}},
        "engines": [
            {"name": "small", "model": "smollm2-135m"},
            {
                "name": "llama",
                "runtime": "vllm",
                "model": "/models/llama-3.1-8b-instruct",
                "servedModelName": "llama-3.1-8b",
                "replicas": 2,
                "gpus": 2,
                "modelSource": {"type": "pvc", "pvc": {"claimName": "models", "subPath": "llama"}},
                "vllm": {"blockSize": 32, "extraArgs": ["--max-model-len", "8192"]},
                "resources": {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "pdb": {"enabled": True},
            },
        ],
        "monitoring": {"monitors": {"enabled": True}},
    },
    "inference-pool": {
        "engines": [
            {"name": "small", "model": "smollm2-135m", "replicas": 2},
            {"name": "big", "model": "qwen3-0.6b", "replicas": 3},
        ],
        "gateway": {
            "inferencePool": {
                "enabled": True,
                "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}],
                "httpRoute": {
                    "enabled": True,
                    "parentRefs": [{"name": "inference-gateway", "namespace": "gateways", "sectionName": "http"}],
                    "hostnames": ["llm.example.com"],
                },
            }
        },
    },
    "operator": {"operator": {"enabled": True}},
    "operator-only": {
        "operator": {"enabled": True, "watchNamespace": "teams"},
        "router": {"enabled": False},
        "cachestore": {"enabled": False},
        "engines": [],
        "networkPolicy": {"enabled": False},
    },
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "scenario" in metafunc.fixturenames:
        metafunc.parametrize("scenario", list(SCENARIOS))


@pytest.fixture(scope="session")
def chart_dir() -> Path:
    return CHART


@pytest.fixture(scope="session")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart):
    """render(values) -> every rendered manifest as a dict (NOTES.txt excluded)."""

    def _render(values: dict) -> list[dict]:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
        docs = []
        for path, text in sorted(out.items()):
            if not path.endswith(".txt"):
                docs += [d for d in yaml.safe_load_all(text) if d]
        return docs

    return _render


@pytest.fixture(scope="session")
def render_fails(chart):
    """render_fails(values, message): values the schema accepts (each is fine alone) whose combination the chart
    refuses to render, saying message."""

    def _check(values: dict, message: str) -> None:
        chart.validate_schema(values)
        with pytest.raises(helm.HelmRenderError) as exc:
            chart.render(values, name="rs", namespace="ai")
        assert message in str(exc.value)

    return _check


@pytest.fixture(scope="session")
def scenarios() -> dict[str, dict]:
    return SCENARIOS


@pytest.fixture
def values(scenario: str) -> dict:
    return SCENARIOS[scenario]


@pytest.fixture
def manifests(render, values) -> list[dict]:
    return render(values)


@dataclass
class Server(process.Proc):
    url: str = ""

    def wait_http(self, path: str, timeout: float) -> None:
        process.wait_http(self.url + path, proc=self, timeout=timeout)


class Stack:
    """`ragserve` processes on loopback free ports, stopped at teardown."""

    port = staticmethod(free_port)

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []

    def start(self, name: str, args: list[str], url: str) -> Server:
        proc = process.start(
            name, [sys.executable, "-m", "ragserve.cli", *args], self.tmp / f"{name}.log", cwd=self.tmp
        )
        self.procs.append(Server(proc.name, proc.popen, proc.log, url))
        return self.procs[-1]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout=20)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"))
    yield s
    s.stop()
