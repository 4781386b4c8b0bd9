"""The router's Ingress points at the router's HTTP Service as the chart renders it: every rule's backend
names that Service and one of its ports (by name or number), and the port's targetPort is a port the
router's pods serve. Checked with renamed releases and a non-default Service port, where a hard-coded
name or number would miss."""

from __future__ import annotations

import pytest

from tests.charts.conftest import SCENARIOS

HOSTS = [
    {
        "host": "a.example.com",
        "paths": [{"path": "/v1", "pathType": "Prefix"}, {"path": "/metrics", "pathType": "Exact"}],
    },
    {"host": "b.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]},
]
VALUES = {
    "ingress scenario": SCENARIOS["ingress"],
    "fullnameOverride, port 8080": {
        "fullnameOverride": "llm",
        "router": {"ingress": {"enabled": True, "hosts": HOSTS}, "service": {"port": 8080}},
    },
    "nameOverride, ClusterIP": {
        "nameOverride": "rag",
        "router": {"ingress": {"enabled": True, "hosts": HOSTS}, "service": {"type": "ClusterIP", "port": 9000}},
    },
}


def _of_router(manifests: list[dict], kind: str) -> list[dict]:
    return [
        m
        for m in manifests
        if m["kind"] == kind and m["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router"
    ]


@pytest.mark.parametrize("case", list(VALUES))
def test_ingress_backends_are_the_router_http_service(render, case):
    manifests = render(VALUES[case])
    (ingress,) = [m for m in manifests if m["kind"] == "Ingress"]
    (service,) = [
        s for s in _of_router(manifests, "Service") if s["metadata"]["labels"]["ragserve.dev/service"] == "http"
    ]
    (deployment,) = _of_router(manifests, "Deployment")
    container_ports = {
        p["name"]: p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]
    }
    service_ports = {p.get("name"): p for p in service["spec"]["ports"]}
    assert ingress["metadata"]["namespace"] == service["metadata"]["namespace"]

    backends = [path["backend"]["service"] for rule in ingress["spec"]["rules"] for path in rule["http"]["paths"]]
    expected_paths = sum(len(h["paths"]) for h in VALUES[case]["router"]["ingress"]["hosts"])
    assert len(backends) == expected_paths > 0
    for backend in backends:
        assert backend["name"] == service["metadata"]["name"]
        port = backend["port"]
        (target,) = [
            p for p in service["spec"]["ports"] if p.get("name") == port.get("name") or p["port"] == port.get("number")
        ]
        assert target is service_ports["http"]  # the HTTP port, not the registry's gRPC one
        target_port = target["targetPort"]
        assert target_port in container_ports or target_port in container_ports.values()
    if "service" in VALUES[case]["router"] and "port" in VALUES[case]["router"]["service"]:
        assert service_ports["http"]["port"] == VALUES[case]["router"]["service"]["port"]
