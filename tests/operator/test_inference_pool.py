"""spec.gateway.inferencePool in a RAGServe: the operator builds the objects the chart renders for the same
settings (tests/charts/conftest's "inference-pool" scenario, here with fullnameOverride "demo"): the
InferencePool of the ragserve engine pods, the router's EPP Service, the HTTPRoute to the pool and the router's
--epp-* flags; they validate against the upstream CRDs (tests/helpers/gateway_api.py) and strictly, invalid
settings are refused, and a real operator against kube_sim creates, updates and prunes them."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from ragserve_operator.apply import contains
from ragserve_operator.names import Owner
from ragserve_operator.spec import SpecError, apply_defaults, parse_spec, spec_schema
from tests.charts.conftest import CHART, SCENARIOS
from tests.helpers import gateway_api
from tests.helpers.ragserve_cr import BASE, DEPLOYMENTS, NS, ragserve
from tests.operator import rbac
from tests.operator.test_vllm_pools import chart_objects, one, operator_objects

CHART_VALUES = SCENARIOS["inference-pool"]
GATEWAY = {  # the chart scenario's, less its NetworkPolicy peers (the operator renders no NetworkPolicy)
    "inferencePool": {k: v for k, v in CHART_VALUES["gateway"]["inferencePool"].items() if k != "from"}
}
SPEC = {"engines": CHART_VALUES["engines"], "gateway": GATEWAY}
OWNER = Owner("demo", rbac.NAMESPACE, "4b1c2a0e-0000-4000-8000-000000000003")
POOL, EPP = "demo-inference-pool", "demo-epp"
GATEWAY_KINDS = ("InferencePool", "HTTPRoute")
INFERENCE_POOLS, HTTP_ROUTES = (
    "inference.networking.k8s.io/v1/inferencepools",
    "gateway.networking.k8s.io/v1/httproutes",
)


def with_pool(**over) -> dict:
    return {**SPEC, "gateway": {"inferencePool": {**GATEWAY["inferencePool"], **over}}}


def built(spec: dict = SPEC, owner: Owner = OWNER) -> list[dict]:
    """The operator's children for `spec`."""
    return operator_objects(spec, owner)


def release_blind(value):
    """The value with the release's instance label left out (the chart's is the Helm release, ours the RAGServe)."""
    if isinstance(value, dict):
        return {k: release_blind(v) for k, v in value.items() if k != "app.kubernetes.io/instance"}
    if isinstance(value, list):
        return [release_blind(v) for v in value]
    return value


def router(objs) -> dict:
    (c,) = one(objs, "Deployment", "demo-router")["spec"]["template"]["spec"]["containers"]
    return c


def epp_args(args: list[str]) -> list[str]:
    """The --epp-* flags and their values, in order."""
    valued = ("--epp-port", "--epp-cert-file", "--epp-key-file")
    return [a for i, a in enumerate(args) if a.startswith("--epp-") or (i and args[i - 1] in valued)]


def test_pool_service_and_route_are_the_charts():
    chart, ours = chart_objects(CHART_VALUES), built()
    for kind, name in (("InferencePool", POOL), ("Service", EPP), ("HTTPRoute", POOL)):
        assert release_blind(one(ours, kind, name)["spec"]) == release_blind(one(chart, kind, name)["spec"]), kind
    assert one(ours, "InferencePool", POOL)["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "demo"


@pytest.mark.parametrize(
    "tls",
    [{"mode": "selfSigned"}, {"mode": "secret", "secretName": "epp-cert"}, {"mode": "plaintext"}],
    ids=["self-signed", "secret", "plaintext"],
)
def test_router_serves_the_epp_as_the_charts_does(tls: dict):
    values = {
        **CHART_VALUES,
        "gateway": {"inferencePool": {**CHART_VALUES["gateway"]["inferencePool"], "eppPort": 9102, "tls": tls}},
    }
    chart, ours = router(chart_objects(values)), router(built(with_pool(eppPort=9102, tls=tls)))
    assert epp_args(ours["args"]) == epp_args(chart["args"])
    assert epp_args(ours["args"])[:2] == ["--epp-port", "9102"]
    assert [p for p in ours["ports"] if p["name"] == "epp"] == [
        {"name": "epp", "containerPort": 9102, "protocol": "TCP"}
    ]
    assert [m for m in ours["volumeMounts"] if m["name"] == "epp-tls"] == [
        m for m in chart["volumeMounts"] if m["name"] == "epp-tls"
    ]
    pod = one(built(with_pool(tls=tls)), "Deployment", "demo-router")["spec"]["template"]["spec"]
    volumes = [v for v in pod["volumes"] if v["name"] == "epp-tls"]
    assert volumes == (
        [{"name": "epp-tls", "secret": {"secretName": "epp-cert", "defaultMode": 0o440}}]
        if tls.get("secretName")
        else []
    )


def test_children_validate_against_upstream_and_strictly():
    objs = built()
    assert {o["kind"] for o in objs} >= set(GATEWAY_KINDS)
    for obj in objs:
        if obj["kind"] in GATEWAY_KINDS:
            assert gateway_api.problems(obj) == [], obj["kind"]
        elif obj["kind"] in ("Service", "Deployment"):
            kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_nothing_without_the_feature():
    objs = built({"engines": SPEC["engines"]})
    assert not [o for o in objs if o["kind"] in GATEWAY_KINDS or o["metadata"]["name"] == EPP]
    assert "--epp-port" not in router(objs)["args"] and [p["name"] for p in router(objs)["ports"]] == ["http", "grpc"]
    route_off = built(with_pool(httpRoute={"enabled": False}))
    assert one(route_off, "InferencePool", POOL) and not [o for o in route_off if o["kind"] == "HTTPRoute"]


def test_crd_defaults_are_the_charts():
    chart = yaml.safe_load((CHART / "values.yaml").read_text())["gateway"]["inferencePool"]
    ours = apply_defaults(spec_schema(), {"engines": [{"name": "a", "model": "m"}]})["gateway"]["inferencePool"]
    assert ours == {k: v for k, v in chart.items() if k not in ("from", "annotations")} | {
        "tls": {"mode": "selfSigned"},
        "httpRoute": {"enabled": False, "parentRefs": [], "requestTimeout": "300s"},
    }
    assert chart["tls"] == {"mode": "selfSigned", "secretName": ""}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {
                **with_pool(),
                "engines": [*SPEC["engines"], {"name": "v", "model": "/m", "runtime": "vllm", "gpus": 1}],
                "router": {"tokenizer": {"path": "/t"}},
            },
            "gateway.inferencePool: runtime vllm pools cannot be InferencePool members",
        ),
        (with_pool(tls={"mode": "secret"}), "gateway.inferencePool.tls.mode secret needs tls.secretName"),
        (with_pool(httpRoute={"enabled": True}), "gateway.inferencePool.httpRoute needs parentRefs"),
        (with_pool(failureMode="Ignore"), "'Ignore' is not one of ['FailClose', 'FailOpen']"),
        (with_pool(httpRoute={"enabled": True, "parentRefs": [{"namespace": "x"}]}), "'name' is a required property"),
    ],
    ids=["vllm-pool", "secret-without-name", "route-without-parent", "bad-failure-mode", "parent-without-name"],
)
def test_invalid_settings_are_refused(spec: dict, message: str):
    with pytest.raises(SpecError) as err:
        parse_spec(spec, "demo")
    assert message in str(err.value)


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_operator_creates_updates_and_prunes_them(kube, operator, eventually):
    body = await kube.call("POST", BASE, ragserve("demo", SPEC))
    owner = Owner.of({**body, "metadata": {**body["metadata"], "namespace": NS}})
    desired = {(o["kind"], o["metadata"]["name"]): o for o in built(SPEC, owner)}
    where = {"InferencePool": INFERENCE_POOLS, "HTTPRoute": HTTP_ROUTES, "Service": "v1/services"}
    for kind, name in (("InferencePool", POOL), ("HTTPRoute", POOL), ("Service", EPP)):
        await eventually(lambda: kube.obj(where[kind], name), what=f"{kind} {name}", timeout=60)  # noqa: B023
        live = kube.obj(where[kind], name)
        assert contains(live["spec"], desired[(kind, name)]["spec"]), f"{kind} {name} differs"
        assert owner.owns(live)
    args = lambda: router([kube.obj(DEPLOYMENTS, "demo-router")])["args"]  # noqa: E731
    assert epp_args(args()) == ["--epp-port", "9002"]

    # FailOpen and no route: the pool is patched, the route pruned
    await kube.call(
        "PATCH",
        f"{BASE}/demo",
        {"spec": {"gateway": {"inferencePool": {"failureMode": "FailOpen", "httpRoute": {"enabled": False}}}}},
    )

    def fail_open() -> bool:
        return kube.obj(INFERENCE_POOLS, POOL)["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"

    await eventually(fail_open, what="failureMode FailOpen", timeout=60)
    await eventually(lambda: kube.obj(HTTP_ROUTES, POOL) is None, what="the HTTPRoute pruned", timeout=60)

    # off: the pool and the EPP Service go, the router stops serving ext_proc
    await kube.call("PATCH", f"{BASE}/demo", {"spec": {"gateway": {"inferencePool": {"enabled": False}}}})
    await eventually(lambda: kube.obj(INFERENCE_POOLS, POOL) is None, what="the InferencePool pruned", timeout=60)
    await eventually(lambda: kube.obj("v1/services", EPP) is None, what="the EPP Service pruned", timeout=60)
    await eventually(lambda: "--epp-port" not in args(), what="the router without --epp-port", timeout=60)
