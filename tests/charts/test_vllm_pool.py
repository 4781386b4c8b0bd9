"""runtime: vllm engine pools: a StatefulSet of vLLM pods (headless Service, stable DNS names) whose command is
ragserve.vllm_command.vllm_command(), and one router --external-engine per replica; mixed with ragserve pools in
one release (conftest's "vllm-mixed" scenario also runs through every generic render check)."""

from __future__ import annotations

import json

import pytest

from ragserve.external_engine import ExternalEngineSpec
from ragserve.vllm_command import VllmPod, external_engines, vllm_command
from tests.charts.conftest import SCENARIOS
from tests.charts.test_engine_command import DEFAULTS, FULLNAME, host, merged, rendered_args


def vllm_pools(values: dict) -> list[dict]:
    pools = [merged(values["engineDefaults"], raw) for raw in values["engines"]]
    return [p for p in pools if p["runtime"] == "vllm"]


def vllm_pod(pool: dict) -> VllmPod:
    v = pool["vllm"]
    return VllmPod(
        model=pool["model"],
        port=v["port"],
        served_model_name=pool["servedModelName"],
        block_size=v["blockSize"],
        gpus=pool["gpus"],
        events_port=v["eventsPort"],
        replay_port=v["replayPort"],
        extra_args=tuple(v["extraArgs"]),
    )


def vllm_external_engines(values: dict) -> list[str]:
    """The router's --external-engine values for the merged chart values."""
    out = []
    for pool in vllm_pools(values):
        name = f"{FULLNAME}-vllm-{pool['name']}"
        out += external_engines(name, host(f"vllm-{pool['name']}", values), pool["replicas"], vllm_pod(pool))
    return out


def vllm_block_size(values: dict) -> int | None:
    sizes = {p["vllm"]["blockSize"] for p in vllm_pools(values)}
    return sizes.pop() if sizes else None


MIXED = SCENARIOS["vllm-mixed"]
STS = f"{FULLNAME}-vllm-llama"


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_mixed_release_renders_a_ragserve_deployment_and_a_vllm_statefulset(render):
    docs = render(MIXED)
    assert one(docs, "Deployment", f"{FULLNAME}-engine-small")
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-llama")]
    sts, svc = one(docs, "StatefulSet", STS), one(docs, "Service", STS)
    assert sts["spec"]["serviceName"] == STS and sts["spec"]["replicas"] == 2
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 8000, "events": 5557, "replay": 5558}
    labels = sts["spec"]["template"]["metadata"]["labels"]
    # Not component=engine: the router's Kubernetes discovery and the engine PodMonitor select ragserve engines.
    assert labels["app.kubernetes.io/component"] == "vllm" and labels["ragserve.dev/pool"] == "llama"
    assert one(docs, "PodDisruptionBudget", STS)["spec"]["selector"]["matchLabels"] == labels


def test_vllm_pod_spec(render):
    pool = vllm_pools(merged(DEFAULTS, MIXED))[0]
    pod = one(render(MIXED), "StatefulSet", STS)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "docker.io/vllm/vllm-openai:v0.11.0" and c["command"] == ["vllm"]
    assert c["args"] == vllm_command(vllm_pod(pool))
    args = c["args"]
    assert args[:2] == ["serve", "/models/llama-3.1-8b-instruct"] and "--enable-prefix-caching" in args
    assert args[args.index("--block-size") + 1] == "32"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert json.loads(args[args.index("--kv-events-config") + 1]) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "",
    }
    assert args[-2:] == ["--max-model-len", "8192"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2 and c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "events": 5557, "replay": 5558}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    model = [m for m in c["volumeMounts"] if m["name"] == "model"]
    assert model == [{"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "llama"}]
    assert pod["tolerations"] == pool["tolerations"]


def test_router_follows_every_vllm_replica(render):
    docs = render(MIXED)
    args = rendered_args(docs, "Deployment", f"{FULLNAME}-router", "router")
    specs = [ExternalEngineSpec.parse(args[i + 1]) for i, a in enumerate(args) if a == "--external-engine"]
    svc = f"{STS}.ai.svc.cluster.local"
    assert [(s.url, s.events, s.replay, s.dp) for s in specs] == [
        (f"http://{STS}-{i}.{svc}:8000", f"tcp://{STS}-{i}.{svc}:5557", f"tcp://{STS}-{i}.{svc}:5558", 1)
        for i in range(2)
    ]
    assert args[args.index("--tokenizer") + 1] == "/tokenizer/llama"
    assert args[args.index("--external-block-size") + 1] == "32"
    router = one(docs, "Deployment", f"{FULLNAME}-router")["spec"]["template"]["spec"]
    (c,) = router["containers"]
    assert {"name": "tokenizer", "mountPath": "/tokenizer", "readOnly": True, "subPath": "llama"} in c["volumeMounts"]
    assert {"name": "tokenizer", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in router[
        "volumes"
    ]


def test_network_policy_lets_the_router_reach_events_and_replay(render):
    policy = one(render(MIXED), "NetworkPolicy", f"{FULLNAME}-vllm")
    router = {
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/instance": "rs",
        "app.kubernetes.io/name": "ragserve",
    }
    events = [r for r in policy["spec"]["ingress"] if {"port": "events"} in r["ports"]]
    assert events == [
        {"ports": [{"port": "events"}, {"port": "replay"}], "from": [{"podSelector": {"matchLabels": router}}]}
    ]


def test_ragserve_is_the_default_runtime(render):
    assert DEFAULTS["engineDefaults"]["runtime"] == "ragserve"
    docs = render({})
    assert not [d for d in docs if d["kind"] == "StatefulSet" and "-vllm-" in d["metadata"]["name"]]
    assert "--external-engine" not in rendered_args(docs, "Deployment", f"{FULLNAME}-router", "router")


def llama(**over) -> dict:
    return {**MIXED["engines"][1], **over}


TOKENIZER = MIXED["router"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engines": [{"name": "x", "model": "m", "runtime": "sglang"}]}, "runtime"),
        ({"router": TOKENIZER, "engines": [{k: v for k, v in llama().items() if k != "model"}]}, "model"),
        ({"engines": [llama()]}, "engines[llama]: runtime vllm needs router.tokenizer.path"),
        ({"router": TOKENIZER, "engines": [llama(gpus=0)]}, "engines[llama]: runtime vllm needs gpus >= 1"),
        (
            {"router": TOKENIZER, "engines": [llama(autoscaling={"mode": "hpa"})]},
            "engines[llama]: runtime vllm pools cannot autoscale",
        ),
        (
            {"router": TOKENIZER, "engines": [llama(), llama(name="other", vllm={"blockSize": 16})]},
            "runtime vllm pools need one vllm.blockSize (the router has one --external-block-size), got 16, 32",
        ),
    ],
    ids=["bad-runtime", "no-model", "no-tokenizer", "no-gpu", "autoscaling", "two-block-sizes"],
)
def test_invalid_vllm_pools_fail_with_a_message(render, values, message):
    with pytest.raises(Exception) as err:
        render(values)
    assert message in str(err.value)
