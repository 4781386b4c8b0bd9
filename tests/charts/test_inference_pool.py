"""gateway.inferencePool: the release's ragserve engine pods as an InferencePool (inference.networking.k8s.io/v1)
whose Endpoint Picker is the router (ext_proc on --epp-port, behind its own Service), and an HTTPRoute from a
Gateway the user names to the pool. They validate against the upstream CRDs (tests/helpers/gateway_api.py);
the conftest "inference-pool" scenario also runs through every generic render check, and with the feature off
the chart renders what it rendered before (test_default_render_unchanged.py)."""

from __future__ import annotations

import pytest

from tests.charts.conftest import SCENARIOS
from tests.charts.test_engine_command import DEFAULTS, FULLNAME, rendered_args
from tests.helpers import gateway_api

VALUES = SCENARIOS["inference-pool"]
POOL, EPP = f"{FULLNAME}-inference-pool", f"{FULLNAME}-epp"
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
GATEWAYS = VALUES["gateway"]["inferencePool"]["from"]


def with_pool(**over) -> dict:
    return {**VALUES, "gateway": {"inferencePool": {**VALUES["gateway"]["inferencePool"], **over}}}


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_of(docs: list[dict], name: str) -> dict:
    return one(docs, "Deployment", name)["spec"]["template"]


def test_pool_epp_service_and_route_validate_against_upstream(render):
    docs = render(VALUES)
    pool, route = one(docs, "InferencePool", POOL), one(docs, "HTTPRoute", POOL)
    assert gateway_api.problems(pool) == [] and gateway_api.problems(route) == []
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": EPP,
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert route["spec"]["parentRefs"] == VALUES["gateway"]["inferencePool"]["httpRoute"]["parentRefs"]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": POOL}]
    assert rule["timeouts"] == {"request": "300s"}


def test_pool_members_are_exactly_the_ragserve_engine_pods(render):
    docs = render(VALUES)
    selector = one(docs, "InferencePool", POOL)["spec"]["selector"]["matchLabels"]
    members = {
        d["metadata"]["name"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    }
    assert members == {f"{FULLNAME}-engine-small", f"{FULLNAME}-engine-big"}
    for name in members:
        (engine,) = pod_of(docs, name)["spec"]["containers"]
        assert {"name": "http", "containerPort": 8000} in engine["ports"]
    assert one(docs, "InferencePool", POOL)["spec"]["targetPorts"] == [{"number": 8000}]


@pytest.mark.parametrize(
    ("tls", "flags", "app_protocol"),
    [
        ({"mode": "selfSigned"}, [], "grpc"),
        (
            {"mode": "secret", "secretName": "epp-cert"},
            ["--epp-cert-file", "/etc/ragserve/epp-tls/tls.crt", "--epp-key-file", "/etc/ragserve/epp-tls/tls.key"],
            "grpc",
        ),
        ({"mode": "plaintext"}, ["--epp-plaintext"], "kubernetes.io/h2c"),
    ],
    ids=["self-signed", "secret", "plaintext"],
)
def test_router_serves_the_epp(render, tls: dict, flags: list[str], app_protocol: str):
    docs = render(with_pool(eppPort=9102, tls=tls))
    args = rendered_args(docs, "Deployment", f"{FULLNAME}-router", "router")
    start = args.index("--epp-port")
    assert args[start : start + 2 + len(flags)] == ["--epp-port", "9102", *flags]
    assert not [a for a in args[start + 2 + len(flags) :] if a.startswith("--epp")]
    pod = pod_of(docs, f"{FULLNAME}-router")
    (router,) = pod["spec"]["containers"]
    assert {"name": "epp", "containerPort": 9102} in router["ports"]
    (port,) = one(docs, "Service", EPP)["spec"]["ports"]
    assert port == {"name": "epp", "port": 9102, "targetPort": "epp", "protocol": "TCP", "appProtocol": app_protocol}
    assert one(docs, "InferencePool", POOL)["spec"]["endpointPickerRef"]["port"] == {"number": 9102}
    mounts = [m for m in router["volumeMounts"] if m["name"] == "epp-tls"]
    volumes = [v for v in pod["spec"]["volumes"] if v["name"] == "epp-tls"]
    if tls["mode"] == "secret":
        assert mounts == [{"name": "epp-tls", "mountPath": "/etc/ragserve/epp-tls", "readOnly": True}]
        assert volumes == [{"name": "epp-tls", "secret": {"secretName": "epp-cert", "defaultMode": 0o440}}]
    else:
        assert mounts == volumes == []


def test_failure_mode_and_port_default_to_upstreams():
    ours = DEFAULTS["gateway"]["inferencePool"]
    ref = gateway_api.schema("inference.networking.k8s.io/v1", "InferencePool")["properties"]["spec"]["properties"]
    ref = ref["endpointPickerRef"]["properties"]
    assert ours["enabled"] is False
    assert ours["failureMode"] == ref["failureMode"]["default"] == "FailClose"
    assert ours["eppPort"] == 9002  # the port upstream's EPPs and gateways assume
    assert ours["tls"]["mode"] == "selfSigned"  # gateways connect to an EPP over TLS without verifying it


def test_failure_mode_is_passed_through(render):
    pool = one(render(with_pool(failureMode="FailOpen")), "InferencePool", POOL)
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen" and gateway_api.problems(pool) == []


def test_network_policies_let_the_gateway_reach_the_epp_and_the_engines(render):
    docs = render(VALUES)
    router = one(docs, "NetworkPolicy", f"{FULLNAME}-router")["spec"]["ingress"]
    engine = one(docs, "NetworkPolicy", f"{FULLNAME}-engine")["spec"]["ingress"]
    assert {"ports": [{"port": "epp"}], "from": GATEWAYS} in router
    assert {"ports": [{"port": "http"}], "from": GATEWAYS} in engine
    anyone = render(with_pool(**{"from": []}))
    assert {"ports": [{"port": "epp"}]} in one(anyone, "NetworkPolicy", f"{FULLNAME}-router")["spec"]["ingress"]


def test_the_epp_needs_no_rbac_beyond_the_routers(render):
    """The router knows engines by registration: serving as the EPP calls no Kubernetes API, so the release's
    ServiceAccounts, Roles and bindings are the same with the feature on as off, and the router's pod still
    mounts no token."""
    for discovery in (False, True):
        base = {**VALUES, "router": {"kubernetesDiscovery": {"enabled": discovery}}}
        on, off = render(base), render({**base, "gateway": {"inferencePool": {"enabled": False}}})
        assert [d for d in on if d["kind"] in RBAC_KINDS] == [d for d in off if d["kind"] in RBAC_KINDS]
        token = pod_of(on, f"{FULLNAME}-router")["spec"]["automountServiceAccountToken"]
        assert token is discovery


def test_no_route_unless_asked(render):
    docs = render(with_pool(httpRoute={"enabled": False}))
    assert one(docs, "InferencePool", POOL) and not [d for d in docs if d["kind"] == "HTTPRoute"]


def test_router_disabled_renders_no_pool(render):
    docs = render({**VALUES, "router": {"enabled": False}})
    assert not [d for d in docs if d["kind"] in ("InferencePool", "HTTPRoute") or d["metadata"]["name"] == EPP]


VLLM = {"name": "llama", "runtime": "vllm", "model": "/m/llama", "gpus": 1}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {**with_pool(), "router": {"tokenizer": {"path": "/t"}}, "engines": [*VALUES["engines"], VLLM]},
            "gateway.inferencePool: engines[llama] has runtime vllm",
        ),
        ({**with_pool(), "engines": []}, "gateway.inferencePool needs a runtime ragserve engine pool"),
        (
            {**with_pool(), "engines": [VALUES["engines"][0], {**VALUES["engines"][1], "port": 8001}]},
            "gateway.inferencePool: the ragserve pools need one port (the InferencePool's targetPorts), got 8000, 8001",
        ),
        (
            {**with_pool(), "router": {"staticEngines": ["http://a:8000"]}},
            "router.staticEngines are not InferencePool members",
        ),
        (with_pool(tls={"mode": "secret"}), "gateway.inferencePool.tls.mode secret needs tls.secretName"),
        (with_pool(httpRoute={"enabled": True}), "gateway.inferencePool.httpRoute needs parentRefs"),
        (with_pool(failureMode="Ignore"), "failureMode"),
        (with_pool(tls={"mode": "mtls"}), "mode"),
    ],
    ids=[
        "vllm-pool",
        "no-pool",
        "two-ports",
        "static-engines",
        "secret-without-name",
        "route-without-parent",
        "bad-failure-mode",
        "bad-tls-mode",
    ],
)
def test_invalid_settings_fail_with_a_message(render, values: dict, message: str):
    with pytest.raises(Exception) as err:
        render(values)
    assert message in str(err.value)
