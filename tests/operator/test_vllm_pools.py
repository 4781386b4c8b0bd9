"""runtime: vllm engine pools in a RAGServe: the operator builds the objects the chart renders for the same
pools (tests/charts/conftest's "vllm-mixed" scenario, here with fullnameOverride "demo"): the vLLM StatefulSet
and headless Service, the router's --external-engine / --tokenizer / --external-block-size flags and tokenizer
mount; they validate strictly, are not autoscaled, and a real operator against kube_sim reconciles them."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml

from ragserve.cli import build_parser
from ragserve.vllm_command import VLLM_IMAGE, VllmPod
from ragserve_operator.apply import contains
from ragserve_operator.children import desired_children
from ragserve_operator.names import Owner
from ragserve_operator.spec import POOL_KIND, SpecError, apply_defaults, parse_spec, spec_schema
from tests.charts.conftest import CHART, SCENARIOS
from tests.helpers.ragserve_cr import BASE, DEPLOYMENTS, NS, POOLS, ragserve
from tests.operator import rbac

CHART_POOL = SCENARIOS["vllm-mixed"]["engines"][1]
LLAMA = {  # the chart scenario's vllm pool, as a RAGServe pool (modelSource pvc -> modelPVC)
    **{k: v for k, v in CHART_POOL.items() if k not in ("modelSource", "pdb")},
    "modelPVC": {"claimName": "models", "subPath": "llama"},
}
SPEC = {
    "engines": [{"name": "small", "model": "smollm2-135m"}, LLAMA],
    "router": {"tokenizer": {"path": "/tokenizer/llama", "pvc": {"claimName": "models", "subPath": "llama"}}},
}
OWNER = Owner("demo", rbac.NAMESPACE, "4b1c2a0e-0000-4000-8000-000000000002")
STS = "demo-vllm-llama"
CHART_DOMAIN = f".{rbac.NAMESPACE}.svc.cluster.local"  # the chart's FQDNs; the operator's end in .<ns>.svc


def chart_objects(values: dict = SCENARIOS["vllm-mixed"]) -> tuple[dict, ...]:
    """The chart's render of `values` with fullnameOverride "demo" (the RAGServe's name)."""
    return rbac.rendered(yaml.safe_dump({**values, "fullnameOverride": "demo"}))


def operator_objects(spec: dict = SPEC, owner: Owner = OWNER) -> list[dict]:
    parsed = parse_spec(spec, owner.name)
    return desired_children(owner, parsed, {pool.name: 1 for pool in parsed.pools})


def one(objs, kind: str, name: str) -> dict:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def normal(value):
    """Quantities as strings, the API server's default port protocol left out."""
    if isinstance(value, dict):
        return {k: normal(v) for k, v in value.items() if (k, v) != ("protocol", "TCP")}
    if isinstance(value, list):
        return [normal(v) for v in value]
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def workload(sts: dict) -> dict:
    """The StatefulSet fields that matter: its spec and pod spec, selector labels but the release's name."""
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    selector = {k: v for k, v in spec["selector"]["matchLabels"].items() if k != "app.kubernetes.io/instance"}
    fields = ("serviceName", "replicas", "podManagementPolicy")
    return normal({**{k: spec[k] for k in fields}, "selector": selector, "pod": pod})


def service(svc: dict) -> dict:
    return normal({k: v for k, v in svc["spec"].items() if k != "selector"})


def test_vllm_statefulset_and_service_are_the_charts():
    chart, ours = chart_objects(), operator_objects()
    assert workload(one(ours, "StatefulSet", STS)) == workload(one(chart, "StatefulSet", STS))
    assert service(one(ours, "Service", STS)) == service(one(chart, "Service", STS))
    (c,) = one(ours, "StatefulSet", STS)["spec"]["template"]["spec"]["containers"]
    args = c["args"]  # spelled out too: equal to the chart's, and what vLLM needs
    assert c["image"] == VLLM_IMAGE and args[:2] == ["serve", "/models/llama-3.1-8b-instruct"]
    assert "--enable-prefix-caching" in args and args[args.index("--block-size") + 1] == "32"
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert (events["endpoint"], events["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == "2"


def router_external(args: list[str]) -> dict:
    flag = [args[i + 1] for i, a in enumerate(args) if a == "--external-engine"]
    value = {"--tokenizer": None, "--external-block-size": None}
    for name in value:
        value[name] = args[args.index(name) + 1] if name in args else None
    return {"--external-engine": flag, **value}


def router_pod(objs) -> dict:
    return one(objs, "Deployment", "demo-router")["spec"]["template"]["spec"]


def test_router_follows_the_vllm_replicas_as_the_charts_does():
    chart, ours = router_pod(chart_objects()), router_pod(operator_objects())
    expected = router_external(chart["containers"][0]["args"])
    expected["--external-engine"] = [
        e.replace(CHART_DOMAIN, f".{rbac.NAMESPACE}.svc") for e in expected["--external-engine"]
    ]
    assert router_external(ours["containers"][0]["args"]) == expected
    assert len(expected["--external-engine"]) == 2 and expected["--external-block-size"] == "32"
    tokenizer = [m for m in ours["containers"][0]["volumeMounts"] if m["name"] == "tokenizer"]
    assert tokenizer == [m for m in chart["containers"][0]["volumeMounts"] if m["name"] == "tokenizer"] != []
    assert [v for v in ours["volumes"] if v["name"] == "tokenizer"] == [
        v for v in chart["volumes"] if v["name"] == "tokenizer"
    ]
    args = build_parser().parse_args(ours["containers"][0]["args"])  # the router's own checks
    assert [e.replay for e in args.external_engine] == [
        f"tcp://{STS}-{i}.{STS}.{rbac.NAMESPACE}.svc:5558" for i in range(2)
    ]


def test_vllm_children_validate_strictly():
    for obj in operator_objects():
        if obj["kind"] != POOL_KIND:
            kubernetes_validate.validate(obj, "1.30.0", strict=True)


@pytest.mark.parametrize("mode", ["none", "operator", "hpa", "keda"])
def test_vllm_pools_are_never_autoscaled(mode: str):
    """Only ragserve pools get a RAGServeEnginePool (and HPA / ScaledObject): the router names every vllm pod."""
    objs = operator_objects({**SPEC, "autoscaling": {"mode": mode}})
    scaled = {
        o["metadata"]["name"] for o in objs if o["kind"] in (POOL_KIND, "HorizontalPodAutoscaler", "ScaledObject")
    }
    assert scaled and all(name == "demo-engine-small" for name in scaled)
    assert one(objs, "StatefulSet", STS)["spec"]["replicas"] == 2
    assert not [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-llama")]


def test_ragserve_is_the_default_runtime():
    pool = apply_defaults(spec_schema(), {"engines": [{"name": "a", "model": "m"}]})["engines"][0]
    assert pool["runtime"] == "ragserve"
    objs = operator_objects({"engines": [{"name": "a", "model": "m"}]})
    assert "--external-engine" not in router_pod(objs)["containers"][0]["args"]
    assert not [o for o in objs if o["kind"] == "StatefulSet" and "-vllm-" in o["metadata"]["name"]]


def test_crd_defaults_are_the_charts_and_vllm_commands():
    chart = yaml.safe_load((CHART / "values.yaml").read_text())["engineDefaults"]["vllm"]
    ours = apply_defaults(spec_schema(), {"engines": [{"name": "a", "model": "m"}]})["engines"][0]["vllm"]
    assert ours == chart
    image = ours["image"]
    assert f"{image['repository']}:{image['tag']}" == VLLM_IMAGE
    pod = VllmPod(model="m")
    assert (pod.port, pod.events_port, pod.replay_port, pod.block_size) == (
        ours["port"],
        ours["eventsPort"],
        ours["replayPort"],
        ours["blockSize"],
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"engines": [{**LLAMA, "runtime": "sglang"}], "router": SPEC["router"]}, "'sglang' is not one of"),
        ({"engines": [LLAMA]}, "runtime vllm pools need router.tokenizer.path"),
        ({"engines": [{**LLAMA, "gpus": 0}], "router": SPEC["router"]}, "runtime vllm needs gpus >= 1"),
        (
            {"engines": [LLAMA, {**LLAMA, "name": "other", "vllm": {"blockSize": 16}}], "router": SPEC["router"]},
            "runtime vllm pools need one vllm.blockSize",
        ),
        ({"engines": [{**LLAMA, "name": "a" * 24}], "router": SPEC["router"]}, "must be at most 52 characters"),
    ],
    ids=["bad-runtime", "no-tokenizer", "no-gpu", "two-block-sizes", "long-statefulset-name"],
)
def test_invalid_vllm_pools_are_refused(spec: dict, message: str):
    with pytest.raises(SpecError) as err:
        parse_spec(spec, "demo-ragserve-with-a-long-name")
    assert message in str(err.value)


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_operator_reconciles_a_mixed_ragserve(kube, operator, eventually):
    body = await kube.call("POST", BASE, ragserve("demo", SPEC))
    owner = Owner.of({**body, "metadata": {**body["metadata"], "namespace": NS}})
    await eventually(lambda: kube.obj("apps/v1/statefulsets", STS), what="the vLLM StatefulSet", timeout=60)
    await eventually(lambda: kube.obj("v1/services", STS), what="its headless Service", timeout=60)
    desired = {(o["kind"], o["metadata"]["name"]): o for o in operator_objects(SPEC, owner)}
    live = {
        ("StatefulSet", STS): kube.obj("apps/v1/statefulsets", STS),
        ("Service", STS): kube.obj("v1/services", STS),
    }
    for (kind, name), obj in live.items():
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
        assert contains(obj["spec"], desired[(kind, name)]["spec"]), f"{kind} {name} differs"
    want = router_external(router_pod(desired.values())["containers"][0]["args"])

    def router_follows() -> bool:
        live_router = kube.obj(DEPLOYMENTS, "demo-router")
        return bool(live_router) and router_external(router_pod([live_router])["containers"][0]["args"]) == want

    await eventually(router_follows, what="router --external-engine flags", timeout=60)
    assert kube.obj(POOLS, "demo-engine-llama") is None and kube.obj(POOLS, "demo-engine-small")

    # two -> three replicas: the StatefulSet and the router's flags follow
    pools = [SPEC["engines"][0], {**LLAMA, "replicas": 3}]
    await kube.call("PATCH", f"{BASE}/demo", {"spec": {"engines": pools}})
    sts = "apps/v1/statefulsets"
    await eventually(lambda: kube.obj(sts, STS)["spec"]["replicas"] == 3, what="3 vLLM replicas", timeout=60)
    want = router_external(router_pod(operator_objects({**SPEC, "engines": pools}, owner))["containers"][0]["args"])
    assert len(want["--external-engine"]) == 3
    await eventually(router_follows, what="router follows 3 replicas", timeout=60)
